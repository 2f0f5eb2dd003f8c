"""hostkv.copy_engine: every engine block layout writes the same canonical page bytes.

Each test builds the engine's KV tensor of one layout from a reference KV array by that
layout's own axis order (written out here, independently of the engine's parser), saves
blocks into a real segment's pages and compares the page bytes exactly with the reference
laid out canonically; then loads them back into a zeroed tensor and compares that too.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

import hostkv  # noqa: E402
from hostkv import copy_engine  # noqa: E402
from hostkv.copy_engine import BlockLayout, CopyEngine, CopyPlan, head_slice_for_rank  # noqa: E402
from lib.kv_layouts import (  # noqa: E402, F401  (make_cache: a fixture)
    BLOCKS, DIM, HEADS, LAYERS, PAGES, TOKENS, as_flash_attn, as_flashinfer_hnd, as_flashinfer_nhd,
    as_vllm, as_vllm_nhd_memory, make_cache, reference_kv)

PER_LAYER = [
    (copy_engine.VLLM, as_vllm),
    (copy_engine.VLLM, as_vllm_nhd_memory),
    (copy_engine.FLASH_ATTN, as_flash_attn),
    (copy_engine.FLASHINFER_NHD, as_flashinfer_nhd),
    (copy_engine.FLASHINFER_HND, as_flashinfer_hnd),
]



def _expected_pages(ref, blocks, pages, num_pages=PAGES):
    """The pool's bytes after saving blocks into pages: [pages, layers, kv, T, H, D]."""
    out = torch.zeros((num_pages, len(ref)) + tuple(ref[0].shape[1:]), dtype=ref[0].dtype)
    for b, p in zip(blocks, pages):
        for layer, kv in enumerate(ref):
            out[p, layer] = kv[b]
    return out


