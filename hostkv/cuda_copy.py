"""The copy engine's GPU path: the pool registered for DMA, bounded staging, side streams.

A save runs on a low-priority save stream that first waits, by an event, for the work the
compute stream holds (the forward that wrote the KV). On that stream it uploads the step's
block indices from pinned memory (``non_blocking``: a pageable upload would make torch
synchronise the stream, and with it the host, with the whole forward), gathers each layer's
blocks into a staging buffer laid out as whole canonical pages (``index_select`` into it, no
temporary), and enqueues one 2-D DMA per page into the pool (``cuMemcpy2DAsync``: at TP=1 a
page is one run, under tensor parallelism one row per (layer, K/V, token) of the rank's heads
at the pool's pitch), adjacent pages merged into one copy. An event after the copies says
when it is over; nothing on the host waits for it, and the index tensors live until it has
completed.

A load runs the other way on a high-priority load stream (the forward waits for it), a layer
event each, so :meth:`LoadTransfer.wait_layer` / ``wait_all_layers`` order the compute
stream after it without blocking the host. A load that fails half way still makes the
compute stream wait for what it enqueued, so no late copy lands in blocks the forward then
recomputes.

**Bounded staging.** Each direction owns one device buffer, allocated once when the engine's
tensors are registered (``staging_bytes`` each, :data:`DEFAULT_STAGING_BYTES` unless told,
at least one page of the rank); a transfer that does not fit runs in pieces through it,
first by layers (every page, some layers), then by pages (every layer): the staging never
grows with the prompt.

**Registration.** The pool is registered with ``cudaHostRegister`` (page-locked, so the DMA
engine reads and writes it directly) from a background thread, in chunks of whole pages of
about :data:`REGISTER_CHUNK_BYTES`: a chunk holds the driver's locks for a fraction of a
second, and no page straddles two chunks. Merged copies are split at chunk boundaries, so no
copy spans a registered and a pageable range. Until a range is registered, and if its
registration fails (each failure logged once and counted), copies to it run through the
driver's pageable path: correct, slower, and synchronous for the host.

Every CUDA primitive goes through a :class:`CudaDevice` (torch.cuda's streams, events,
pinned uploads, host registration, the driver's copy function); the tests hand the copier a
recording stand-in over CPU tensors and a host copy function, which runs this module's
address arithmetic, staging and stream ordering on every machine.

Needs torch (with CUDA, outside the tests). ``hostkv.copy_engine`` imports this module only
for CUDA tensors, and this module never imports it back (what both need lives in
``hostkv._copyplan``).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hostkv._copyplan import CopyPlan
from hostkv._cudacopy import memcpy2d_batch
from hostkv.transfers import Transfer

__all__ = ["CudaCopier", "CudaDevice", "DEFAULT_STAGING_BYTES", "HostRegistration",
           "LoadTransfer", "REGISTER_CHUNK_BYTES", "copies_for_pages", "plan_pieces",
           "run_offsets"]

logger = logging.getLogger("hostkv.cuda")

# Each direction's staging buffer unless the engine is told otherwise: 128 MiB is 64 pages
# of an 8B model's (32 layers, 8 KV heads of 128, bf16, 16 tokens), 1,024 tokens a piece.
DEFAULT_STAGING_BYTES = 128 << 20
# A registration chunk is the whole pages that fit in this many bytes (at least one page):
# cudaHostRegister takes ~0.1-0.3 s a GiB holding the driver's locks, which every other
# CUDA call of the process waits on; 2 GiB keeps each hold short.
REGISTER_CHUNK_BYTES = 2 << 30
# cudaHostRegisterPortable: pinned for every CUDA context of the process, not only the
# registering thread's.
_REGISTER_PORTABLE = 1


def run_offsets(shape: Sequence[int], strides: Sequence[int]) -> np.ndarray:
    """Byte offsets of every run of a CopyPlan's grid, row-major (one 0 for no grid)."""
    offsets = np.zeros(1, dtype=np.int64)
    for size, stride in zip(shape, strides):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).ravel()
    return offsets


