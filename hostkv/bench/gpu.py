"""The gpu-copy section: a step's saves and loads on a CUDA device, and what a save beside
the forward costs it.

Runs only where torch sees a CUDA device (elsewhere the section says it was skipped). Through
``CopyEngine`` on per-layer CUDA tensors in vLLM's layout and the pool registered for DMA
(``hostkv.cuda_copy``), timed from submission until the transfer's event completed, beside
the physical limit: torch's ``copy_`` of as many bytes between one device buffer and pinned
host memory (``cudaMemcpyAsync`` from page-locked memory, one call). Then a large matmul is
timed with CUDA events on the compute stream, alone and with a save submitted before each
of its calls (the save's DMA and gathers run on their side stream beside it). It also reports
the copy calls a step's save and load make (``CopyEngine.stats()``), the device memory held
for staging, and how long ``submit_save`` takes to answer with another save in flight (what
a vLLM worker's ``wait_for_save`` costs the step).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List

import numpy as np

from hostkv.bench.common import _create, _destroy
from hostkv.bench.datapath import (STEP_FULL_LAYERS, STEP_LAYOUT, _fresh_mapping,
                                   _take_turns)
from hostkv.bench.workloads import PAGE_SIZE

__all__ = ["GPU_OPS", "gpu_copy_step"]

GPU_OPS = ("save", "load", "pinned_d2h", "pinned_h2d")
REGISTER_TIMEOUT_S = 120.0      # registering the pool runs in the background: waited for
MATMUL_SIZE = 8192              # bf16 [8192, 8192] @ [8192, 8192]: ~1.1 TFLOP a call


def gpu_copy_step(quick: bool, seed: int) -> Dict[str, Any]:
    """GB/s of a step's save and load through CopyEngine on a CUDA device against a pinned
    ``cudaMemcpyAsync`` of the same bytes each way, medians of interleaved rounds, and the
    slow-down of a matmul with saves beside it. Without torch or a CUDA device, a note."""
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    from hostkv.copy_engine import VLLM, CopyEngine

    layout = STEP_LAYOUT
    step_pages = 64 if quick else 128
    rounds = 3 if quick else 15
    page_bytes = layout.page_bytes(PAGE_SIZE)
    nbytes = step_pages * page_bytes
    num_pages = num_blocks = 2 * step_pages
    rng = np.random.default_rng(seed)
    pages = rng.choice(num_pages, step_pages, replace=False).tolist()
    blocks = rng.choice(num_blocks, step_pages, replace=False).tolist()
    device = torch.device("cuda", torch.cuda.current_device())
    dtype = getattr(torch, layout.dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    kv = [torch.randn(num_blocks, layout.num_kv_heads, PAGE_SIZE, 2 * layout.head_dim,
                      dtype=dtype, device=device, generator=generator)
          for _ in range(layout.num_layers)]
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    report: Dict[str, Any] = {
        "device": torch.cuda.get_device_name(device), "layout": dataclasses.asdict(layout),
        "full_layers": STEP_FULL_LAYERS, "block_layout": VLLM.name, "page_bytes": page_bytes,
        "step_pages": step_pages, "step_bytes": nbytes, "rounds": rounds,
    }

    def timed(op: Callable[[], Any]) -> float:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        op()
        torch.cuda.synchronize(device)
        return nbytes / (time.perf_counter() - start)

    creator = _create(num_pages, 0, page_bytes=0, kv_layout=layout)
    try:
        with _fresh_mapping(creator.name, prefault=True) as (handle, _):
            engine = CopyEngine(handle.pages_tensor(), layout, PAGE_SIZE, kv, VLLM)
            try:
                registration = engine.registration()
                deadline = time.monotonic() + REGISTER_TIMEOUT_S
                while (registration.registered_bytes < registration.nbytes
                       and registration.failed is None and time.monotonic() < deadline):
                    time.sleep(0.01)
                report["registered_bytes"] = registration.registered_bytes
                report["register_failed"] = registration.failed

                def save() -> None:
                    transfer = engine.submit_save(blocks, pages)
                    transfer.wait()
                    if transfer.error is not None:
                        raise transfer.error

                def load() -> None:
                    transfer = engine.submit_load(pages, blocks)
                    transfer.wait_all_layers()
                    transfer.wait()
                    if transfer.error is not None:
                        raise transfer.error

                ops: Dict[str, Callable[[], float]] = {
                    "save": lambda: timed(save),
                    "load": lambda: timed(load),
                    "pinned_d2h": lambda: timed(
                        lambda: pinned.copy_(device_buffer, non_blocking=True)),
                    "pinned_h2d": lambda: timed(
                        lambda: device_buffer.copy_(pinned, non_blocking=True)),
                }
                for first_call in ops.values():
                    first_call()                        # once untimed: first calls
                samples = _take_turns(ops, rounds)
                report["copy_calls"] = _copy_calls(engine, blocks, pages)
                report["staging_bytes"] = engine.stats().staging_bytes
                report["submit_save_us"] = _submit_latency(torch, engine, blocks, pages,
                                                           rounds)
                report["bytes_exact"] = _saved_bytes_match(engine, handle, kv, blocks, pages)
                report["matmul"] = _matmul_beside_saves(torch, device, engine, blocks, pages,
                                                         calls=4 if quick else 20)
            finally:
                engine.close()
                del engine
    finally:
        _destroy(creator)
    medians = {name: float(np.median(values)) / 1e9 for name, values in samples.items()}
    report["gbytes_per_s"] = {name: {"best": max(samples[name]) / 1e9, "median": medians[name]}
                              for name in GPU_OPS}
    report["vs_pinned"] = {"save": medians["save"] / medians["pinned_d2h"],
                           "load": medians["load"] / medians["pinned_h2d"]}
    return report


def _copy_calls(engine: Any, blocks: List[int], pages: List[int]) -> Dict[str, float]:
    """DMA calls of one step's save and load, in all and per (page, layer)."""
    layers = STEP_LAYOUT.num_layers
    before = engine.stats().copy_calls
    engine.submit_save(blocks, pages).wait()
    save = engine.stats().copy_calls - before
    transfer = engine.submit_load(pages, blocks)
    transfer.wait_all_layers()
    transfer.wait()
    load = engine.stats().copy_calls - before - save
    return {"save": save, "load": load, "save_per_page_layer": save / (len(pages) * layers),
            "load_per_page_layer": load / (len(pages) * layers)}


