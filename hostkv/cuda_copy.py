"""The copy engine's GPU path: the pool registered for DMA, copies on side streams.

A save gathers each layer's blocks on the device into a contiguous staging tensor (one
``index_select`` per layer), then the DMA engine moves every contiguous run of it into
the pool's pages: one ``cuMemcpyAsync`` per run, all of a step's runs enqueued by one
compiled call (``hostkv._cudacopy.memcpy_batch``). It runs on a low-priority save stream
that first waits for the compute stream (the forward wrote the KV), and a CUDA event after
the copies says when it is over: nothing on the host waits for it.

A load runs the other way on a load stream, layer by layer, with an event per layer, so
a forward that can wait per layer waits for a layer's KV only when it reaches that layer
(``wait_layer``); ``wait_all_layers`` orders it after every layer's (what ``hostkv.vllm``
does: a full CUDA graph's replay runs no per-layer hook). Either is a stream waiting on an
event; the host never blocks.

The pool is registered with ``cudaHostRegister`` (page-locked, so the DMA engine reads and
writes it directly) in chunks of at most 64 GiB, from a background thread; until then,
and if registration fails (logged once, counted), the same copies run through the
driver's pageable path, slower but correct.

Needs torch with CUDA; ``hostkv.copy_engine`` imports it only for CUDA tensors, and this
module never imports it back (what both need, :class:`hostkv._copyplan.CopyPlan`, lives in a
module of its own).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from hostkv._copyplan import CopyPlan
from hostkv._cudacopy import memcpy_batch
from hostkv.transfers import Transfer

__all__ = ["CudaCopier", "HostRegistration", "run_offsets"]

logger = logging.getLogger("hostkv.cuda")

# cudaHostRegister pins at most this much per call (large calls fail on some drivers).
MAX_REGISTER_CHUNK = 64 << 30
# cudaHostRegisterPortable: pinned for every CUDA context of the process, not only the
# registering thread's.
_REGISTER_PORTABLE = 1


def run_offsets(shape: Sequence[int], strides: Sequence[int]) -> np.ndarray:
    """Byte offsets of every run of a CopyPlan's grid, row-major (one 0 for no grid)."""
    offsets = np.zeros(1, dtype=np.int64)
    for size, stride in zip(shape, strides):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).ravel()
    return offsets


def _driver_memcpy_async() -> int:
    """The address of the CUDA driver's ``cuMemcpyAsync`` (unified addressing infers the
    direction from the two pointers)."""
    driver = ctypes.CDLL("libcuda.so.1")
    address = ctypes.cast(driver.cuMemcpyAsync, ctypes.c_void_p).value
    if not address:
        raise RuntimeError("hostkv: libcuda.so.1 has no cuMemcpyAsync")
    return int(address)


class HostRegistration:
    """Registers a host buffer with CUDA (``cudaHostRegister``) in chunks, off the serving
    path, and unregisters what it registered.

    Attributes:
        registered_bytes: Bytes registered so far.
        failed: The first failure's message, if any (the rest of the buffer stays pageable).
    """

    def __init__(self, address: int, nbytes: int, device: "torch.device") -> None:
        self.device = device
        self.address = address
        self.nbytes = nbytes
        self.registered_bytes = 0
        self.failed: Optional[str] = None
        self._chunks: List[int] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="hostkv-cuda-register",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # A new thread's runtime would otherwise use device 0 (and make a context there).
        torch.cuda.set_device(self.device)
        cudart = torch.cuda.cudart()
        offset = 0
        while offset < self.nbytes and not self._stop:
            size = min(MAX_REGISTER_CHUNK, self.nbytes - offset)
            err = cudart.cudaHostRegister(self.address + offset, size, _REGISTER_PORTABLE)
            code = getattr(err, "value", err)
            if code != 0:
                self.failed = f"cudaHostRegister of {size} bytes failed: {err}"
                logger.warning("hostkv: %s; copies to the rest of the pool stay pageable "
                               "(slower)", self.failed)
                return
            self._chunks.append(self.address + offset)
            offset += size
            self.registered_bytes = offset

    def close(self) -> None:
        """Stops registering and unregisters every chunk (before the pool is unmapped)."""
        self._stop = True
        self._thread.join()
        cudart = torch.cuda.cudart()
        for address in self._chunks:
            cudart.cudaHostUnregister(address)
        self._chunks = []
        self.registered_bytes = 0