def plan_pieces(pages: int, layers: int, page_layer_bytes: int,
                capacity: int) -> List[Tuple[int, int, int, int]]:
    """How a transfer of ``pages`` pages runs through a staging buffer of ``capacity`` bytes.

    Whole if it fits; else in groups of layers over every page (a load's early layers are
    ready before its last ones); else, when even one layer of every page does not fit, in
    groups of pages over every layer (one copy a page). ``capacity`` must hold one page.

    Returns:
        (first page, stop page, first layer, stop layer) per piece, in order.

    Raises:
        ValueError: a capacity below one page of every layer.
    """
    page_bytes = layers * page_layer_bytes
    if capacity < page_bytes:
        raise ValueError(f"hostkv: staging of {capacity} bytes holds no page of "
                         f"{page_bytes} bytes")
    if pages * page_bytes <= capacity:
        return [(0, pages, 0, layers)]
    if pages * page_layer_bytes <= capacity:
        group = capacity // (pages * page_layer_bytes)
        return [(0, pages, first, min(first + group, layers))
                for first in range(0, layers, group)]
    group = capacity // page_bytes
    return [(first, min(first + group, pages), 0, layers) for first in range(0, pages, group)]


class _Copies:
    """A batch of 2-D copies: six parallel uint64 arrays, as ``memcpy2d_batch`` takes them."""

    __slots__ = ("host", "device", "host_pitch", "device_pitch", "width", "height")

    def __init__(self, host: np.ndarray, device: np.ndarray, host_pitch: np.ndarray,
                 device_pitch: np.ndarray, width: np.ndarray, height: np.ndarray) -> None:
        self.host, self.device = host, device
        self.host_pitch, self.device_pitch = host_pitch, device_pitch
        self.width, self.height = width, height

    def __len__(self) -> int:
        return int(self.host.size)


def copies_for_pages(plan: CopyPlan, pages: np.ndarray, host_base: int, page_stride: int,
                     device_base: int, device_page_bytes: int,
                     pages_per_chunk: int) -> _Copies:
    """The 2-D copies that move ``pages`` of the pool (at ``host_base``, ``page_stride``
    apart) to or from consecutive staging pages (at ``device_base``, ``device_page_bytes``
    apart), one page's layout being ``plan`` (pool side, staging side).

    A plan of at most one axis (every layout hostkv stages: the rows of a rank's heads
    have one pitch on either side) is one copy a page, its rows the axis; then pages
    adjacent in the pool and in the staging merge into one copy, except across a multiple
    of ``pages_per_chunk`` (a registration chunk's edge). A plan of more axes is one copy
    per index of its outer axes.
    """
    n = pages.size
    if plan.shape:
        rows, host_pitch, device_pitch = plan.shape[-1], plan.pool_strides[-1], plan.engine_strides[-1]
        outer = (plan.shape[:-1], plan.pool_strides[:-1], plan.engine_strides[:-1])
    else:
        rows, host_pitch, device_pitch = 1, plan.run, plan.run
        outer = ((), (), ())
    host = host_base + pages.astype(np.int64) * page_stride
    device = device_base + np.arange(n, dtype=np.int64) * device_page_bytes
    height = np.full(n, rows, dtype=np.int64)
    continues = (rows * host_pitch == page_stride and rows * device_pitch == device_page_bytes)
    if not outer[0] and continues and n > 1:
        # A page starts a new copy unless it follows the previous one in the pool and does
        # not start a registration chunk.
        nxt = pages[1:].astype(np.int64)
        joins = (nxt == pages[:-1].astype(np.int64) + 1) & (nxt % pages_per_chunk != 0)
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        height = np.diff(np.append(starts, n)) * rows
        host, device = host[starts], device[starts]
    offsets_host = run_offsets(outer[0], outer[1])
    offsets_device = run_offsets(outer[0], outer[2])
    host = (host[:, None] + offsets_host[None, :]).ravel()
    device = (device[:, None] + offsets_device[None, :]).ravel()
    height = np.repeat(height, offsets_host.size)
    count = host.size

    def full(value: int) -> np.ndarray:
        return np.full(count, value, dtype=np.uint64)

    return _Copies(host.astype(np.uint64), device.astype(np.uint64), full(host_pitch),
                   full(device_pitch), full(plan.run), height.astype(np.uint64))


