# cython: language_level=3, embedsignature=True
"""The copy engine's inner loop: strided copies of whole blocks between two CPU buffers.

``hostkv.copy_engine`` describes both sides of a copy (an engine's KV blocks and the pool's
canonical pages) as a block stride plus the same small grid of equal, contiguous runs, and
hands that plan here. One call moves every (source block, destination block) pair of every
layer of a step, with the GIL released: no Python per block or per layer, no intermediate
buffer.

Where the time goes, and so how the loop is built (measured on a 2-core AMD EPYC VM, one
step of 64 MiB in runs of 256 bytes, vLLM's CPU layout against the canonical pages):

- The source is read in its own memory order. The hardware prefetchers follow a stream,
  not a grid of 256-byte runs 8 KiB apart; writing in the destination's order instead left
  the loads waiting on memory (0.5-0.6x a plain memcpy of the same bytes).
- Large copies store with non-temporal (streaming) stores. An ordinary store first reads
  the destination's cache line (a third memory transfer per byte), and a step's pages are
  not read again soon. With both changes a save ran at 0.98-1.02x and a load at 1.06-1.10x
  a plain memcpy (python -m hostkv bench, "copy engine"); either alone did not help.
  AVX's 32-byte stores, where the CPU has them, took the layouts of long runs
  (flash-attention's 32 KiB, FlashInfer NHD's whole blocks) from 0.65-0.72x with SSE2's
  16-byte stores to 0.94-1.00x. Below STREAM_MIN_BYTES memcpy per run is used: see there.
- Every layer of a step in one call, layer after layer (block after block, each block's
  layers in turn, saves ran at 0.75x where layer after layer gave 0.92x in the same runs).
- The two innermost grid axes are plain loops, the others an odometer. Inlining
  fixed-size copies of the small runs (16-byte loads and stores the compiler unrolls)
  measured slower than glibc's memcpy for the same runs, and software prefetching ahead of
  the streaming loads gained nothing, so neither is done.

Nothing here knows about torch: the buffers are raw addresses that the caller took from
tensors it keeps alive for the call, and every index is checked against its buffer's block
count before the first byte moves.
"""

from libc.stdint cimport int64_t, uint8_t, uint64_t, uintptr_t
from libc.string cimport memcpy

from hostkv.includes.system cimport _SC_PAGESIZE, sysconf


