"""The sections that move KV bytes: gathers and scatters through pages_tensor() (the KV
data path), copies into a freshly attached pool (pool faults), and one engine step's saves
and loads through the copy engine, cold, warm and beside a plain copy (copy engine)."""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from hostkv._blockcopy import STREAM_STORE_BYTES, populate_pages
from hostkv.bench.common import _create, _destroy
from hostkv.bench.workloads import PAGE_SIZE
from hostkv.cache import HostKVCache, PrefaultStatus
from hostkv.config import KVLayout

# The data path's KV layout: 16 layers x 4 KV heads x 64 dims in bfloat16 is 16 KiB per
# token, 256 KiB per 16-token page (a 7B-class model's 2 MiB pages would not fit the pool).
DATA_LAYOUT = KVLayout(num_layers=16, num_kv_heads=4, head_dim=64, dtype="bfloat16")
GATHER_PAGES = 64


def _median_rates(ops: Dict[str, Callable[[], None]], nbytes: int, seconds: float,
                  rounds: int = 9) -> Dict[str, float]:
    """Bytes per second of each op (median of rounds). The ops take turns within a round,
    so that a noisy neighbour slows them alike, in a new seeded order each round, so that
    no op always follows the same one (and inherits its dirty cache lines)."""
    for op in ops.values():
        op()                                            # warm up (first touch, allocations)
    calls = {}
    for name, op in ops.items():
        start = time.perf_counter()
        n = 0
        while time.perf_counter() - start < seconds / rounds / len(ops):
            op()
            n += 1
        calls[name] = max(n, 1)
    samples: Dict[str, List[float]] = {name: [] for name in ops}
    order = list(ops)
    shuffle = np.random.default_rng(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            op = ops[name]
            start = time.perf_counter()
            for _ in range(calls[name]):
                op()
            samples[name].append(nbytes * calls[name] / (time.perf_counter() - start))
    return {name: float(np.median(rates)) for name, rates in samples.items()}


class _Rotation:
    """Hands out its items in turn, so that repeated ops touch different pages."""

    def __init__(self, items: Sequence[Any]) -> None:
        self._items = items
        self._next = 0

    def __call__(self) -> Any:
        item = self._items[self._next]
        self._next = (self._next + 1) % len(self._items)
        return item


def data_path(quick: bool, seed: int) -> Dict[str, Any]:
    """Gathers GATHER_PAGES random pages into a preallocated destination and scatters them
    back: through pages_tensor(), a plain torch tensor of the same shape, and numpy on
    pages_array(); plus the memcpy ceiling, copying as many contiguous pages of the pool."""
    num_pages = 256 if quick else 4096                  # 64 MiB or 1 GiB at 256 KiB a page
    page_bytes = DATA_LAYOUT.page_bytes(PAGE_SIZE)
    rng = np.random.default_rng(seed)
    batches = [rng.choice(num_pages, GATHER_PAGES, replace=False) for _ in range(16)]
    starts = rng.integers(0, num_pages - GATHER_PAGES, 16).tolist()
    report: Dict[str, Any] = {"layout": dataclasses.asdict(DATA_LAYOUT), "page_bytes": page_bytes,
                              "pool_bytes": num_pages * page_bytes, "pages_per_op": GATHER_PAGES}
    cache = _create(num_pages, 0, page_bytes=0, kv_layout=DATA_LAYOUT)
    try:
        ops = _numpy_ops(cache, _Rotation(batches), _Rotation(starts))
        ops.update(_torch_ops(cache, batches, report))
        with _one_torch_thread():
            rates = _median_rates(ops, GATHER_PAGES * page_bytes, 2.0 if quick else 12.0)
        del ops                                         # drop the views before closing
    finally:
        _destroy(cache)
    report["gbytes_per_s"] = {name: rate / 1e9 for name, rate in rates.items()}
    if "tensor_gather" in rates:
        report["pages_tensor_vs_plain"] = {kind: rates[f"tensor_{kind}"] / rates[f"plain_{kind}"]
                                           for kind in ("gather", "scatter")}
    return report


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Runs torch on one thread, as numpy and the copy ceiling run: on a small shared machine
    torch's thread pool turns a 1 ms gather into hundreds of ms whenever a neighbour holds a
    core, so ratios would measure the neighbour."""
    try:
        import torch
    except ImportError:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _numpy_ops(cache: HostKVCache, batch: Callable[[], np.ndarray],
               start: Callable[[], int]) -> Dict[str, Callable[[], None]]:
    """The copy ceiling (contiguous pages), take(out=) gathers, fancy-index scatters."""
    pool = cache.pages_array()
    pool.fill(1)                                        # touch the pool once
    host = np.empty((GATHER_PAGES, pool.shape[1]), dtype=np.uint8)

    def copy_ceiling() -> None:
        first = start()
        np.copyto(host, pool[first:first + GATHER_PAGES])

    def numpy_gather() -> None:
        # mode="clip": with the default "raise", numpy copies through a temporary buffer.
        np.take(pool, batch(), axis=0, out=host, mode="clip")

    def numpy_scatter() -> None:
        pool[batch()] = host

    return {"copy_ceiling": copy_ceiling, "numpy_gather": numpy_gather,
            "numpy_scatter": numpy_scatter}


def _torch_ops(cache: HostKVCache, batches: List[np.ndarray],
               report: Dict[str, Any]) -> Dict[str, Callable[[], None]]:
    """index_select gathers and index_copy_ scatters on pages_tensor() and on a plain tensor
    of the same shape; none (and a note in the report) without torch."""
    try:
        import torch
    except ImportError:
        report["torch"] = "skipped: torch is not installed"
        return {}
    report["torch_threads"] = 1
    shared = cache.pages_tensor()
    plain = torch.ones_like(shared)
    dst = torch.empty((GATHER_PAGES,) + tuple(shared.shape[1:]), dtype=shared.dtype)
    index = _Rotation([torch.from_numpy(b.astype(np.int64)) for b in batches])
    return {
        "tensor_gather": lambda: torch.index_select(shared, 0, index(), out=dst),
        "plain_gather": lambda: torch.index_select(plain, 0, index(), out=dst),
        "tensor_scatter": lambda: shared.index_copy_(0, index(), dst),
        "plain_scatter": lambda: plain.index_copy_(0, index(), dst),
    }


# -- copies into fresh mappings -----------------------------------------------------------------


@contextlib.contextmanager
def _fresh_mapping(name: str, prefault: bool = False
                   ) -> Iterator[Tuple[HostKVCache, Optional[PrefaultStatus]]]:
    """A handle attached to segment `name` just now: its own mapping of the pool, with no page
    table entries yet (each attach maps anew, as another process would), and with prefault
    once start_prefault() has finished on it, with the prefault's status. The caller drops
    its views of the pool before the block ends (close() refuses while they live)."""
    handle = HostKVCache.attach(name)
    try:
        status = None
        if prefault:
            handle.start_prefault()
            while handle.prefault_status().state == "running":
                time.sleep(0.001)
            status = handle.prefault_status()
        yield handle, status
    finally:
        handle.close()


def _take_turns(ops: Dict[str, Callable[[], float]], rounds: int) -> Dict[str, List[float]]:
    """Each op's samples over `rounds` rounds: the ops take turns within a round, so that a
    noisy neighbour slows them alike, in a new seeded order each round, so that no op always
    follows the same one."""
    samples: Dict[str, List[float]] = {name: [] for name in ops}
    order = list(ops)
    shuffle = np.random.default_rng(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            samples[name].append(ops[name]())
    return samples


def _rate(nbytes: int, op: Callable[[], Any]) -> float:
    """Bytes per second of one call of op, which moves nbytes."""
    start = time.perf_counter()
    op()
    return nbytes / (time.perf_counter() - start)


# -- pool faults ----------------------------------------------------------------------------------


def pool_faults(quick: bool) -> Dict[str, Any]:
    """np.copyto of the whole pool from a pre-faulted buffer, through a handle attached just
    before, so that its mapping has no page table entries yet (each attach maps anew, as
    another process would): cold, after start_prefault() has finished (timed too), and
    after the copy engine's populate_pages over the whole pool (a read per 64 KiB window,
    timed with the copy), beside np.copyto between two pre-faulted numpy buffers of the
    same size. They take turns within each round, in a new order each round; medians are
    reported (the populated copy's apart from gbytes_per_s, whose keys stay as they were)."""
    nbytes = (64 if quick else 512) << 20
    rounds = 3 if quick else 7
    page_bytes = DATA_LAYOUT.page_bytes(PAGE_SIZE)
    # Both written, so faulted in: np.zeros would map none (calloc), and the first plain
    # copy would pay the faults the pool's cold copy is measured against.
    src = np.ones(nbytes, np.uint8)
    dst = np.full(nbytes, 2, np.uint8)
    prefaults: List[float] = []
    last: Dict[str, Any] = {}                           # the last prefault's status
    creator = _create(nbytes // page_bytes, 0, page_bytes=0, kv_layout=DATA_LAYOUT)
    try:
        def into_pool(prefault: bool, populate: bool = False) -> float:
            with _fresh_mapping(creator.name, prefault) as (handle, status):
                if status is not None:
                    prefaults.append(status.done_bytes / max(status.seconds, 1e-9))
                    last.update(_prefault_fields(status),
                                huge_mapped_bytes=_huge_mapped_bytes(creator.name))
                pages = handle.pages_array()
                pool = pages.reshape(-1)
                if populate:
                    index = np.arange(pages.shape[0], dtype=np.int64)
                    mapped = np.zeros(pages.shape[0], dtype=np.uint8)

                    def op() -> None:
                        populate_pages(pool.ctypes.data, page_bytes, page_bytes,
                                       pages.shape[0], index, mapped)
                        np.copyto(pool, src)
                    rate = _rate(nbytes, op)
                else:
                    rate = _rate(nbytes, lambda: np.copyto(pool, src))
                del pool, pages                         # before close()
            return rate

        samples = _take_turns({"cold": lambda: into_pool(False),
                               "prefaulted": lambda: into_pool(True),
                               "populated": lambda: into_pool(False, populate=True),
                               "plain": lambda: _rate(nbytes, lambda: np.copyto(dst, src))},
                              rounds)
    finally:
        _destroy(creator)
    samples["prefault"] = prefaults
    populated = samples.pop("populated")
    return {"pool_bytes": nbytes, "rounds": rounds, **last,
            "gbytes_per_s": {name: float(np.median(rates)) / 1e9
                             for name, rates in samples.items()},
            "populated_gbytes_per_s": float(np.median(populated)) / 1e9}


def _prefault_fields(status: PrefaultStatus) -> Dict[str, Any]:
    """What the report says of a finished prefault."""
    return {"method": status.method, "prefault_state": status.state,
            "huge_pages": status.huge_pages, "huge_policy": status.huge_policy}


def _huge_mapped_bytes(name: str) -> Optional[int]:
    """Bytes of this process's mappings of segment `name` that the kernel maps in huge (PMD)
    pages (ShmemPmdMapped in /proc/self/smaps): what "advised" got; None where unreadable."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    total, inside = 0, False
    for line in lines:
        first = line.split(maxsplit=1)[0] if line else ""
        if "-" in first and not first.endswith(":"):    # a mapping's first line: its range
            inside = line.endswith("/" + name)
        elif inside and line.startswith("ShmemPmdMapped:"):
            total += int(line.split()[1]) << 10
    return total


# -- the copy engine: one engine step's saves and loads -------------------------------------------


# An 8B model's KV (Llama-3-8B's 32 layers, 8 KV heads, head_dim 128, bfloat16: 2 MiB a
# 16-token page) cut to 8 layers, so that a step's pages, the engine's blocks and the plain
# copy's buffers fit a small machine together: 512 KiB a page. A layer's copy is the same
# strided runs whatever the layer count; fewer layers only mean fewer layers per call.
STEP_LAYOUT = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, dtype="bfloat16")
STEP_FULL_LAYERS = 32
STEP_OPS = ("cold_save", "cold_load", "warm_save", "warm_load", "torch_copy", "numpy_copy",
            "cold_save_faulting")
# The other block layouts engines declare, saved and loaded warm beside vLLM's in the same
# rounds: the engine's tensors are views of the same buffers in each layout's shape.
STEP_LAYOUTS = ("vllm-NHD", "flash-attn", "flashinfer-NHD", "flashinfer-HND")


def _layout_views(kv: List[Any], num_blocks: int) -> Dict[str, Tuple[Any, List[Any]]]:
    """Each of STEP_LAYOUTS's block layout, and per-layer tensors in it over kv's buffers
    (vLLM's [blocks, kv_heads, block_size, 2*head_dim], contiguous)."""
    from hostkv.copy_engine import FLASH_ATTN, FLASHINFER_HND, FLASHINFER_NHD, VLLM
    heads, dim, tokens = STEP_LAYOUT.num_kv_heads, STEP_LAYOUT.head_dim, PAGE_SIZE
    return {
        # vLLM's logical view over a [blocks, block_size, kv_heads, 2*head_dim] buffer.
        "vllm-NHD": (VLLM, [t.view(num_blocks, tokens, heads, 2 * dim).permute(0, 2, 1, 3)
                            for t in kv]),
        "flash-attn": (FLASH_ATTN, [t.view(2, num_blocks, tokens, heads, dim) for t in kv]),
        "flashinfer-NHD": (FLASHINFER_NHD, [t.view(num_blocks, 2, tokens, heads, dim)
                                            for t in kv]),
        "flashinfer-HND": (FLASHINFER_HND, [t.view(num_blocks, 2, heads, tokens, dim)
                                            for t in kv]),
    }


def copy_engine_step(quick: bool, seed: int) -> Dict[str, Any]:
    """One engine step's pages saved (engine blocks -> pool pages) and loaded (pages ->
    blocks) through CopyEngine, from vLLM's per-layer [blocks, kv_heads, block_size,
    2*head_dim] tensors, in conditions that take turns each round: a cold pool (each save
    or load through a mapping attached just before, as in the pool-faults section: the
    pages exist, this mapping has never touched them; a save maps them in before it copies,
    populate_pages, and, to show what that gives, a save without it), a warm
    pool (one mapping that start_prefault() populated), and the physical limit, as many
    bytes copied between two pre-faulted buffers (torch copy_ and np.copyto). Best and
    median GB/s of each, and each median over the faster plain copy's; torch runs on one
    thread, as the copy engine's compiled loop and numpy do. The other block layouts
    engines declare (STEP_LAYOUTS) are saved and loaded warm in the same rounds. Without
    torch, a note instead.
    """
    try:
        import torch

        from hostkv.copy_engine import VLLM, CopyEngine
    except ImportError:
        return {"skipped": "torch is not installed"}
    layout = STEP_LAYOUT
    step_pages = 64 if quick else 128                   # 32 or 64 MiB a step
    rounds = 3 if quick else 25
    page_bytes = layout.page_bytes(PAGE_SIZE)
    nbytes = step_pages * page_bytes
    # Twice the step's pages and blocks, so that a step's are scattered as an engine's are.
    num_pages = num_blocks = 2 * step_pages
    rng = np.random.default_rng(seed)
    pages = rng.choice(num_pages, step_pages, replace=False).tolist()   # as an engine hands them
    blocks = rng.choice(num_blocks, step_pages, replace=False).tolist()
    dtype = getattr(torch, layout.dtype)
    kv = [torch.ones(num_blocks, layout.num_kv_heads, PAGE_SIZE, 2 * layout.head_dim,
                     dtype=dtype) for _ in range(layout.num_layers)]   # written: faulted in
    src = torch.full((nbytes,), 1, dtype=torch.uint8)
    dst = torch.full((nbytes,), 2, dtype=torch.uint8)
    src_np, dst_np = src.numpy(), dst.numpy()           # the same two buffers
    report: Dict[str, Any] = {
        "layout": dataclasses.asdict(layout), "full_layers": STEP_FULL_LAYERS,
        "block_layout": VLLM.name, "page_bytes": page_bytes, "step_pages": step_pages,
        "step_bytes": nbytes, "pool_pages": num_pages, "engine_blocks": num_blocks,
        "rounds": rounds, "torch_threads": 1, "stream_store_bytes": STREAM_STORE_BYTES,
    }

    faults: Dict[str, List[int]] = {name: [] for name in STEP_OPS}

    def engine_on(handle: HostKVCache, kv_tensors: List[Any] = kv,
                  block_layout: Any = VLLM) -> CopyEngine:
        return CopyEngine(handle.pages_tensor(), layout, PAGE_SIZE, kv_tensors, block_layout)

    def timed(name: str, op: Callable[[], int]) -> float:
        """The rate of one call of op, which returns the bytes it moved; its page faults (this
        process's, the prefault thread having ended) go to faults[name] where kept."""
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        moved = op()
        elapsed = time.perf_counter() - start
        if name in faults:
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        if moved != nbytes:
            raise RuntimeError(f"{name} moved {moved} bytes of a {nbytes}-byte step")
        return nbytes / elapsed

    def cold(save: bool, populate: bool = True) -> float:
        name = ("cold_save" if save else "cold_load") + ("" if populate else "_faulting")
        with _fresh_mapping(creator.name) as (handle, _):
            engine = engine_on(handle)
            if not populate:
                engine._cpu_setup().mapped = None       # as where the kernel cannot populate
            rate = (timed(name, lambda: engine.save(blocks, pages)) if save
                    else timed(name, lambda: engine.load(pages, blocks)))
            del engine                                  # its views, before close()
        return rate

    def warm_ops(name: str, engine: CopyEngine) -> Dict[str, Callable[[], float]]:
        """A save and a load of the step through engine, named after its layout."""
        return {f"{name} save": lambda: timed(f"{name} save", lambda: engine.save(blocks, pages)),
                f"{name} load": lambda: timed(f"{name} load", lambda: engine.load(pages, blocks))}

    def torch_copy() -> int:
        dst.copy_(src)
        return nbytes

    def numpy_copy() -> int:
        np.copyto(dst_np, src_np)
        return nbytes

    creator = _create(num_pages, 0, page_bytes=0, kv_layout=layout)
    try:
        with _one_torch_thread(), _fresh_mapping(creator.name, prefault=True) as (warm, status):
            if status is not None:                      # (always, with prefault=True)
                report.update(_prefault_fields(status),
                              huge_mapped_bytes=_huge_mapped_bytes(creator.name))
            warm_engine = engine_on(warm)
            ops: Dict[str, Callable[[], float]] = {
                "cold_save": lambda: cold(True), "cold_load": lambda: cold(False),
                "cold_save_faulting": lambda: cold(True, populate=False),
                "warm_save": lambda: timed("warm_save", lambda: warm_engine.save(blocks, pages)),
                "warm_load": lambda: timed("warm_load", lambda: warm_engine.load(pages, blocks)),
                "torch_copy": lambda: timed("torch_copy", torch_copy),
                "numpy_copy": lambda: timed("numpy_copy", numpy_copy),
            }
            described: Dict[str, str] = {}
            for name, (block_layout, tensors) in _layout_views(kv, num_blocks).items():
                described[name] = block_layout.name
                ops.update(warm_ops(name, engine_on(warm, tensors, block_layout)))
            for first_call in ops.values():
                first_call()                            # once untimed: first calls
            for counts in faults.values():
                counts.clear()
            samples = _take_turns(ops, rounds)
            del warm_engine, ops, first_call            # their views, before close()
    finally:
        _destroy(creator)
    medians = {name: float(np.median(values)) / 1e9 for name, values in samples.items()}
    rates = {name: {"best": max(samples[name]) / 1e9, "median": medians[name]}
             for name in STEP_OPS}
    limit = max(("torch_copy", "numpy_copy"), key=lambda name: rates[name]["median"])
    report["gbytes_per_s"] = rates
    report["limit"] = limit
    report["vs_limit"] = {name: rates[name]["median"] / rates[limit]["median"] for name in rates}
    report["page_faults"] = {name: int(np.median(counts)) for name, counts in faults.items()}
    report["layouts"] = {
        name: {"block_layout": described[name],
               **{f"{kind}_gbytes_per_s": medians[f"{name} {kind}"] for kind in ("save", "load")},
               **{f"{kind}_vs_limit": medians[f"{name} {kind}"] / rates[limit]["median"]
                  for kind in ("save", "load")}}
        for name in STEP_LAYOUTS}
    return report