@pytest.mark.parametrize("block_layout,build", PER_LAYER,
                         ids=["vllm", "vllm-LBNHC", "flash-attn", "flashinfer-NHD",
                              "flashinfer-HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_layout_writes_the_canonical_bytes(make_cache, block_layout, build, dtype):
    layout = hostkv.KVLayout(LAYERS, HEADS, DIM, dtype)
    cache = make_cache(layout)
    ref = reference_kv(dtype=dtype)
    tensors = [build(kv) for kv in ref]
    pool = cache.pages_tensor()
    engine = CopyEngine(pool, layout, TOKENS, tensors, block_layout)
    blocks, pages = [7, 0, 3, 11, 5], [2, 9, 0, 4, 5]
    assert engine.save(blocks, pages) == len(blocks) * layout.page_bytes(TOKENS)
    expected = _expected_pages(ref, blocks, pages)
    assert torch.equal(pool.view(expected.shape).view(torch.uint8),
                       expected.view(torch.uint8))
    # Loading the pages back into zeroed blocks restores exactly those blocks.
    back = [torch.zeros_like(t) for t in tensors]
    loader = CopyEngine(pool, layout, TOKENS, back, block_layout)
    assert loader.load(pages, [1, 2, 4, 6, 8]) == len(pages) * layout.page_bytes(TOKENS)
    for layer, tensor in enumerate(back):
        want = torch.zeros_like(ref[layer])
        want[[1, 2, 4, 6, 8]] = ref[layer][blocks]
        assert torch.equal(tensor, build(want))
    del engine, loader, pool


def test_one_tensor_for_every_layer(make_cache):
    layout = hostkv.KVLayout(LAYERS, HEADS, DIM, "float32")
    cache = make_cache(layout)
    ref = reference_kv()
    whole = torch.stack(ref, dim=1).contiguous()             # [B, L, kv, T, H, D]
    pool = cache.pages_tensor()
    engine = CopyEngine(pool, layout, TOKENS, whole, copy_engine.CROSS_LAYER)
    engine.save([4, 1], [0, 3])
    assert torch.equal(pool.view(PAGES, LAYERS, 2, TOKENS, HEADS, DIM),
                       _expected_pages(ref, [4, 1], [0, 3]))
    # vLLM's block-outermost layouts (BLHNC) hand per-layer views into one buffer.
    blhnc = torch.stack([as_vllm(kv) for kv in ref], dim=1).contiguous()   # [B, L, H, T, C]
    per_layer = [blhnc[:, layer] for layer in range(LAYERS)]
    pool.zero_()
    CopyEngine(pool, layout, TOKENS, per_layer, copy_engine.VLLM).save([4, 1], [0, 3])
    assert torch.equal(pool.view(PAGES, LAYERS, 2, TOKENS, HEADS, DIM),
                       _expected_pages(ref, [4, 1], [0, 3]))
    del engine, pool, per_layer


def test_mla_pages_hold_one_latent_per_token(make_cache):
    layout = hostkv.KVLayout(LAYERS, 1, 576, "bfloat16", kind="mla")
    cache = make_cache(layout)
    ref = reference_kv(kv=1, heads=1, dim=576, dtype=torch.bfloat16)
    tensors = [kv[:, 0].permute(0, 2, 1, 3).contiguous() for kv in ref]   # [B, 1, T, 576]
    pool = cache.pages_tensor()
    assert pool.shape == (PAGES, LAYERS, TOKENS, 576)
    CopyEngine(pool, layout, TOKENS, tensors, copy_engine.VLLM_MLA).save([3, 8], [1, 6])
    for b, p in ((3, 1), (8, 6)):
        for layer in range(LAYERS):
            assert torch.equal(pool[p, layer], ref[layer][b, 0, :, 0])
    with pytest.raises(ValueError, match="has 1152 along .dim., hostkv expects 576"):
        # A K|V layout over MLA pages: the content axis is not 2 x 576.
        CopyEngine(pool, layout, TOKENS, [t.repeat(1, 1, 1, 2) for t in tensors],
                   copy_engine.VLLM_MLA)
    del pool


@pytest.mark.parametrize("world", [2, 4, 8])
def test_tensor_parallel_ranks_fill_the_same_pages_as_one(make_cache, world):
    """Each rank saves its heads' slice; together they write what one rank of every head
    writes; with fewer heads than ranks, only one rank of each replica group writes."""
    heads = 4
    layout = hostkv.KVLayout(LAYERS, heads, DIM, "float32")
    cache = make_cache(layout)
    ref = reference_kv(heads=heads)
    pool = cache.pages_tensor()
    blocks, pages = [2, 9, 6], [8, 1, 4]
    writers = 0
    for rank in range(world):
        first, stop, writes = head_slice_for_rank(heads, rank, world)
        writers += writes
        local = [as_vllm(kv[..., first:stop, :].contiguous()) for kv in ref]
        engine = CopyEngine(pool, layout, TOKENS, local, copy_engine.VLLM,
                            heads=(first, stop), writes=writes)
        assert engine.save(blocks, pages) == (layout.page_bytes(TOKENS) * (stop - first)
                                              // heads * len(blocks) if writes else 0)
        # Every rank loads its own slice back.
        back = [torch.zeros_like(t) for t in local]
        CopyEngine(pool, layout, TOKENS, back, copy_engine.VLLM,
                   heads=(first, stop)).load(pages, blocks)
        if writes:
            for layer in range(LAYERS):
                assert torch.equal(back[layer][blocks], local[layer][blocks])
    assert writers == min(world, heads)
    assert torch.equal(pool.view(PAGES, LAYERS, 2, TOKENS, heads, DIM),
                       _expected_pages(ref, blocks, pages))
    del pool


def test_head_slices():
    assert head_slice_for_rank(8, 3, 4) == (6, 8, True)
    assert head_slice_for_rank(1, 1, 2) == (0, 1, False)
    assert [head_slice_for_rank(2, r, 4) for r in range(4)] == [
        (0, 1, True), (0, 1, False), (1, 2, True), (1, 2, False)]
    with pytest.raises(ValueError, match="6 KV heads do not split over 4 ranks"):
        head_slice_for_rank(6, 0, 4)
    with pytest.raises(ValueError, match="3 KV heads do not replicate evenly over 4 ranks"):
        head_slice_for_rank(3, 0, 4)


def test_plans_coalesce_to_the_longest_runs():
    # Canonical on both sides: one run of the whole block.
    plan = CopyPlan.build((2, 16, 4, 8), (2048, 128, 32, 4), (2048, 128, 32, 4), 4)
    assert plan == CopyPlan((), (), (), 4096)
    # vLLM CPU [H, T, (kv D)] against canonical [kv, T, H, D]: runs of one head's D.
    plan = CopyPlan.build((2, 16, 4, 8), (2048, 128, 32, 4), (32, 64, 1024, 4), 4)
    assert plan.run == 32 and plan.shape == (2, 16, 4)


def test_unknown_and_mismatched_layouts_are_refused(make_cache):
    layout = hostkv.KVLayout(LAYERS, HEADS, DIM, "float32")
    cache = make_cache(layout)
    pool = cache.pages_tensor()
    good = [as_vllm(kv) for kv in reference_kv()]
    with pytest.raises(ValueError, match=r"unknown axes \['heads'\]"):
        CopyEngine(pool, layout, TOKENS, good, BlockLayout("block heads token (kv dim)"))
    with pytest.raises(ValueError, match="no dim axis"):
        CopyEngine(pool, layout, TOKENS, good, BlockLayout("block head token kv"))
    with pytest.raises(ValueError, match=r"shape \(12, 4, 16, 16\) has 4 axes, the layout 5"):
        CopyEngine(pool, layout, TOKENS, good, copy_engine.FLASH_ATTN)
    with pytest.raises(ValueError, match="has 4 along 'head', hostkv expects 2"):
        CopyEngine(pool, layout, TOKENS, good, copy_engine.VLLM, heads=(0, 2))
    with pytest.raises(ValueError, match="dtype torch.float16, the pages hold torch.float32"):
        CopyEngine(pool, layout, TOKENS, [t.half() for t in good], copy_engine.VLLM)
    with pytest.raises(ValueError, match="2 KV tensors for 3 layers of pages"):
        CopyEngine(pool, layout, TOKENS, good[:2], copy_engine.VLLM)
    engine = CopyEngine(pool, layout, TOKENS, good, copy_engine.VLLM)
    before = pool.clone()
    with pytest.raises(ValueError, match=r"a page outside \[0, 10\) in \[3, 10\]"):
        engine.save([0, 1], [3, 10])
    with pytest.raises(ValueError, match=r"a block outside \[0, 12\) in \[12\]"):
        engine.save([12], [0])
    with pytest.raises(ValueError, match="2 blocks for 1 pages"):
        engine.save([0, 1], [3])
    assert torch.equal(pool, before)           # nothing was copied
    del engine, pool


def test_copies_release_the_gil_and_threads_may_copy_at_once(make_cache):
    import threading

    layout = hostkv.KVLayout(LAYERS, HEADS, DIM, "float32")
    cache = make_cache(layout, num_pages=BLOCKS)
    ref = reference_kv()
    tensors = [as_vllm(kv) for kv in ref]
    pool = cache.pages_tensor()
    engine = CopyEngine(pool, layout, TOKENS, tensors, copy_engine.VLLM)
    halves = [list(range(0, BLOCKS, 2)), list(range(1, BLOCKS, 2))]
    threads = [threading.Thread(target=engine.save, args=(h, h)) for h in halves]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.equal(pool.view(BLOCKS, LAYERS, 2, TOKENS, HEADS, DIM),
                       _expected_pages(ref, range(BLOCKS), range(BLOCKS), BLOCKS))
    assert np.array_equal(cache.pages_array()[0], pool[0].view(-1).view(torch.uint8).numpy())
    del engine, pool


# -- the compiled loop's paths: streaming stores, one call for every layer, populating ------


@pytest.fixture(params=["memcpy", "streaming"])
def store_path(request, monkeypatch):
    """Runs a test with every copy on one store path: memcpy, or non-temporal stores (where
    the build has them; elsewhere memcpy again), whatever the copy's size."""
    from hostkv import _blockcopy
    monkeypatch.setattr(_blockcopy, "STREAM_MIN_BYTES", 0 if request.param == "streaming"
                        else 1 << 62)
    return request.param


@pytest.mark.parametrize("block_layout,build", PER_LAYER,
                         ids=["vllm", "vllm-LBNHC", "flash-attn", "flashinfer-NHD",
                              "flashinfer-HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_both_store_paths_write_the_canonical_bytes(make_cache, store_path, block_layout,
                                                    build, dtype):
    test_every_layout_writes_the_canonical_bytes(make_cache, block_layout, build, dtype)


def test_both_store_paths_for_one_tensor_of_every_layer(make_cache, store_path):
    test_one_tensor_for_every_layer(make_cache)


def _grid_case(rng, itemsize):
    """A random block grid: a canonical [kv, T, H, D] block against the same axes in a random
    order on the engine side, as byte strides, and the two buffers' block strides."""
    sizes = [2, int(rng.integers(1, 5)), int(rng.integers(1, 5)), int(rng.integers(1, 9))]
    canonical = np.arange(int(np.prod(sizes))).reshape(sizes)
    order = rng.permutation(4)
    engine = canonical.transpose(order).copy()             # another physical order
    inverse = np.argsort(order)
    engine_strides = [s for s in np.array(engine.strides)[inverse] // engine.itemsize * itemsize]
    pool_strides = [s // canonical.itemsize * itemsize for s in canonical.strides]
    return sizes, pool_strides, engine_strides


@pytest.mark.parametrize("seed", range(6))
def test_one_call_copies_every_layer_as_one_call_per_layer_does(seed, store_path):
    """copy_layers over every layer writes what copy_blocks per layer writes, for any grid
    and axis order, and touches no byte outside the blocks named."""
    from hostkv._blockcopy import copy_blocks, copy_layers
    rng = np.random.default_rng(seed)
    itemsize = int(rng.choice([2, 4, 16]))
    sizes, pool_strides, engine_strides = _grid_case(rng, itemsize)
    plan = CopyPlan.build(sizes, pool_strides, engine_strides, itemsize)
    block = int(np.prod(sizes)) * itemsize
    layers, blocks = 3, 7
    src = rng.integers(0, 256, (layers, blocks, block), dtype=np.uint8)
    one = np.zeros((layers, blocks + 1, block), dtype=np.uint8)    # one spare block each
    each = np.zeros_like(one)
    src_index = np.array([4, 0, 6], dtype=np.int64)
    dst_index = np.array([1, 5, 2], dtype=np.int64)
    addresses = [np.array([a[layer].ctypes.data for layer in range(layers)], dtype=np.uint64)
                 for a in (one, src)]
    copy_layers(addresses[0], blocks + 1, block, dst_index, addresses[1], blocks, block,
                src_index, plan.shape, plan.pool_strides, plan.engine_strides, plan.run)
    for layer in range(layers):
        copy_blocks(each[layer].ctypes.data, blocks + 1, block, dst_index,
                    src[layer].ctypes.data, blocks, block, src_index,
                    plan.shape, plan.pool_strides, plan.engine_strides, plan.run)
    assert np.array_equal(one, each)
    # Against numpy: the source block read in the engine's order, laid out canonically.
    engine_view = np.lib.stride_tricks.as_strided
    for layer in range(layers):
        for d, s in zip(dst_index, src_index):
            items = src[layer, s].view(f"V{itemsize}")
            want = engine_view(items, sizes, engine_strides)
            assert np.array_equal(one[layer, d].view(f"V{itemsize}").reshape(sizes), want)
    untouched = [b for b in range(blocks + 1) if b not in dst_index]
    assert not one[:, untouched].any()


def test_every_destination_alignment_gets_the_same_bytes(store_path):
    """Streaming stores need 16-byte-aligned runs (32 for AVX's): a 32-aligned destination
    takes the widest stores the CPU has, a 16-aligned one SSE2's, any other memcpy; all
    write the same bytes and nothing beside them."""
    from hostkv._blockcopy import copy_blocks
    src = np.arange(4 * 256, dtype=np.uint32).view(np.uint8)
    for offset in (0, 1, 8, 16, 32, 48):
        room = np.zeros(src.size + 256, dtype=np.uint8)
        start = (-room.ctypes.data) % 64 + offset           # from a 64-byte boundary
        copy_blocks(room.ctypes.data + start, 4, 1024, np.arange(4, dtype=np.int64),
                    src.ctypes.data, 4, 1024, np.array([3, 2, 1, 0], dtype=np.int64),
                    (4,), (256,), (256,), 256)
        got = room[start:start + src.size].reshape(4, 1024)
        assert np.array_equal(got, src.reshape(4, 1024)[::-1])
        assert not room[:start].any() and not room[start + src.size:].any()


def test_bad_indices_are_refused_before_any_byte_moves():
    from hostkv._blockcopy import copy_layers
    src = np.ones((2, 4, 64), dtype=np.uint8)
    dst = np.zeros((2, 4, 64), dtype=np.uint8)
    layers = [np.array([a[0].ctypes.data, a[1].ctypes.data], dtype=np.uint64)
              for a in (dst, src)]
    ok = np.array([0, 1, 2], dtype=np.int64)
    cases = [
        (np.array([0, 1, 4], dtype=np.int64), ok, r"destination block 4 outside \[0, 4\)"),
        (ok, np.array([0, -1, 2], dtype=np.int64), r"source block -1 outside \[0, 4\)"),
        (ok, ok[:2], "3 destination blocks but 2 source blocks"),
    ]
    for dst_index, src_index, message in cases:
        for stream in (False, True):
            with pytest.raises(ValueError, match=message):
                copy_layers(layers[0], 4, 64, dst_index, layers[1], 4, 64, src_index,
                            (), (), (), 64, stream=stream)
    with pytest.raises(ValueError, match="2 destination layers but 1 source layers"):
        copy_layers(layers[0], 4, 64, ok, layers[1][:1], 4, 64, ok, (), (), (), 64)
    with pytest.raises(ValueError, match="runs of 0 bytes"):
        copy_layers(layers[0], 4, 64, ok, layers[1], 4, 64, ok, (), (), (), 0)
    with pytest.raises(ValueError, match="grid axis 0 has size 0"):
        copy_layers(layers[0], 4, 64, ok, layers[1], 4, 64, ok, (0,), (64,), (64,), 64)
    assert not dst.any()                                   # nothing was copied


def test_a_bad_page_or_block_is_refused_before_any_byte_or_page_table_moves(make_cache):
    layout = hostkv.KVLayout(LAYERS, HEADS, DIM, "float32")
    cache = make_cache(layout)
    pool = cache.pages_tensor()
    tensors = [as_vllm(kv) for kv in reference_kv()]
    before = [t.clone() for t in tensors]
    engine = CopyEngine(pool, layout, TOKENS, tensors, copy_engine.VLLM)
    engine._cpu_setup()                                    # the page marks, none set
    with pytest.raises(ValueError, match=r"a page outside \[0, 10\) in \[0, 10\]"):
        engine.load([0, 10], [1, 2])
    with pytest.raises(ValueError, match=r"a block outside \[0, 12\) in \[1, 12\]"):
        engine.load([0, 1], [1, 12])
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    with pytest.raises(ValueError, match=r"a page outside \[0, 10\) in \[3, 10\]"):
        engine.save([0, 1], [3, 10])
    with pytest.raises(ValueError, match=r"a block outside \[0, 12\) in \[12, 0\]"):
        engine.save([12, 0], [3, 4])
    assert not engine._cpu.mapped.any()                    # and no page was populated
    del engine, pool


def test_layers_of_different_strides_take_a_call_each(make_cache, store_path):
    """Per-layer tensors need not share a physical order: the layers that do share one
    compiled call."""
    layout = hostkv.KVLayout(LAYERS, HEADS, DIM, "float32")
    cache = make_cache(layout)
    ref = reference_kv()
    tensors = [(as_vllm if layer % 2 else as_vllm_nhd_memory)(kv) for layer, kv in enumerate(ref)]
    pool = cache.pages_tensor()
    engine = CopyEngine(pool, layout, TOKENS, tensors, copy_engine.VLLM)
    engine.save([5, 9], [7, 2])
    assert len(engine._cpu.groups) == 2
    assert torch.equal(pool.view(PAGES, LAYERS, 2, TOKENS, HEADS, DIM),
                       _expected_pages(ref, [5, 9], [7, 2]))
    del engine, pool


def test_saves_into_pages_no_process_has_touched(make_cache):
    """A fresh segment's pool is reserved but never written; a save from another mapping
    (attached after, as another process would) populates and fills exactly its pages, and
    marks them; a load of untouched pages reads zeros."""
    layout = hostkv.KVLayout(LAYERS, HEADS, DIM, "bfloat16")
    creator = make_cache(layout, num_pages=64)
    other = hostkv.HostKVCache.attach(creator.name)
    try:
        ref = reference_kv(dtype=torch.bfloat16)
        tensors = [as_vllm(kv) for kv in ref]
        engine = CopyEngine(other.pages_tensor(), layout, TOKENS, tensors, copy_engine.VLLM)
        pages = [40, 41, 42, 7, 63, 0]                     # a run of three, and strays
        blocks = [0, 1, 2, 3, 4, 5]
        engine.save(blocks, pages)
        assert sorted(np.flatnonzero(engine._cpu.mapped)) == sorted(pages)
        pool = creator.pages_tensor()
        assert torch.equal(pool.view(64, LAYERS, 2, TOKENS, HEADS, DIM).view(torch.uint8),
                           _expected_pages(ref, blocks, pages, 64).view(torch.uint8))
        back = [torch.ones_like(t) for t in tensors]
        loader = CopyEngine(other.pages_tensor(), layout, TOKENS, back, copy_engine.VLLM)
        loader.load([41, 20], [2, 6])                      # page 20: never written
        for layer in range(LAYERS):
            assert torch.equal(back[layer][2], tensors[layer][1])
            assert not back[layer][6].any()
        del engine, loader, pool
    finally:
        other.close()


def test_populate_pages_marks_what_it_mapped():
    """It reads each page not marked (a byte per 64 KiB window) and marks it, changes no byte,
    and refuses bad indices before reading any."""
    from hostkv._blockcopy import populate_pages
    buf = np.zeros((6, 8192 + 100), dtype=np.uint8)        # pages not OS-page aligned
    mapped = np.zeros(6, dtype=np.uint8)
    base, stride = buf.ctypes.data, buf.strides[0]
    assert populate_pages(base, stride, 8192, 6, np.array([4, 1, 2, 1], np.int64), mapped) == 3
    assert mapped.tolist() == [0, 1, 1, 0, 1, 0]
    assert populate_pages(base, stride, 8192, 6, np.array([2, 3], np.int64), mapped) == 1
    assert populate_pages(base, stride, 8192, 6, np.array([], np.int64), mapped) == 0
    with pytest.raises(ValueError, match=r"page 6 outside \[0, 6\)"):
        populate_pages(base, stride, 8192, 6, np.array([0, 6], np.int64), mapped)
    with pytest.raises(ValueError, match="5 marks for 6 pages"):
        populate_pages(base, stride, 8192, 6, np.array([0], np.int64), mapped[:5])
    assert mapped.tolist() == [0, 1, 1, 1, 1, 0] and not buf.any()


def test_an_engine_that_does_not_populate_still_copies(make_cache):
    """Without the populate (the bench's cold case "no populate"), the copies fault the
    pages in themselves."""
    layout = hostkv.KVLayout(LAYERS, HEADS, DIM, "float32")
    cache = make_cache(layout)
    ref = reference_kv()
    pool = cache.pages_tensor()
    engine = CopyEngine(pool, layout, TOKENS, [as_vllm(kv) for kv in ref], copy_engine.VLLM)
    engine._cpu_setup().mapped = None
    engine.save([3, 4, 5], [1, 2, 6])
    assert torch.equal(pool.view(PAGES, LAYERS, 2, TOKENS, HEADS, DIM),
                       _expected_pages(ref, [3, 4, 5], [1, 2, 6]))
    del engine, pool


def test_a_plain_tensor_pool(store_path):
    """The pool may be any CPU tensor (its bytes are all that is used), not only a segment's."""
    layout = hostkv.KVLayout(LAYERS, HEADS, DIM, "float16")
    pool = torch.zeros(PAGES * layout.page_bytes(TOKENS), dtype=torch.uint8)
    ref = reference_kv(dtype=torch.float16)
    engine = CopyEngine(pool, layout, TOKENS, [as_flashinfer_hnd(kv) for kv in ref],
                        copy_engine.FLASHINFER_HND)
    engine.save([0, 11, 6], [9, 3, 4])
    assert torch.equal(pool.view(torch.float16).view(PAGES, LAYERS, 2, TOKENS, HEADS, DIM),
                       _expected_pages(ref, [0, 11, 6], [9, 3, 4]))


# -- what the engine refuses: indices that are not integers, layers and pools that differ ----


def test_indices_must_be_integers_and_a_refused_call_changes_nothing(make_cache):
    """numpy would truncate 1.9 to block 1 and take True for 1; every such index is
    refused, naming it, before any byte moves. Python and numpy integers, in lists or
    integer arrays of any width, are taken."""
    layout = hostkv.KVLayout(LAYERS, HEADS, DIM, "float32")
    cache = make_cache(layout)
    pool = cache.pages_tensor()
    tensors = [as_vllm(kv) for kv in reference_kv()]
    engine = CopyEngine(pool, layout, TOKENS, tensors, copy_engine.VLLM)
    before = [t.clone() for t in tensors]
    cases = [
        (([1.9], [2.7]), r"blocks must be integers, got float64 values \[1.9\]"),
        (([1], [2.0]), r"pages must be integers, got float64 values \[2.0\]"),
        (([True], [2]), r"blocks must be integers, got bool values \[True\]"),
        (([3, True], [2, 4]), r"blocks\[1\] is True: blocks must be integers, not bools"),
        (([3, 4], [np.False_, 5]), r"pages\[0\] is \S*False\S*: pages must be integers, not bools"),
        ((np.array([1, 0], dtype=bool), [2, 4]), "blocks must be integers, got bool values"),
        (([1, 2], np.array([2.0, 4.0], dtype=np.float32)), "pages must be integers, got float32"),
        ((torch.tensor([1.5]), [2]), "blocks must be integers, got float32 values"),
        ((["1"], [2]), "blocks must be integers, got <U1 values"),
        (([[1, 2]], [[2, 4]]), r"blocks must be a 1-D sequence of integers, got shape \(1, 2\)"),
        ((np.array([2 ** 63], dtype=np.uint64), [2]), r"a block outside \[0, 12\) in \[9223"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.save(*args)
        with pytest.raises(ValueError, match=message):
            engine.load(*args[::-1])                       # load(pages, blocks)
    assert not pool.any()                                  # no save wrote a byte
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))   # nor any load
    # Integers of every kind numpy and Python have.
    for blocks, pages in [([np.int64(7), 0], [np.int32(2), 9]),
                          (np.array([7, 0], dtype=np.uint8), np.array([2, 9], dtype=np.int16)),
                          (np.array([7, 0], dtype=np.uint64)[::-1][::-1], [2, 9]),
                          (torch.tensor([7, 0]), range(2, 10, 7))]:
        pool.zero_()
        engine.save(blocks, pages)
        assert torch.equal(pool.view(PAGES, LAYERS, 2, TOKENS, HEADS, DIM),
                           _expected_pages(reference_kv(), [7, 0], [2, 9]))
    pool.zero_()
    engine.save(np.int64(4), 3)                            # one integer: one index
    assert torch.equal(pool.view(PAGES, LAYERS, 2, TOKENS, HEADS, DIM),
                       _expected_pages(reference_kv(), [4], [3]))
    assert engine.save([], []) == 0 and engine.save(np.array([], dtype=np.int64), ()) == 0
    del engine, pool


def test_layers_of_different_block_counts_are_refused(make_cache):
    """The compiled loop checks every index against one block count: a layer with fewer
    blocks would be read or written past its end."""
    layout = hostkv.KVLayout(LAYERS, HEADS, DIM, "float32")
    cache = make_cache(layout)
    pool = cache.pages_tensor()
    tensors = [as_vllm(kv) for kv in reference_kv()]
    tensors[2] = tensors[2][:10]
    with pytest.raises(ValueError, match="different numbers of blocks: layer 0 has 12, "
                                         "layer 2 has 10"):
        CopyEngine(pool, layout, TOKENS, tensors, copy_engine.VLLM)
    del pool


def test_a_pool_of_other_pages_is_refused(make_cache):
    """A pool whose pages are another size (another page size or layout: its first axis
    counts the pages) would have its bytes read as pages of this layout; a non-contiguous
    one would be copied by reshape, and the engine would fill the copy."""
    layout = hostkv.KVLayout(LAYERS, HEADS, DIM, "float32")
    page_bytes = layout.page_bytes(TOKENS)
    tensors = [as_vllm(kv) for kv in reference_kv()]
    for pool in [torch.zeros(PAGES // 2, 2 * page_bytes, dtype=torch.uint8),   # 32 tokens
                 torch.zeros(2 * PAGES, page_bytes // 2, dtype=torch.uint8),
                 torch.zeros(PAGES, LAYERS + 1, 2, TOKENS, HEADS, DIM),        # another layout
                 torch.zeros(PAGES * page_bytes + 4, dtype=torch.uint8)]:
        with pytest.raises(ValueError, match=f"does not hold pages of {TOKENS} tokens x "
                                             f"{layout.token_bytes} bytes"):
            CopyEngine(pool, layout, TOKENS, tensors, copy_engine.VLLM)
    pool = torch.zeros(page_bytes, PAGES, dtype=torch.uint8).t()
    with pytest.raises(ValueError, match="the pool must be contiguous"):
        CopyEngine(pool, layout, TOKENS, tensors, copy_engine.VLLM)
    # A page-size mismatch with the segment itself: pages of 16 tokens read as 8.
    cache = make_cache(layout)
    half = [t[:, :, :TOKENS // 2] for t in tensors]
    pool = cache.pages_tensor()
    with pytest.raises(ValueError, match=r"\(10, 3, 2, 16, 4, 8\) torch.float32 .* does not "
                                         "hold pages of 8 tokens"):
        CopyEngine(pool, layout, TOKENS // 2, half, copy_engine.VLLM)
    del pool