cdef extern from *:
    """
    #include <string.h>
    #include <stdint.h>
    /* Store paths: HKV_MEMCPY, and where the CPU has them non-temporal stores, which write
       whole cache lines without first reading them: HKV_STREAM16 (SSE2, 16-byte-aligned
       destinations) and HKV_STREAM32 (AVX, 32-byte-aligned; found at run time, as x86-64
       builds assume only SSE2). 32-byte stores measured faster on long runs: random 32 KiB
       runs at 0.93-0.95x a plain memcpy where 16-byte ones gave 0.77-0.81x. */
    enum { HKV_MEMCPY = 0, HKV_STREAM16 = 1, HKV_STREAM32 = 2 };

    /* n runs of run bytes, each dstep and sstep bytes after the one before. */
    static void hkv_copy_runs(char* dst, const char* src, int64_t n, int64_t dstep,
                              int64_t sstep, size_t run) {
        for (int64_t j = 0; j < n; j++, dst += dstep, src += sstep)
            memcpy(dst, src, run);
    }

    #if defined(__SSE2__)
    #include <immintrin.h>
    #define HKV_CAN_STREAM 1
    /* run a multiple of 16, every destination run 16-byte aligned. Four loads before four
       stores: a cache line's worth in flight at once. */
    static void hkv_stream16_runs(char* dst, const char* src, int64_t n, int64_t dstep,
                                  int64_t sstep, size_t run) {
        for (int64_t j = 0; j < n; j++, dst += dstep, src += sstep) {
            size_t i = 0;
            for (; i + 64 <= run; i += 64) {
                __m128i a = _mm_loadu_si128((const __m128i*)(src + i));
                __m128i b = _mm_loadu_si128((const __m128i*)(src + i + 16));
                __m128i c = _mm_loadu_si128((const __m128i*)(src + i + 32));
                __m128i d = _mm_loadu_si128((const __m128i*)(src + i + 48));
                _mm_stream_si128((__m128i*)(dst + i), a);
                _mm_stream_si128((__m128i*)(dst + i + 16), b);
                _mm_stream_si128((__m128i*)(dst + i + 32), c);
                _mm_stream_si128((__m128i*)(dst + i + 48), d);
            }
            for (; i < run; i += 16)
                _mm_stream_si128((__m128i*)(dst + i), _mm_loadu_si128((const __m128i*)(src + i)));
        }
    }
    #if defined(__GNUC__) || defined(__clang__)
    /* run a multiple of 32, every destination run 32-byte aligned; compiled for AVX alone
       and called only where the CPU has it. */
    __attribute__((target("avx")))
    static void hkv_stream32_runs(char* dst, const char* src, int64_t n, int64_t dstep,
                                  int64_t sstep, size_t run) {
        for (int64_t j = 0; j < n; j++, dst += dstep, src += sstep) {
            size_t i = 0;
            for (; i + 128 <= run; i += 128) {
                __m256i a = _mm256_loadu_si256((const __m256i*)(src + i));
                __m256i b = _mm256_loadu_si256((const __m256i*)(src + i + 32));
                __m256i c = _mm256_loadu_si256((const __m256i*)(src + i + 64));
                __m256i d = _mm256_loadu_si256((const __m256i*)(src + i + 96));
                _mm256_stream_si256((__m256i*)(dst + i), a);
                _mm256_stream_si256((__m256i*)(dst + i + 32), b);
                _mm256_stream_si256((__m256i*)(dst + i + 64), c);
                _mm256_stream_si256((__m256i*)(dst + i + 96), d);
            }
            for (; i < run; i += 32)
                _mm256_stream_si256((__m256i*)(dst + i),
                                    _mm256_loadu_si256((const __m256i*)(src + i)));
        }
    }
    static int hkv_cpu_has_avx(void) { __builtin_cpu_init(); return __builtin_cpu_supports("avx"); }
    #else
    #define hkv_stream32_runs hkv_stream16_runs
    static int hkv_cpu_has_avx(void) { return 0; }
    #endif
    /* Non-temporal stores are weakly ordered: the fence makes them visible before any later
       store (the segment's lock release that publishes a saved page, a flag another thread
       reads). */
    static inline void hkv_stream_fence(void) { _mm_sfence(); }
    #else
    #define HKV_CAN_STREAM 0
    #define hkv_stream16_runs hkv_copy_runs
    #define hkv_stream32_runs hkv_copy_runs
    static int hkv_cpu_has_avx(void) { return 0; }
    static inline void hkv_stream_fence(void) { }
    #endif

    static inline void hkv_runs(int store, char* dst, const char* src, int64_t n,
                                int64_t dstep, int64_t sstep, size_t run) {
        if (store == HKV_STREAM32) hkv_stream32_runs(dst, src, n, dstep, sstep, run);
        else if (store == HKV_STREAM16) hkv_stream16_runs(dst, src, n, dstep, sstep, run);
        else hkv_copy_runs(dst, src, n, dstep, sstep, run);
    }

    /* A read the compiler must make (its value is unused): it maps the page in. */
    static inline void hkv_touch(const char* p) { (void)*(const volatile char*)p; }
    """
    bint HKV_CAN_STREAM
    enum:
        HKV_MEMCPY
        HKV_STREAM16
        HKV_STREAM32
    int hkv_cpu_has_avx() noexcept nogil
    void hkv_runs(int store, char* dst, const char* src, int64_t n, int64_t dstep,
                  int64_t sstep, size_t run) noexcept nogil
    void hkv_stream_fence() noexcept nogil
    void hkv_touch(const char* p) noexcept nogil


