"""The processes section: workloads split across spawned processes sharing one segment,
beside as many processes spinning in a Python loop (the parallelism the machine gave).

The workers are spawned, so everything they run lives at module level here."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import queue
import threading
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import numpy as np

from hostkv.bench.common import (_create, _destroy, _figures, latency_summary, lock_metrics,
                                  lock_summary)
from hostkv.bench.engines import ViewEngine, replay
from hostkv.bench.workloads import WorkloadSpec, workload_specs
from hostkv.cache import HostKVCache
from hostkv.worker_view import WorkerView

PROCESS_COUNTS = (1, 2, 4)


@contextlib.contextmanager
def _replay_job(name: str, spec: WorkloadSpec, index: int, count: int
                ) -> Iterator[Callable[[], Dict[str, Any]]]:
    """Worker `index` of `count`: attaches, opens its WorkerView and yields the replay of its
    share of the workload (Workload.share)."""
    workload = spec.build()
    seq_ids = workload.share(index, count)
    requests = [workload.requests[i] for i in seq_ids]
    cache = HostKVCache.attach(name)
    try:
        with WorkerView(cache) as view:
            engine = ViewEngine(view)

            def run() -> Dict[str, Any]:
                reused, latencies = replay(engine, requests, seq_ids)
                return {"reused": reused, "tokens": sum(len(r) for r in requests),
                        "latencies": latencies}

            yield run
    finally:
        cache.close()


@contextlib.contextmanager
def _spin_job(iterations: int, index: int, count: int) -> Iterator[Callable[[], Dict[str, Any]]]:
    """The control: a pure-Python loop, to see how many cores the processes really get."""
    def run() -> Dict[str, Any]:
        total = 0
        for i in range(iterations):
            total += i
        return {"iterations": iterations}

    yield run


def _worker_main(job: Callable[..., Any], job_args: Tuple[Any, ...], index: int, count: int,
                 barriers: Tuple[Any, Any], results: Any) -> None:
    """A spawned worker: prepares its job, says so at the first barrier, starts at the
    second with the others, and puts its start and end times and figures (or its
    traceback) on results."""
    try:
        with job(*job_args, index, count) as run:
            for barrier in barriers:
                barrier.wait()
            start = time.perf_counter()
            figures = run()
            end = time.perf_counter()
            results.put({"index": index, "start": start, "end": end, **figures})
    except BaseException:
        for barrier in barriers:
            barrier.abort()
        results.put({"index": index, "error": traceback.format_exc()})


def _run_spawned(job: Callable[..., Any], job_args: Tuple[Any, ...], count: int,
                 at_start: Callable[[], Any] = lambda: None, timeout: float = 300.0
                 ) -> Tuple[Any, List[Dict[str, Any]], float]:
    """Runs job in `count` spawned processes released together once all are prepared;
    calls at_start in between, so that what it reads (the lock's counters) is read before
    any worker starts and after every worker's preparation.

    Returns:
        (what at_start returned, each worker's result, seconds from the first start to the
        last end).
    """
    ctx = multiprocessing.get_context("spawn")
    prepared, go = ctx.Barrier(count + 1), ctx.Barrier(count + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker_main,
                         args=(job, job_args, i, count, (prepared, go), results))
             for i in range(count)]
    for p in procs:
        p.start()
    started = None
    try:
        prepared.wait(timeout)
        started = at_start()
        go.wait(timeout)
    except threading.BrokenBarrierError:
        pass                        # a worker failed before the start: _collect says why
    except BaseException:
        go.abort()                  # the workers give up instead of waiting for ever
        raise
    outcomes = _collect(procs, results, count, timeout)
    return started, outcomes, max(o["end"] for o in outcomes) - min(o["start"] for o in outcomes)


def _collect(procs: List[Any], results: Any, count: int, timeout: float) -> List[Dict[str, Any]]:
    """Every worker's result; raises RuntimeError with the first worker's traceback."""
    outcomes: List[Dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < count:
            try:
                outcomes.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                raise RuntimeError(f"bench workers gave {len(outcomes)} of {count} results "
                                   f"in {timeout:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [o["error"] for o in outcomes if "error" in o]
    if errors:
        raise RuntimeError("a bench worker failed:\n" + errors[0])
    return outcomes


def run_processes(spec: WorkloadSpec, count: int) -> Dict[str, Any]:
    """Replays the workload from `count` spawned processes sharing one fresh segment."""
    workload = spec.build()
    cache = _create(workload.pool_pages(live=count), len(workload.requests))
    try:
        before, outcomes, elapsed = _run_spawned(_replay_job, (cache.name, spec), count,
                                                 at_start=lambda: lock_metrics(cache))
        after = lock_metrics(cache)
        evicted = cache.stats().evicted_pages
        cache.check()
    finally:
        _destroy(cache)
    row = _figures(sum(o["tokens"] for o in outcomes), len(workload.requests), elapsed,
                   sum(o["reused"] for o in outcomes), evicted)
    latencies = np.concatenate([o["latencies"] for o in outcomes])
    row.update({"workload": spec.name, "processes": count, "requests": len(workload.requests),
                "call_latency": latency_summary(latencies)})
    if before is not None and after is not None:
        row["lock"] = lock_summary(before, after)
        row["lock_held_fraction"] = row["lock"]["hold_total_ns"] / (elapsed * 1e9)
    return row


def cpu_rate(count: int, iterations: int) -> float:
    """Aggregate loop iterations per second of `count` processes spinning at once."""
    _, _, elapsed = _run_spawned(_spin_job, (iterations,), count)
    return count * iterations / elapsed


def process_scaling(specs: Sequence[WorkloadSpec], quick: bool) -> List[Dict[str, Any]]:
    """Each workload from 1, 2 and 4 processes, best of `repeats` runs; ratios are to the
    1-process run. Beside each run, as many processes spinning in a pure-Python loop measure
    the parallelism the machine gave right then (a shared 2-core machine may give none)."""
    iterations = 1_000_000 if quick else 5_000_000
    repeats = 1 if quick else 3
    rows = []
    for spec in specs:
        single: Dict[str, Any] = {}
        for count in PROCESS_COUNTS:
            cpu = max(cpu_rate(count, iterations) for _ in range(repeats))
            row = max((run_processes(spec, count) for _ in range(repeats)),
                      key=lambda r: r["tokens_per_s"])
            row.update({"repeats": repeats, "cpu_iterations_per_s": cpu})
            single = single or row
            row["vs_one_process"] = row["tokens_per_s"] / single["tokens_per_s"]
            row["cpu_vs_one_process"] = cpu / single["cpu_iterations_per_s"]
            rows.append(row)
    return rows


def process_specs(quick: bool, seed: int) -> List[WorkloadSpec]:
    """The process section's workloads: shared-prompt and multi-turn, four times the engine
    section's size in a full run, so that a run lasts long enough to compare."""
    scale = 1 if quick else 4
    return [dataclasses.replace(spec, size=spec.size * scale)
            for spec in workload_specs(quick, seed) if spec.name in ("shared-prompt", "multi-turn")]