class _CudaTransfer(Transfer):
    """A transfer over once a CUDA event recorded after its copies has completed."""

    def __init__(self, nbytes: int, event: "torch.cuda.Event", started: float) -> None:
        super().__init__(nbytes)
        self.event = event
        self.started = started

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

    def __init__(self, nbytes: int, layer_events: List["torch.cuda.Event"],
                 started: float) -> None:
        super().__init__(nbytes, layer_events[-1], started)
        self.layer_events = layer_events

    def wait_layer(self, layer: int) -> None:
        """Orders the current stream's next work after layer ``layer``'s load (the host
        does not block)."""
        torch.cuda.current_stream().wait_event(self.layer_events[layer])

    def wait_all_layers(self) -> None:
        """Orders the current stream's next work after every layer's load."""
        torch.cuda.current_stream().wait_event(self.layer_events[-1])


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
        memcpy: The copy function's address; None: the driver's ``cuMemcpyAsync``.
        register: Register the pool with CUDA in the background.
    """

    def __init__(self, pool: torch.Tensor, pool_bytes: torch.Tensor,
                 engine_views: Sequence[torch.Tensor], memcpy: Optional[int] = None,
                 register: bool = True) -> None:
        self.engine_views = list(engine_views)
        item = pool.element_size()
        # One page-layer of this rank, as the pool lays it out and as contiguous staging.
        shape = tuple(int(n) for n in pool.shape[2:])
        pool_strides = [s * item for s in pool.stride()[2:]]
        staging_strides = [int(np.prod(shape[i + 1:])) * item for i in range(len(shape))]
        plan = CopyPlan.build(shape, pool_strides, staging_strides, item)
        self.run_bytes = plan.run
        self.pool_runs = run_offsets(plan.shape, plan.pool_strides)
        self.staging_runs = run_offsets(plan.shape, plan.engine_strides)
        self.block_bytes = int(np.prod(shape)) * item
        self.page_stride = pool.stride(0) * item
        self.layer_stride = pool.stride(1) * item
        self.pool_address = pool.data_ptr()
        self.memcpy = memcpy if memcpy is not None else _driver_memcpy_async()
        self.device = self.engine_views[0].device
        self.registration: Optional[HostRegistration] = None
        if self.device.type == "cuda":
            # The least priority CUDA offers (0 on current devices, the default streams'):
            # a static method in torch, which its stub declares as an instance method.
            low = torch.cuda.Stream.priority_range()[0] if hasattr(  # type: ignore[call-arg]
                torch.cuda.Stream, "priority_range") else 0
            self.save_stream = torch.cuda.Stream(device=self.device, priority=low)
            self.load_stream = torch.cuda.Stream(device=self.device, priority=low)
            if register:
                self.registration = HostRegistration(pool_bytes.data_ptr(), pool_bytes.numel(),
                                                     self.device)

    def runs(self, layer: int, pages: np.ndarray, staging: int) -> Tuple[np.ndarray, np.ndarray]:
        """The pool and staging addresses of every run of one layer's pages (page ``i``
        of ``pages`` being block ``i`` of the staging tensor at address ``staging``)."""
        pool = (self.pool_address + layer * self.layer_stride
                + pages.astype(np.int64)[:, None] * self.page_stride + self.pool_runs[None, :])
        stage = (staging + np.arange(pages.size, dtype=np.int64)[:, None] * self.block_bytes
                 + self.staging_runs[None, :])
        return pool.ravel().astype(np.uint64), stage.ravel().astype(np.uint64)

    def _batch(self, dst: List[np.ndarray], src: List[np.ndarray], stream: int) -> None:
        d = np.concatenate(dst)
        s = np.concatenate(src)
        memcpy_batch(self.memcpy, d, s, np.full(d.size, self.run_bytes, dtype=np.uint64),
                     stream)

    def enqueue_save(self, block_index: np.ndarray, page_index: np.ndarray,
                     stream: int) -> List[torch.Tensor]:
        """Gathers each layer's blocks (on the current stream) and enqueues their runs'
        copies into the pages on ``stream``; answers what must live until they are over."""
        blocks = torch.from_numpy(block_index).to(self.device)
        keep = [blocks]
        dst: List[np.ndarray] = []
        src: List[np.ndarray] = []
        for layer, view in enumerate(self.engine_views):
            staging = view.index_select(0, blocks).contiguous()
            keep.append(staging)
            pool, stage = self.runs(layer, page_index, staging.data_ptr())
            dst.append(pool)
            src.append(stage)
        self._batch(dst, src, stream)
        return keep

    def enqueue_load_layer(self, layer: int, page_index: np.ndarray, blocks: torch.Tensor,
                           stream: int) -> torch.Tensor:
        """Enqueues one layer's pages into a staging tensor on ``stream`` and scatters it
        into the layer's blocks (on the current stream); answers the staging tensor."""
        view = self.engine_views[layer]
        staging = torch.empty((page_index.size,) + tuple(view.shape[1:]), dtype=view.dtype,
                              device=self.device)
        pool, stage = self.runs(layer, page_index, staging.data_ptr())
        self._batch([stage], [pool], stream)
        view.index_copy_(0, blocks, staging)
        return staging

    def save(self, block_index: np.ndarray, page_index: np.ndarray, nbytes: int) -> Transfer:
        """Enqueues blocks -> pages on the save stream, after the compute stream's work."""
        started = time.perf_counter()
        stream = self.save_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            keep = self.enqueue_save(block_index, page_index, stream.cuda_stream)
            event = torch.cuda.Event()
            event.record(stream)
        transfer = _CudaTransfer(nbytes, event, started)
        transfer.keep = keep
        return transfer

    def load(self, page_index: np.ndarray, block_index: np.ndarray, nbytes: int) -> LoadTransfer:
        """Enqueues pages -> blocks on the load stream, layer by layer, an event each."""
        started = time.perf_counter()
        stream = self.load_stream
        # Ordered after the compute stream's work on these blocks (e.g. their zeroing).
        stream.wait_stream(torch.cuda.current_stream(self.device))
        events: List[torch.cuda.Event] = []
        with torch.cuda.stream(stream):
            blocks = torch.from_numpy(block_index).to(self.device)
            keep: List[torch.Tensor] = [blocks]
            for layer in range(len(self.engine_views)):
                keep.append(self.enqueue_load_layer(layer, page_index, blocks,
                                                    stream.cuda_stream))
                event = torch.cuda.Event()
                event.record(stream)
                events.append(event)
        transfer = LoadTransfer(nbytes, events, started)
        transfer.keep = keep
        return transfer

    def close(self) -> None:
        """Waits for the streams and unregisters the pool."""
        if self.device.type == "cuda":
            self.save_stream.synchronize()
            self.load_stream.synchronize()
        if self.registration is not None:
            self.registration.close()
            self.registration = None