cdef enum:
    MAX_DIMS = 8

# Copies of at least this many bytes (a call's whole step) use non-temporal stores where
# the CPU has them and the destination is 16-byte aligned. Measured against a plain memcpy
# of the same bytes: from 1 to 4 MiB with both sides in the caches, memcpy per run ran at
# 1.02-1.10x and streaming stores at 0.76-0.85x; with neither side cached, memcpy at
# 0.76-0.81x and streaming stores at 1.17-1.33x; from 8 MiB streaming won either way. A
# small step may well be cached, and a load's blocks are read again at once.
STREAM_MIN_BYTES = 4 << 20
# Whether this build has non-temporal stores (x86-64: SSE2); elsewhere every copy is memcpy.
CAN_STREAM = bool(HKV_CAN_STREAM)
# Whether this CPU has AVX's 32-byte non-temporal stores (used where destinations allow).
cdef bint HAS_AVX = HKV_CAN_STREAM and hkv_cpu_has_avx()
# The widest non-temporal store this build and CPU use: 32 (AVX), 16 (SSE2), 0 (none).
STREAM_STORE_BYTES = 32 if HAS_AVX else 16 if HKV_CAN_STREAM else 0


cdef struct Grid:
    int ndim                        # axes of runs, outermost first (0: one run per block)
    int64_t shape[MAX_DIMS]
    int64_t dst[MAX_DIMS]           # each axis's stride in bytes, destination side
    int64_t src[MAX_DIMS]           # and source side
    size_t run                      # bytes of one contiguous run
    int store                       # HKV_MEMCPY, HKV_STREAM16 or HKV_STREAM32


cdef void copy_region(char* dst, const char* src, const Grid* g) noexcept nogil:
    """Copies one block: the grid g.shape of contiguous runs of g.run bytes. The two
    innermost axes are plain nested loops (a block of vLLM's CPU layout has three axes, so
    the odometer outside them steps once per plane, not once per run)."""
    cdef int64_t counter[MAX_DIMS]
    cdef int64_t doff = 0
    cdef int64_t soff = 0
    cdef int64_t i, n, dstep, sstep
    cdef int k, outer = g.ndim - 2
    if g.ndim == 0:
        hkv_runs(g.store, dst, src, 1, 0, 0, g.run)
        return
    if g.ndim == 1:
        hkv_runs(g.store, dst, src, g.shape[0], g.dst[0], g.src[0], g.run)
        return
    n = g.shape[outer + 1]
    dstep = g.dst[outer + 1]
    sstep = g.src[outer + 1]
    for k in range(outer):
        counter[k] = 0
    while True:
        for i in range(g.shape[outer]):
            hkv_runs(g.store, dst + doff + i * g.dst[outer], src + soff + i * g.src[outer],
                     n, dstep, sstep, g.run)
        k = outer - 1
        while k >= 0:
            counter[k] += 1
            doff += g.dst[k]
            soff += g.src[k]
            if counter[k] < g.shape[k]:
                break
            doff -= g.dst[k] * g.shape[k]
            soff -= g.src[k] * g.shape[k]
            counter[k] = 0
            k -= 1
        if k < 0:
            return


cdef inline int64_t magnitude(int64_t x) noexcept nogil:
    return -x if x < 0 else x


