# cython: language_level=3, embedsignature=True
"""Batched asynchronous 2-D copies through a function pointer: the copy engine's GPU path.

A save or load between a GPU's staging buffer and the pool is, per page, a set of rows of
equal width at a fixed pitch on either side: the whole page in one row where a rank holds
every head, one row per (layer, K/V, token) of the rank's heads under tensor parallelism.
``memcpy2d_batch`` enqueues a step's copies with one call from Python: each copy's addresses,
pitches, width and height come in arrays, and the loop fills a ``CUDA_MEMCPY2D`` and calls
the CUDA driver's ``cuMemcpy2DAsync_v2`` (whose address ``hostkv.cuda_copy`` looks up at run
time) with the GIL released. One call per page, not per row, is what keeps the driver's time
per step small (a row is 1 KiB at TP=2 of an 8-head model; the driver costs microseconds a
call whatever its size).

Nothing here needs CUDA's headers or libraries to build: the struct is declared below as the
driver API's ``cuda.h`` lays it out (CUDA 3.2 and later), and ``host_memcpy2d_function``
stands in for the driver on a CPU, reading the same struct, so the GPU path's address
arithmetic runs in every test run.
"""

from libc.stdint cimport uint64_t, uintptr_t
from libc.string cimport memcpy


# cuda.h's CUmemorytype: where an address of a copy points.
cdef enum:
    CU_MEMORYTYPE_HOST = 1
    CU_MEMORYTYPE_DEVICE = 2


# cuda.h's CUDA_MEMCPY2D (the _v2 layout, the only one since CUDA 3.2).
ctypedef struct CudaMemcpy2D:
    size_t srcXInBytes
    size_t srcY
    int srcMemoryType
    const void* srcHost
    uint64_t srcDevice
    void* srcArray
    size_t srcPitch
    size_t dstXInBytes
    size_t dstY
    int dstMemoryType
    void* dstHost
    uint64_t dstDevice
    void* dstArray
    size_t dstPitch
    size_t WidthInBytes
    size_t Height

# cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D* copy, CUstream stream) -> CUresult
ctypedef int (*memcpy2d_async_fn)(const CudaMemcpy2D* copy, void* stream) noexcept nogil


cdef int _host_memcpy2d(const CudaMemcpy2D* c, void* stream) noexcept nogil:
    # The driver's semantics on host memory: row r of width bytes from src + r * srcPitch
    # to dst + r * dstPitch; the memory type picks the host or the device field.
    cdef const char* src = <const char*>(c.srcHost if c.srcMemoryType == CU_MEMORYTYPE_HOST
                                         else <const void*><uintptr_t>c.srcDevice)
    cdef char* dst = <char*>(c.dstHost if c.dstMemoryType == CU_MEMORYTYPE_HOST
                             else <void*><uintptr_t>c.dstDevice)
    cdef size_t row
    if c.WidthInBytes > c.srcPitch or c.WidthInBytes > c.dstPitch:
        return 1                         # CUDA_ERROR_INVALID_VALUE, as the driver answers
    for row in range(c.Height):
        memcpy(dst + row * c.dstPitch, src + row * c.srcPitch, c.WidthInBytes)
    return 0


def host_memcpy2d_function():
    """The address of a host copy with ``cuMemcpy2DAsync_v2``'s signature (stream
    ignored), which reads the same ``CUDA_MEMCPY2D`` the driver would."""
    return <uintptr_t>&_host_memcpy2d


def memcpy2d_batch(uintptr_t function, bint to_host, const uint64_t[::1] host,
                   const uint64_t[::1] device, const uint64_t[::1] host_pitch,
                   const uint64_t[::1] device_pitch, const uint64_t[::1] width,
                   const uint64_t[::1] height, uintptr_t stream):
    """Enqueues copy ``i`` for every i, in order: ``height[i]`` rows of ``width[i]`` bytes
    between host memory at ``host[i]`` (rows ``host_pitch[i]`` apart) and device memory
    at ``device[i]`` (rows ``device_pitch[i]`` apart).

    Args:
        function: The address of ``cuMemcpy2DAsync_v2`` (or of
            ``host_memcpy2d_function()``).
        to_host: True: device -> host (a save); False: host -> device (a load).
        host, device, host_pitch, device_pitch, width, height: uint64 arrays of equal
            length, one entry per copy.
        stream: The CUDA stream handle the copies are enqueued on.

    Returns:
        The number of copies enqueued (every one of them).

    Raises:
        ValueError: arrays of unequal length, or a null function.
        RuntimeError: a call returned an error (the copies before it were enqueued).
    """
    cdef Py_ssize_t n = host.shape[0]
    cdef Py_ssize_t i = 0
    cdef int rc = 0
    cdef memcpy2d_async_fn call
    cdef CudaMemcpy2D c
    if (device.shape[0] != n or host_pitch.shape[0] != n or device_pitch.shape[0] != n
            or width.shape[0] != n or height.shape[0] != n):
        raise ValueError(f"memcpy2d_batch: {n} host addresses, {device.shape[0]} device "
                         f"addresses, {host_pitch.shape[0]}/{device_pitch.shape[0]} pitches, "
                         f"{width.shape[0]} widths, {height.shape[0]} heights")
    if function == 0:
        raise ValueError("memcpy2d_batch: no copy function")
    call = <memcpy2d_async_fn>function
    with nogil:
        while i < n:
            c.srcXInBytes = 0
            c.srcY = 0
            c.srcArray = NULL
            c.dstXInBytes = 0
            c.dstY = 0
            c.dstArray = NULL
            c.WidthInBytes = width[i]
            c.Height = height[i]
            if to_host:
                c.srcMemoryType = CU_MEMORYTYPE_DEVICE
                c.srcHost = NULL
                c.srcDevice = device[i]
                c.srcPitch = device_pitch[i]
                c.dstMemoryType = CU_MEMORYTYPE_HOST
                c.dstHost = <void*><uintptr_t>host[i]
                c.dstDevice = 0
                c.dstPitch = host_pitch[i]
            else:
                c.srcMemoryType = CU_MEMORYTYPE_HOST
                c.srcHost = <const void*><uintptr_t>host[i]
                c.srcDevice = 0
                c.srcPitch = host_pitch[i]
                c.dstMemoryType = CU_MEMORYTYPE_DEVICE
                c.dstHost = NULL
                c.dstDevice = device[i]
                c.dstPitch = device_pitch[i]
            rc = call(&c, <void*>stream)
            if rc != 0:
                break
            i += 1
    if rc != 0:
        raise RuntimeError(f"hostkv: asynchronous 2-D copy {i} of {n} failed with CUDA "
                           f"error {rc}")
    return n