class CudaDevice:
    """The CUDA primitives the copier uses, over torch.cuda and the driver, on one device.

    Each is one call of torch or the driver; tests replace the object with a recording
    stand-in that implements the same methods over CPU tensors (``tests/lib/cuda_standin.py``).

    Args:
        device: The CUDA device of the engine's KV tensors.
    """

    def __init__(self, device: "torch.device") -> None:
        self.device = device
        self._memcpy2d: Optional[int] = None

    def priorities(self) -> Tuple[int, int]:
        """(lowest, highest) stream priority; a lower number is a higher priority."""
        low, high = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
        return int(low), int(high)

    def new_stream(self, priority: int) -> Any:
        """A side stream of that priority."""
        return torch.cuda.Stream(device=self.device, priority=priority)

    def current_stream(self) -> Any:
        """The stream the engine's work is on now (the compute stream)."""
        return torch.cuda.current_stream(self.device)

    def new_event(self) -> Any:
        """An event without timing (timing events cost a synchronisation each)."""
        return torch.cuda.Event()

    def use(self, stream: Any) -> Any:
        """A context in which torch's kernels and allocations go to ``stream``."""
        return torch.cuda.stream(stream)

    def stream_handle(self, stream: Any) -> int:
        """The ``CUstream`` the driver's copies are enqueued on."""
        return int(stream.cuda_stream)

    def upload(self, index: np.ndarray) -> Tuple[torch.Tensor, torch.Tensor]:
        """``index`` on the device, on the current stream, without synchronising: copied
        into pinned memory, then ``non_blocking``. Answers (pinned, device): both must live
        until the stream has passed the copy."""
        pinned = torch.empty(index.size, dtype=torch.int64, pin_memory=True)
        pinned.numpy()[:] = index
        return pinned, pinned.to(self.device, non_blocking=True)

    def empty(self, nbytes: int) -> torch.Tensor:
        """Device bytes (a staging buffer)."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def memcpy2d(self) -> int:
        """The address of the driver's ``cuMemcpy2DAsync_v2``."""
        if self._memcpy2d is None:
            driver = ctypes.CDLL("libcuda.so.1")
            address = ctypes.cast(driver.cuMemcpy2DAsync_v2, ctypes.c_void_p).value
            if not address:
                raise RuntimeError("hostkv: libcuda.so.1 has no cuMemcpy2DAsync_v2")
            self._memcpy2d = int(address)
        return self._memcpy2d

    def enqueue(self, to_host: bool, copies: _Copies, stream: Any) -> int:
        """Enqueues a batch of 2-D copies on ``stream`` (one compiled call); answers how
        many."""
        return memcpy2d_batch(self.memcpy2d(), to_host, copies.host, copies.device,
                              copies.host_pitch, copies.device_pitch, copies.width,
                              copies.height, self.stream_handle(stream))

    def bind_thread(self) -> None:
        """Makes this device current in a new thread (else the runtime would use device 0
        and make a context there)."""
        torch.cuda.set_device(self.device)

    def host_register(self, address: int, nbytes: int) -> int:
        """``cudaHostRegister``; answers its error code (0: registered)."""
        err = torch.cuda.cudart().cudaHostRegister(address, nbytes, _REGISTER_PORTABLE)
        return int(getattr(err, "value", err))

    def host_unregister(self, address: int) -> None:
        """``cudaHostUnregister`` of a range :meth:`host_register` registered."""
        torch.cuda.cudart().cudaHostUnregister(address)


class HostRegistration:
    """Registers a host buffer with CUDA (``cudaHostRegister``) in chunks of whole pages,
    off the serving path, and unregisters what it registered.

    A chunk whose registration fails stays pageable (copies to it are correct, slower); the
    thread goes on with the next. Each distinct failure is logged once (logger
    ``hostkv.cuda``); all are counted.

    Args:
        cuda: The device's primitives.
        address, nbytes: The buffer (the pool, whole pages from its first).
        page_bytes: Bytes of a page: chunks hold whole pages.
        chunk_bytes: About how much one call registers.

    Attributes:
        registered_bytes: Bytes registered so far.
        failed: The first failure's message, if any.
        failures: How many chunks (or thread starts) failed.
        pages_per_chunk: Pages in a chunk (chunk ``i`` starts at page ``i * pages_per_chunk``).
    """

    def __init__(self, cuda: CudaDevice, address: int, nbytes: int, page_bytes: int,
                 chunk_bytes: int = REGISTER_CHUNK_BYTES) -> None:
        self.cuda = cuda
        self.address = address
        self.nbytes = nbytes
        self.pages_per_chunk = max(1, chunk_bytes // page_bytes)
        self.chunk_bytes = self.pages_per_chunk * page_bytes
        self.registered_bytes = 0
        self.failed: Optional[str] = None
        self.failures = 0
        self.finished = threading.Event()
        self._logged: set = set()
        self._chunks: List[int] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="hostkv-cuda-register",
                                        daemon=True)
        self._thread.start()

    def _fail(self, message: str) -> None:
        self.failures += 1
        if self.failed is None:
            self.failed = message
        if message not in self._logged:
            self._logged.add(message)
            logger.warning("hostkv: %s; copies to that part of the pool stay pageable "
                           "(slower, and synchronous for the host)", message)

    def _run(self) -> None:
        try:
            self.cuda.bind_thread()
            offset = 0
            while offset < self.nbytes and not self._stop:
                size = min(self.chunk_bytes, self.nbytes - offset)
                code = self.cuda.host_register(self.address + offset, size)
                if code != 0:
                    self._fail(f"cudaHostRegister of {size} bytes failed with CUDA error "
                               f"{code}")
                else:
                    self._chunks.append(self.address + offset)
                    self.registered_bytes += size
                offset += size
        except Exception as exc:          # noqa: BLE001 - a thread's error must show
            self._fail(f"registering the pool with CUDA failed: {exc!r}")
        finally:
            self.finished.set()

    def close(self) -> None:
        """Stops registering (after the chunk in progress) and unregisters every chunk
        (before the pool is unmapped)."""
        self._stop = True
        self._thread.join()
        for address in self._chunks:
            self.cuda.host_unregister(address)
        self._chunks = []
        self.registered_bytes = 0