cdef void order_for_source(Grid* g) noexcept nogil:
    """Puts the grid's axes in the source's memory order (largest source stride outermost,
    a stable sort), so the loads stream; then merges neighbours that this order makes
    contiguous on both sides, and an innermost axis contiguous with the run into the run.
    The bytes copied are the same in any axis order: each (index tuple) is one run."""
    cdef int i, j, k
    cdef int64_t n, d, s
    for i in range(1, g.ndim):
        n = g.shape[i]
        d = g.dst[i]
        s = g.src[i]
        j = i
        while j > 0 and magnitude(g.src[j - 1]) < magnitude(s):
            g.shape[j] = g.shape[j - 1]
            g.dst[j] = g.dst[j - 1]
            g.src[j] = g.src[j - 1]
            j -= 1
        g.shape[j] = n
        g.dst[j] = d
        g.src[j] = s
    k = 0
    for i in range(g.ndim):
        if k > 0 and g.dst[k - 1] == g.dst[i] * g.shape[i] and g.src[k - 1] == g.src[i] * g.shape[i]:
            g.shape[k - 1] *= g.shape[i]
            g.dst[k - 1] = g.dst[i]
            g.src[k - 1] = g.src[i]
        else:
            g.shape[k] = g.shape[i]
            g.dst[k] = g.dst[i]
            g.src[k] = g.src[i]
            k += 1
    g.ndim = k
    while g.ndim > 0 and g.dst[g.ndim - 1] == <int64_t>g.run and g.src[g.ndim - 1] == <int64_t>g.run:
        g.run *= g.shape[g.ndim - 1]
        g.ndim -= 1


cdef int fill_grid(Grid* g, shape, dst_strides, src_strides, size_t run) except -1:
    cdef int ndim = len(shape)
    cdef int k
    if ndim > MAX_DIMS or len(dst_strides) != ndim or len(src_strides) != ndim:
        raise ValueError(f"copy_blocks: a grid of {ndim} axes with {len(dst_strides)} and "
                         f"{len(src_strides)} strides (at most {MAX_DIMS} axes)")
    if run == 0:
        raise ValueError("copy_blocks: runs of 0 bytes")
    g.ndim = ndim
    g.run = run
    g.store = HKV_MEMCPY
    for k in range(ndim):
        g.shape[k] = shape[k]
        g.dst[k] = dst_strides[k]
        g.src[k] = src_strides[k]
        if g.shape[k] <= 0:
            raise ValueError(f"copy_blocks: grid axis {k} has size {g.shape[k]}")
    return 0


def check_blocks(const int64_t[::1] dst_index, int64_t dst_blocks,
                 const int64_t[::1] src_index, int64_t src_blocks):
    """Raises the ValueError copy_layers would for these indices, if any (for a caller
    that does something else first, such as populate_pages)."""
    check_indices(dst_index, dst_blocks, src_index, src_blocks)


cdef int check_indices(const int64_t[::1] dst_index, int64_t dst_blocks,
                       const int64_t[::1] src_index, int64_t src_blocks) except -1:
    cdef Py_ssize_t n = dst_index.shape[0]
    cdef Py_ssize_t i
    if src_index.shape[0] != n:
        raise ValueError(f"copy_blocks: {n} destination blocks but {src_index.shape[0]} "
                         "source blocks")
    for i in range(n):
        if not 0 <= dst_index[i] < dst_blocks:
            raise ValueError(f"copy_blocks: destination block {dst_index[i]} outside "
                             f"[0, {dst_blocks})")
        if not 0 <= src_index[i] < src_blocks:
            raise ValueError(f"copy_blocks: source block {src_index[i]} outside "
                             f"[0, {src_blocks})")
    return 0


cdef int streaming_store(const Grid* g, const uint64_t* dst_layers, Py_ssize_t layers,
                         int64_t dst_block_stride) noexcept nogil:
    """The widest non-temporal store every destination run is aligned and sized for (the
    stores need it), or HKV_MEMCPY."""
    cdef uint64_t bits = <uint64_t>g.run | <uint64_t>dst_block_stride
    cdef Py_ssize_t i
    cdef int k
    if not HKV_CAN_STREAM:
        return HKV_MEMCPY
    for i in range(layers):
        bits |= dst_layers[i]
    for k in range(g.ndim):
        bits |= <uint64_t>g.dst[k]
    if bits & 31 == 0 and HAS_AVX:
        return HKV_STREAM32
    if bits & 15 == 0:
        return HKV_STREAM16
    return HKV_MEMCPY


