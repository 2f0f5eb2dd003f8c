"""A recording stand-in for :class:`hostkv.cuda_copy.CudaDevice`, over CPU tensors.

The copier under test is the real one: its address arithmetic, staging, pieces and the order
in which it records events, waits on them and enqueues copies. Only the CUDA primitives are
replaced: streams and events are records in one log, uploads are CPU copies, staging is CPU
memory, and the DMA batches run through the real compiled loop with a host copy function
that reads the same ``CUDA_MEMCPY2D`` the driver would. Events complete only when the test
says (``complete()``), so a test sees what the copier does while its copies are in flight.

Anything that would make the host wait (a stream's or event's ``synchronize``) is logged as
``("sync", ...)``: the serving path must log none.
"""

from __future__ import annotations

import contextlib
from typing import Any, List, Optional, Sequence

import numpy as np
import torch

from hostkv._cudacopy import host_memcpy2d_function, memcpy2d_batch


class Stream:
    """A named stream: what waits and records on it goes to the log."""

    def __init__(self, cuda: "RecordingCuda", name: str, priority: int) -> None:
        self.cuda, self.name, self.priority = cuda, name, priority

    def wait_event(self, event: "Event") -> None:
        self.cuda.log.append(("wait", self.name, event.id))

    def wait_stream(self, other: "Stream") -> None:
        self.cuda.log.append(("wait_stream", self.name, other.name))

    def synchronize(self) -> None:
        self.cuda.log.append(("sync", "stream", self.name))


class Event:
    """An event that completes when the test says (or when synchronised)."""

    def __init__(self, cuda: "RecordingCuda", number: int) -> None:
        self.cuda, self.id, self.completed, self.stream = cuda, number, False, None

    def record(self, stream: Stream) -> None:
        self.stream = stream.name
        self.cuda.log.append(("record", stream.name, self.id))

    def query(self) -> bool:
        return self.completed

    def synchronize(self) -> None:
        self.cuda.log.append(("sync", "event", self.id))
        self.completed = True


class RecordingCuda:
    """Implements CudaDevice's methods over CPU tensors, logging each call in order.

    Args:
        register_codes: The error code each ``host_register`` call answers, in turn (0
            once they run out).
        fail_enqueue: The 1-based number of the ``enqueue`` call that raises.
        fail_bind: ``bind_thread`` raises this.
    """

    def __init__(self, register_codes: Sequence[int] = (), fail_enqueue: Optional[int] = None,
                 fail_bind: Optional[BaseException] = None) -> None:
        self.log: List[tuple] = []
        self.events: List[Event] = []
        self.compute = Stream(self, "compute", 0)
        self.current = self.compute
        self.register_codes = list(register_codes)
        self.fail_enqueue = fail_enqueue
        self.fail_bind = fail_bind
        self.enqueues = 0
        self.registered: List[tuple] = []

    # -- what the copier calls ---------------------------------------------------------------

    def priorities(self):
        return 0, -5

    def new_stream(self, priority: int) -> Stream:
        stream = Stream(self, f"side{priority}", priority)
        self.log.append(("stream", stream.name, priority))
        return stream

    def current_stream(self) -> Stream:
        return self.current

    def new_event(self) -> Event:
        event = Event(self, len(self.events))
        self.events.append(event)
        return event

    @contextlib.contextmanager
    def use(self, stream: Stream):
        before, self.current = self.current, stream
        self.log.append(("use", stream.name))
        try:
            yield
        finally:
            self.current = before
            self.log.append(("end", stream.name))

    def stream_handle(self, stream: Stream) -> int:
        return 0

    def upload(self, index: np.ndarray):
        # What CudaDevice.upload promises: pinned memory, copied without blocking, on the
        # current stream.
        self.log.append(("upload", self.current.name, "pinned", "non_blocking"))
        pinned = torch.from_numpy(np.array(index, dtype=np.int64))
        return pinned, pinned.clone()

    def empty(self, nbytes: int) -> torch.Tensor:
        self.log.append(("alloc", nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)

    def enqueue(self, to_host: bool, copies: Any, stream: Stream) -> int:
        self.enqueues += 1
        if self.fail_enqueue is not None and self.enqueues == self.fail_enqueue:
            raise RuntimeError("hostkv: asynchronous 2-D copy 0 of 1 failed with CUDA error 1")
        self.log.append(("dma", stream.name, "to_host" if to_host else "to_device",
                         len(copies), self.current.name))
        return memcpy2d_batch(host_memcpy2d_function(), to_host, copies.host, copies.device,
                              copies.host_pitch, copies.device_pitch, copies.width,
                              copies.height, 0)

    def bind_thread(self) -> None:
        if self.fail_bind is not None:
            raise self.fail_bind

    def host_register(self, address: int, nbytes: int) -> int:
        code = self.register_codes.pop(0) if self.register_codes else 0
        self.registered.append((address, nbytes, code))
        return code

    def host_unregister(self, address: int) -> None:
        self.log.append(("unregister", address))

    # -- what the tests call -----------------------------------------------------------------

    def note(self, what: str) -> None:
        """Marks work of the engine's own on the current stream (e.g. the forward)."""
        self.log.append(("kernel", self.current.name, what))

    def complete(self) -> None:
        """Every event recorded so far completes (the device caught up)."""
        for event in self.events:
            if event.stream is not None:
                event.completed = True

    def syncs(self) -> List[tuple]:
        """Every call that would have made the host wait."""
        return [entry for entry in self.log if entry[0] == "sync"]