class _CudaTransfer(Transfer):
    """A transfer over once a CUDA event recorded after its copies has completed.

    Attributes:
        copies: DMA calls it enqueued.
    """

    def __init__(self, nbytes: int, event: Any, started: float, copies: int = 0) -> None:
        super().__init__(nbytes)
        self.event = event
        self.started = started
        self.copies = copies

    def done(self) -> bool:
        if not self._finished.is_set() and self.event.query():
            self.seconds = time.perf_counter() - self.started
            self._finish()
        return self._finished.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        if timeout is None:
            if not self._finished.is_set():
                self.event.synchronize()
            return self.done()
        # A CUDA event has no timed wait: poll it, briefly asleep between queries.
        deadline = time.monotonic() + timeout
        while not self.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.0005, left))
        return True


class LoadTransfer(_CudaTransfer):
    """A load: an event per layer, which :meth:`wait_layer` makes the current stream
    wait for (the host never blocks)."""

    def __init__(self, nbytes: int, layer_events: List[Any], started: float,
                 cuda: CudaDevice, copies: int = 0) -> None:
        super().__init__(nbytes, layer_events[-1], started, copies)
        self.layer_events = layer_events
        self._cuda = cuda

    def wait_layer(self, layer: int) -> None:
        """Orders the current stream's next work after layer ``layer``'s load (the host
        does not block)."""
        self._cuda.current_stream().wait_event(self.layer_events[layer])

    def wait_all_layers(self) -> None:
        """Orders the current stream's next work after every layer's load."""
        self._cuda.current_stream().wait_event(self.event)