def copy_layers(const uint64_t[::1] dst_layers, int64_t dst_blocks, int64_t dst_block_stride,
                const int64_t[::1] dst_index,
                const uint64_t[::1] src_layers, int64_t src_blocks, int64_t src_block_stride,
                const int64_t[::1] src_index,
                shape, dst_strides, src_strides, size_t run, stream=None):
    """Copies block ``src_index[i]`` of ``src_layers[l]`` onto block ``dst_index[i]`` of
    ``dst_layers[l]``, for every i and every layer l, in one call without the GIL.

    Every layer has the same block grid and block strides (one layer's copy is the grid
    ``shape`` of contiguous runs of ``run`` bytes; ``dst_strides`` and ``src_strides`` are
    each axis's stride in bytes on either side, and block ``b`` of layer ``l`` starts
    ``b * block_stride`` bytes after ``layers[l]``). The layers are copied one after
    another, each layer's blocks in index order, each block's runs in the source's memory
    order.

    Args:
        dst_layers, src_layers: uint64 addresses of block 0 of each layer, of equal length.
        dst_blocks, src_blocks: How many blocks each side holds (indices are checked).
        dst_block_stride, src_block_stride: Bytes from one block to the next.
        dst_index, src_index: int64 block indices, pairwise, of equal length.
        shape, dst_strides, src_strides: The grid of runs (at most 8 axes).
        run: Bytes of each contiguous run, > 0.
        stream: Non-temporal stores: None (the default) for copies of at least
            STREAM_MIN_BYTES, True or False to choose. Either way only where CAN_STREAM and
            the destination's runs are 16-byte aligned (32 for AVX's stores, where the CPU
            has them); the bytes written are the same.

    Raises:
        ValueError: layer or index arrays of unequal length, an index outside its side's
            blocks, or a bad grid; nothing was copied.
    """
    cdef Grid g
    cdef Py_ssize_t layers = dst_layers.shape[0]
    cdef Py_ssize_t n = dst_index.shape[0]
    cdef Py_ssize_t i, l
    cdef int k
    cdef size_t block_bytes
    cdef const uint64_t* dl
    cdef const uint64_t* sl
    cdef const int64_t* di
    cdef const int64_t* si
    if src_layers.shape[0] != layers:
        raise ValueError(f"copy_layers: {layers} destination layers but {src_layers.shape[0]} "
                         "source layers")
    fill_grid(&g, shape, dst_strides, src_strides, run)
    check_indices(dst_index, dst_blocks, src_index, src_blocks)
    if n == 0 or layers == 0:
        return
    block_bytes = g.run
    for k in range(g.ndim):
        block_bytes *= <size_t>g.shape[k]
    order_for_source(&g)
    dl = &dst_layers[0]
    sl = &src_layers[0]
    di = &dst_index[0]
    si = &src_index[0]
    if stream is None:
        stream = block_bytes * <size_t>n * <size_t>layers >= <size_t>STREAM_MIN_BYTES
    if stream:
        g.store = streaming_store(&g, dl, layers, dst_block_stride)
    with nogil:
        # Layer by layer, each layer's blocks in index order: saves ran at 0.92x a plain
        # memcpy this way and 0.75x block by block, each block's layers in turn (loads alike).
        for l in range(layers):
            for i in range(n):
                copy_region(<char*><uintptr_t>dl[l] + di[i] * dst_block_stride,
                            <const char*><uintptr_t>sl[l] + si[i] * src_block_stride, &g)
        if g.store != HKV_MEMCPY:
            hkv_stream_fence()