def _submit_latency(torch: Any, engine: Any, blocks: List[int], pages: List[int],
                    rounds: int) -> Dict[str, float]:
    """Microseconds ``submit_save`` takes to answer while the previous save is still in
    flight (median and worst of ``rounds``)."""
    took = []
    in_flight = 0
    for _ in range(rounds):
        first = engine.submit_save(blocks, pages)
        start = time.perf_counter()
        second = engine.submit_save(blocks, pages)
        took.append((time.perf_counter() - start) * 1e6)
        in_flight += not first.done()       # whether the first was in flight after all
        first.wait()
        second.wait()
    return {"median": float(np.median(took)), "max": float(max(took)),
            "rounds_with_a_save_in_flight": in_flight, "rounds": rounds}


def _saved_bytes_match(engine: Any, handle: Any, kv: List[Any], blocks: List[int],
                       pages: List[int]) -> bool:
    """Whether the pool's pages after a save hold what the CPU path writes from the same
    blocks (into a pool tensor of the same shape)."""
    import torch

    from hostkv.copy_engine import VLLM, CopyEngine

    transfer = engine.submit_save(blocks, pages)
    transfer.wait()
    pool = handle.pages_tensor()
    expected = torch.zeros_like(pool)
    cpu = CopyEngine(expected, STEP_LAYOUT, PAGE_SIZE, [t.cpu() for t in kv], VLLM)
    cpu.save(blocks, pages)
    cpu.close()
    return bool(torch.equal(pool[pages], expected[pages]))


def _matmul_beside_saves(torch: Any, device: Any, engine: Any, blocks: List[int],
                         pages: List[int], calls: int) -> Dict[str, float]:
    """Milliseconds per matmul call on the compute stream (CUDA events), alone and with a
    save submitted before each call, medians of three passes each, taking turns."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=torch.bfloat16)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=torch.bfloat16)

    def run(with_saves: bool) -> float:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        transfers = []
        start.record()
        for _ in range(calls):
            if with_saves:
                transfers.append(engine.submit_save(blocks, pages))
            torch.matmul(a, b)
        end.record()
        end.synchronize()
        for transfer in transfers:
            transfer.wait()
        return start.elapsed_time(end) / calls

    run(False)
    run(True)                                           # first calls
    alone, beside = [], []
    for _ in range(3):
        alone.append(run(False))
        beside.append(run(True))
    ms_alone, ms_beside = float(np.median(alone)), float(np.median(beside))
    return {"ms_alone": ms_alone, "ms_beside_saves": ms_beside,
            "slowdown": ms_beside / ms_alone, "calls": calls}