class CudaCopier:
    """The GPU side of a :class:`hostkv.copy_engine.CopyEngine` (built by it).

    It is handed the views it copies between and keeps the engine's per-layer views and
    the pool's addresses, never the engine nor a view of the pool: the engine holds it,
    and a reference back would make a cycle that keeps the pool mapped past the engine
    (``HostKVCache.close()`` raises while a view of the pool lives).

    Args:
        pool: This rank's view of the pool, ``[pages, layers, kv, tokens, heads, dim]``
            (read for its addresses and strides, not kept).
        pool_bytes: The whole pool as flat bytes: what is registered with CUDA (not kept).
        engine_views: Each layer's engine blocks, ``[blocks, kv, tokens, heads, dim]``.
        cuda: The CUDA primitives; None: :class:`CudaDevice` on the views' device.
        register: Register the pool with CUDA in the background.
        staging_bytes: Each direction's staging buffer (rounded up to one page of this
            rank); None: :data:`DEFAULT_STAGING_BYTES`.
        register_chunk_bytes: About how much one registration call pins.

    Attributes:
        copy_calls: DMA calls enqueued so far.
        pieces: Staging fills so far (a transfer that fits is one).
        staging_bytes: Device bytes this copier holds for staging, both directions.
    """

    def __init__(self, pool: torch.Tensor, pool_bytes: torch.Tensor,
                 engine_views: Sequence[torch.Tensor], cuda: Optional[CudaDevice] = None,
                 register: bool = True, staging_bytes: Optional[int] = None,
                 register_chunk_bytes: int = REGISTER_CHUNK_BYTES) -> None:
        self.engine_views = list(engine_views)
        self.device = self.engine_views[0].device
        self.cuda = cuda if cuda is not None else CudaDevice(self.device)
        item = pool.element_size()
        self.dtype = pool.dtype
        self.layers = int(pool.shape[1])
        # One page-layer of this rank: its shape, and its bytes in staging (contiguous).
        self.layer_shape = tuple(int(n) for n in pool.shape[2:])
        self.layer_bytes = int(np.prod(self.layer_shape)) * item
        self.page_stride = pool.stride(0) * item
        self.layer_stride = pool.stride(1) * item
        self.pool_address = pool.data_ptr()        # page 0, layer 0, this rank's first head
        self._pool_strides = [s * item for s in pool.stride()[2:]]
        self._item = item
        self._plans: dict = {}
        page_bytes_all_heads = int(pool_bytes.numel()) // int(pool.shape[0])
        capacity = DEFAULT_STAGING_BYTES if staging_bytes is None else int(staging_bytes)
        # At least one page (every layer); no more than every block of the engine fills.
        page = self.layers * self.layer_bytes
        capacity = max(min(capacity, int(self.engine_views[0].shape[0]) * page), page)
        self.staging_capacity = capacity
        self.copy_calls = 0
        self.pieces = 0
        # What failed transfers enqueued and must outlive: (event, tensors), pruned once
        # their event has completed.
        self._orphans: List[Tuple[Any, List[Any]]] = []
        low, high = self.cuda.priorities()
        # Saves yield to everything (the forward must not wait on them); loads come before
        # everything (the forward waits on them).
        self.save_stream = self.cuda.new_stream(low)
        self.load_stream = self.cuda.new_stream(high)
        # Allocated once, now (when vLLM registers its KV caches), never per step.
        self.save_staging = self.cuda.empty(capacity)
        self.load_staging = self.cuda.empty(capacity)
        self.staging_bytes = 2 * capacity
        self.registration: Optional[HostRegistration] = None
        # Where registration chunks start, whoever registers the pool: copiers of one pool
        # (one per run of a hybrid model's layers) split their copies at the same edges,
        # so that no copy spans a registered and a pageable range.
        self.chunk_pages = max(1, register_chunk_bytes // page_bytes_all_heads)
        if register:
            self.registration = HostRegistration(self.cuda, pool_bytes.data_ptr(),
                                                 int(pool_bytes.numel()),
                                                 page_bytes_all_heads, register_chunk_bytes)

    # -- addresses ------------------------------------------------------------------------

    def page_plan(self, layers: int) -> CopyPlan:
        """A staged page of ``layers`` consecutive layers against the pool's page: the
        pool's strides on one side, contiguous staging on the other."""
        plan = self._plans.get(layers)
        if plan is None:
            shape = (layers,) + self.layer_shape
            pool = [self.layer_stride] + self._pool_strides
            staging = [int(np.prod(shape[i + 1:])) * self._item for i in range(len(shape))]
            plan = self._plans[layers] = CopyPlan.build(shape, pool, staging, self._item)
        return plan

    def _pages_per_chunk(self) -> int:
        return self.chunk_pages

    def piece_copies(self, pages: np.ndarray, first_layer: int, stop_layer: int,
                     staging: int) -> _Copies:
        """The DMA copies of one piece: ``pages`` (layers ``[first_layer, stop_layer)``)
        against a staging buffer at ``staging`` holding them page after page."""
        layers = stop_layer - first_layer
        return copies_for_pages(self.page_plan(layers), pages,
                                self.pool_address + first_layer * self.layer_stride,
                                self.page_stride, staging, layers * self.layer_bytes,
                                self._pages_per_chunk())

    def _staged(self, buffer: torch.Tensor, pages: int, layers: int) -> torch.Tensor:
        """The first ``pages`` x ``layers`` page-layers of a staging buffer, as
        ``[pages, layers, kv, tokens, heads, dim]``."""
        used = pages * layers * self.layer_bytes
        return buffer[:used].view(self.dtype).view((pages, layers) + self.layer_shape)

    # -- submissions ----------------------------------------------------------------------

    def _prune(self) -> None:
        self._orphans = [(event, keep) for event, keep in self._orphans if not event.query()]

    def _after_compute(self, stream: Any) -> None:
        """Orders ``stream``'s next work after what the compute stream holds now, by an
        event (the host does not wait)."""
        ready = self.cuda.new_event()
        ready.record(self.cuda.current_stream())
        stream.wait_event(ready)

    def save(self, block_index: np.ndarray, page_index: np.ndarray, nbytes: int) -> Transfer:
        """Enqueues blocks -> pages on the save stream, after the compute stream's work;
        answers at once."""
        started = time.perf_counter()
        self._prune()
        stream = self.save_stream
        self._after_compute(stream)
        keep: List[Any] = []
        copies = 0
        try:
            with self.cuda.use(stream):
                pinned, blocks = self.cuda.upload(block_index)
                keep += [pinned, blocks]
                for first, stop, l0, l1 in plan_pieces(page_index.size, self.layers,
                                                       self.layer_bytes, self.staging_capacity):
                    staged = self._staged(self.save_staging, stop - first, l1 - l0)
                    piece_blocks = blocks[first:stop]
                    for j, layer in enumerate(range(l0, l1)):
                        torch.index_select(self.engine_views[layer], 0, piece_blocks,
                                           out=staged[:, j])
                    batch = self.piece_copies(page_index[first:stop], l0, l1,
                                              self.save_staging.data_ptr())
                    copies += self.cuda.enqueue(True, batch, stream)
                    self.pieces += 1
                event = self.cuda.new_event()
                event.record(stream)
        except BaseException:
            # The caller releases the pages of a failed save at once, and another process
            # may take and write one: no piece enqueued before the failure may land later.
            self._orphan(stream, keep, host_waits=True)
            raise
        finally:
            self.copy_calls += copies
        transfer = _CudaTransfer(nbytes, event, started, copies)
        transfer.keep = keep
        return transfer

    def enqueue_load_layer(self, layer: int, staged: torch.Tensor,
                           blocks: torch.Tensor) -> None:
        """Scatters one layer's staged pages into its blocks (on the current stream: the
        load stream)."""
        self.engine_views[layer].index_copy_(0, blocks, staged)

    def load(self, page_index: np.ndarray, block_index: np.ndarray, nbytes: int) -> LoadTransfer:
        """Enqueues pages -> blocks on the load stream, an event after each layer's last
        piece; answers at once.

        Raises:
            Whatever enqueueing raised, once the compute stream was made to wait for what
            had been enqueued (no late copy may land in blocks the forward recomputes).
        """
        started = time.perf_counter()
        self._prune()
        stream = self.load_stream
        # Ordered after the compute stream's work on these blocks (e.g. their zeroing).
        self._after_compute(stream)
        events: List[Any] = [None] * self.layers
        keep: List[Any] = []
        copies = 0
        try:
            with self.cuda.use(stream):
                pinned, blocks = self.cuda.upload(block_index)
                keep += [pinned, blocks]
                n = page_index.size
                for first, stop, l0, l1 in plan_pieces(n, self.layers, self.layer_bytes,
                                                       self.staging_capacity):
                    batch = self.piece_copies(page_index[first:stop], l0, l1,
                                              self.load_staging.data_ptr())
                    copies += self.cuda.enqueue(False, batch, stream)
                    self.pieces += 1
                    staged = self._staged(self.load_staging, stop - first, l1 - l0)
                    for j, layer in enumerate(range(l0, l1)):
                        self.enqueue_load_layer(layer, staged[:, j], blocks[first:stop])
                    if stop == n:
                        # These layers are whole now.
                        event = self.cuda.new_event()
                        event.record(stream)
                        events[l0:l1] = [event] * (l1 - l0)
        except BaseException:
            self._orphan(stream, keep, compute_waits=True)
            raise
        finally:
            self.copy_calls += copies
        transfer = LoadTransfer(nbytes, events, started, self.cuda, copies)
        transfer.keep = keep
        return transfer

    def _orphan(self, stream: Any, keep: List[Any], compute_waits: bool = False,
                host_waits: bool = False) -> None:
        """After a failed submission: what was enqueued keeps its tensors until the stream
        passes it; with ``compute_waits`` (a load) the compute stream waits for it, with
        ``host_waits`` (a save) this thread does, before the error goes up."""
        event = self.cuda.new_event()
        event.record(stream)
        if compute_waits:
            self.cuda.current_stream().wait_event(event)
        if host_waits:
            event.synchronize()
            return
        self._orphans.append((event, keep))

    def close(self) -> None:
        """Waits for the streams, unregisters the pool and frees the staging."""
        self.save_stream.synchronize()
        self.load_stream.synchronize()
        self._orphans = []
        if self.registration is not None:
            self.registration.close()
            self.registration = None
        self.save_staging = self.load_staging = None  # type: ignore[assignment]