def copy_blocks(uintptr_t dst, int64_t dst_blocks, int64_t dst_block_stride,
                const int64_t[::1] dst_index,
                uintptr_t src, int64_t src_blocks, int64_t src_block_stride,
                const int64_t[::1] src_index,
                shape, dst_strides, src_strides, size_t run, stream=None):
    """Copies block ``src_index[i]`` of ``src`` onto block ``dst_index[i]`` of ``dst``: one
    layer's :func:`copy_layers`.

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
        stream: As for copy_layers.

    Raises:
        ValueError: indices of unequal length, an index outside its side's blocks, or a
            bad grid; nothing was copied.
    """
    cdef uint64_t dst_layer[1]
    cdef uint64_t src_layer[1]
    dst_layer[0] = dst
    src_layer[0] = src
    copy_layers(<uint64_t[:1]>dst_layer, dst_blocks, dst_block_stride, dst_index,
                <uint64_t[:1]>src_layer, src_blocks, src_block_stride, src_index,
                shape, dst_strides, src_strides, run, stream)


# The kernel's fault-around window (fault_around_bytes: 64 KiB since Linux 3.15): a read
# fault on a file mapping maps every cached page of the aligned window around it.
FAULT_AROUND_BYTES = 64 << 10


def populate_pages(uintptr_t base, int64_t page_stride, int64_t page_bytes, int64_t num_pages,
                   const int64_t[::1] index, uint8_t[::1] mapped):
    """Maps pages ``index[i]`` of a pool into this process's page tables before a copy
    writes them: reads the first byte of each page that ``mapped`` does not mark and one
    byte of every FAULT_AROUND_BYTES window after it, and marks the page. Without the GIL;
    changes no byte.

    A process's first touch of each 4 KiB page of a shared mapping costs it a page fault. A
    write fault maps that one page; a read fault maps the 16 of its 64 KiB window (the
    kernel's fault-around serves reads only), and on a tmpfs, which does not track writes
    through the page tables, maps them writable, so a save's stores into them then take no
    fault. Measured on a 64 MiB copy into a fresh mapping (4 KiB pages), against a plain
    memcpy: 0.16x as it came; 0.47x after a read per 64 KiB; 0.32x after a read per 4 KiB
    (the same faults, but each first touch of a page costs the CPU a page-table update the
    copy then pays again for the dirty bit); 0.39x after madvise(MADV_POPULATE_READ) and
    0.22x after MADV_POPULATE_WRITE (one fault per page). Where the pages are mapped already
    (a pool start_prefault() populated) the reads cost 0.4-4 ns per 4 KiB and
    MADV_POPULATE_READ 170-415 ns, a walk of every page; in huge pages one read maps 2 MiB.
    Where the kernel's window is smaller, the pages the reads did not map fault on the
    copy's first store, as without them.

    Args:
        base: Address of page 0 in this process.
        page_stride: Bytes from one page to the next; page_bytes: bytes of one page (a
            page's bytes are [base + p * page_stride, + page_bytes)).
        num_pages: Pages in the pool (indices are checked).
        index: int64 page indices.
        mapped: One byte per page (at least num_pages), nonzero where done already.

    Returns:
        How many pages it read (those not marked before).

    Raises:
        ValueError: an index outside [0, num_pages), or ``mapped`` too short; nothing was
            read.
    """
    cdef Py_ssize_t n = index.shape[0]
    cdef Py_ssize_t i
    cdef Py_ssize_t done = 0
    cdef int64_t p
    cdef uintptr_t window = max(<uintptr_t>sysconf(_SC_PAGESIZE), <uintptr_t>FAULT_AROUND_BYTES)
    cdef uintptr_t at, end
    if mapped.shape[0] < num_pages:
        raise ValueError(f"populate_pages: {mapped.shape[0]} marks for {num_pages} pages")
    for i in range(n):
        if not 0 <= index[i] < num_pages:
            raise ValueError(f"populate_pages: page {index[i]} outside [0, {num_pages})")
    with nogil:
        for i in range(n):
            p = index[i]
            if mapped[p]:
                continue
            at = base + <uintptr_t>(p * page_stride)
            end = at + <uintptr_t>page_bytes
            while at < end:
                hkv_touch(<const char*>at)
                at = (at & ~(window - 1)) + window      # the next window's first byte
            mapped[p] = 1
            done += 1
    return done
