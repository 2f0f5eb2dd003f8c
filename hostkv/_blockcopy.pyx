# cython: language_level=3, embedsignature=True
"""The copy engine's inner loop: strided copies of whole blocks between two CPU buffers.

``hostkv.copy_engine`` describes both sides of a copy (an engine's KV blocks and the pool's
canonical pages) as a block stride plus the same small grid of equal, contiguous runs, and
hands that plan here. One call moves every (source block, destination block) pair of a
layer, with the GIL released: no Python per block, no intermediate buffer.

Nothing here knows about torch: the buffers are raw addresses that the caller took from
tensors it keeps alive for the call, and every index is checked against its buffer's block
count before the first byte moves.
"""

from libc.stdint cimport int64_t, uintptr_t
from libc.string cimport memcpy

cdef enum:
    MAX_DIMS = 8


cdef void copy_region(char* dst, const char* src, int ndim, const int64_t* shape,
                      const int64_t* dst_strides, const int64_t* src_strides,
                      size_t run) noexcept nogil:
    """Copies one block: a grid `shape` of contiguous runs of `run` bytes."""
    cdef int64_t counter[MAX_DIMS]
    cdef int64_t doff = 0
    cdef int64_t soff = 0
    cdef int k
    if ndim == 0:
        memcpy(dst, src, run)
        return
    for k in range(ndim):
        counter[k] = 0
    while True:
        memcpy(dst + doff, src + soff, run)
        k = ndim - 1
        while k >= 0:
            counter[k] += 1
            doff += dst_strides[k]
            soff += src_strides[k]
            if counter[k] < shape[k]:
                break
            doff -= dst_strides[k] * shape[k]
            soff -= src_strides[k] * shape[k]
            counter[k] = 0
            k -= 1
        if k < 0:
            return


def copy_blocks(uintptr_t dst, int64_t dst_blocks, int64_t dst_block_stride,
                const int64_t[::1] dst_index,
                uintptr_t src, int64_t src_blocks, int64_t src_block_stride,
                const int64_t[::1] src_index,
                shape, dst_strides, src_strides, size_t run):
    """Copies block ``src_index[i]`` of ``src`` onto block ``dst_index[i]`` of ``dst``.

    A block is the grid ``shape`` of contiguous runs of ``run`` bytes; ``dst_strides`` and
    ``src_strides`` are each grid axis's stride in bytes on either side, and block ``b``
    starts ``b * block_stride`` bytes after its buffer's address.

    Args:
        dst, src: Addresses of block 0 of each side.
        dst_blocks, src_blocks: How many blocks each side holds (indices are checked).
        dst_block_stride, src_block_stride: Bytes from one block to the next.
        dst_index, src_index: int64 block indices, pairwise, of equal length.
        shape, dst_strides, src_strides: The grid of runs (at most 8 axes).
        run: Bytes of each contiguous run, > 0.

    Raises:
        ValueError: indices of unequal length, an index outside its side's blocks, or a
            bad grid; nothing was copied.
    """
    cdef Py_ssize_t n = dst_index.shape[0]
    cdef Py_ssize_t i
    cdef int ndim = len(shape)
    cdef int k
    cdef int64_t c_shape[MAX_DIMS]
    cdef int64_t c_dst[MAX_DIMS]
    cdef int64_t c_src[MAX_DIMS]
    if src_index.shape[0] != n:
        raise ValueError(f"copy_blocks: {n} destination blocks but {src_index.shape[0]} "
                         "source blocks")
    if ndim > MAX_DIMS or len(dst_strides) != ndim or len(src_strides) != ndim:
        raise ValueError(f"copy_blocks: a grid of {ndim} axes with {len(dst_strides)} and "
                         f"{len(src_strides)} strides (at most {MAX_DIMS} axes)")
    if run == 0:
        raise ValueError("copy_blocks: runs of 0 bytes")
    for k in range(ndim):
        c_shape[k] = shape[k]
        c_dst[k] = dst_strides[k]
        c_src[k] = src_strides[k]
        if c_shape[k] <= 0:
            raise ValueError(f"copy_blocks: grid axis {k} has size {c_shape[k]}")
    for i in range(n):
        if not 0 <= dst_index[i] < dst_blocks:
            raise ValueError(f"copy_blocks: destination block {dst_index[i]} outside "
                             f"[0, {dst_blocks})")
        if not 0 <= src_index[i] < src_blocks:
            raise ValueError(f"copy_blocks: source block {src_index[i]} outside "
                             f"[0, {src_blocks})")
    with nogil:
        for i in range(n):
            copy_region(<char*>dst + dst_index[i] * dst_block_stride,
                        <const char*>src + src_index[i] * src_block_stride,
                        ndim, c_shape, c_dst, c_src, run)
