# cython: language_level=3, embedsignature=True
"""Batched asynchronous copies through a function pointer: the copy engine's GPU path.

A save or load between a GPU's KV blocks and the pool is many contiguous runs (a page's
slice of one layer each, or finer with a tensor-parallel rank's heads). ``memcpy_batch``
enqueues all of a step's runs with one call from Python: the runs' addresses come in
arrays, and the loop calls the CUDA driver's ``cuMemcpyAsync`` (whose address
``hostkv.cuda_copy`` looks up at run time) with the GIL released. Nothing here needs
CUDA's headers or libraries to build; ``host_memcpy_function`` stands in for the driver on
a CPU, so the address arithmetic of the GPU path runs in every test run.
"""

from libc.stdint cimport uint64_t, uintptr_t
from libc.string cimport memcpy

# cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream stream) -> CUresult
ctypedef int (*memcpy_async_fn)(uint64_t dst, uint64_t src, size_t nbytes,
                                void* stream) noexcept nogil


cdef int _host_memcpy(uint64_t dst, uint64_t src, size_t nbytes, void* stream) noexcept nogil:
    memcpy(<void*><uintptr_t>dst, <const void*><uintptr_t>src, nbytes)
    return 0


def host_memcpy_function():
    """The address of a host ``memcpy`` with ``cuMemcpyAsync``'s signature (stream ignored)."""
    return <uintptr_t>&_host_memcpy


def memcpy_batch(uintptr_t function, const uint64_t[::1] dst, const uint64_t[::1] src,
                 const uint64_t[::1] nbytes, uintptr_t stream):
    """Calls ``function(dst[i], src[i], nbytes[i], stream)`` for every i, in order.

    Args:
        function: The address of ``cuMemcpyAsync`` (or of ``host_memcpy_function()``).
        dst, src, nbytes: uint64 arrays of equal length: each run's addresses and size.
        stream: The CUDA stream handle the copies are enqueued on.

    Raises:
        ValueError: arrays of unequal length, or a null function.
        RuntimeError: a call returned an error (the runs before it were enqueued).
    """
    cdef Py_ssize_t n = dst.shape[0]
    cdef Py_ssize_t i = 0
    cdef int rc = 0
    cdef memcpy_async_fn call
    if src.shape[0] != n or nbytes.shape[0] != n:
        raise ValueError(f"memcpy_batch: {n} destinations, {src.shape[0]} sources, "
                         f"{nbytes.shape[0]} sizes")
    if function == 0:
        raise ValueError("memcpy_batch: no copy function")
    call = <memcpy_async_fn>function
    with nogil:
        while i < n:
            rc = call(dst[i], src[i], nbytes[i], <void*>stream)
            if rc != 0:
                break
            i += 1
    if rc != 0:
        raise RuntimeError(f"hostkv: asynchronous copy {i} of {n} failed with CUDA error {rc}")
