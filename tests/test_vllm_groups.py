"""KV-cache groups (vLLM's hybrid manager): how hostkv reads them, and how it copies them.

engine_kv reads full-attention and sliding-window groups of one shape as one page of every
layer in model order, and refuses any other kind naming it; GroupCopies moves each group's
layers from the block its own table names, skipping a sliding window's null blocks on a
load and refusing them on a save; CopyEngine's ``layers`` (a strided slice of the pool's
layers) gives the bytes a whole engine gives, on the CPU path and on the GPU path (through
the recording stand-in for CUDA).
"""

from __future__ import annotations

import functools
import threading
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hostkv  # noqa: E402
from hostkv import copy_engine  # noqa: E402
from hostkv.copy_engine import CopyEngine  # noqa: E402
from lib.cuda_standin import RecordingCuda  # noqa: E402
from lib.kv_layouts import as_vllm, make_cache, reference_kv  # noqa: E402, F401
from lib.vllm_engine import BLOCK_SIZE  # noqa: E402
from lib.vllm_helpers import vllm_module, vllm_request  # noqa: E402

BLOCK = 16


def _engine_kv(groups, total_heads=2, tp=1, **parts):
    """engine_kv over a KV-cache config of ``groups``: [(spec, layer names)]; parts: more
    of the vLLM config's parts (speculative_config)."""
    hv = vllm_module()
    from vllm.config import ParallelConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(names, spec)
                                            for spec, names in groups])
    vllm_config = SimpleNamespace(parallel_config=ParallelConfig(tensor_parallel_size=tp),
                                  model_config=SimpleNamespace(
                                      get_total_num_kv_heads=lambda: total_heads),
                                  **parts)
    return hv.layout.engine_kv(vllm_config, config)


def _specs(heads=2, dim=64, dtype=None, window=64):
    vllm_module()
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    dtype = dtype or torch.float32
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=dim, dtype=dtype)
    sliding = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=heads, head_size=dim,
                                dtype=dtype, sliding_window=window)
    return full, sliding


def _names(*indices):
    return [f"model.layers.{i}.self_attn.attn" for i in indices]


def test_layer_runs_split_indices_into_strided_slices():
    layer_runs = vllm_module().layout.layer_runs
    assert layer_runs([0, 1, 2, 3]) == [(0, 4, 1)]
    assert layer_runs([1, 3, 5]) == [(1, 6, 2)]
    assert layer_runs([4]) == [(4, 5, 1)]
    # Gemma-3: five sliding layers of every six, and the sixth full.
    sliding = [i for i in range(12) if i % 6 != 5]
    assert layer_runs(sliding) == [(0, 5, 1), (6, 11, 1)]
    assert layer_runs([5, 11, 17]) == [(5, 18, 6)]
    for layers in ([0, 2, 3, 7, 9, 11], sliding, [5, 11, 17], [2]):
        runs = layer_runs(layers)
        assert [i for run in runs for i in range(*run)] == layers


def test_windowed_and_full_groups_make_one_page_of_every_layer_in_model_order():
    full, sliding = _specs()
    kv = _engine_kv([(sliding, _names(0, 2)), (full, _names(1, 3))])
    assert kv.layout.num_layers == 4 and kv.page_size == BLOCK
    assert kv.layer_names == tuple(_names(0, 1, 2, 3))
    assert [(g.kind, g.layers, g.sliding_window) for g in kv.groups] == [
        ("sliding_window", (0, 2), 64), ("full", (1, 3), None)]
    assert kv.windowed_groups == (0,)
    # One group, all sliding: the same page as a full-attention model of its shape.
    kv = _engine_kv([(sliding, _names(0, 1))])
    assert kv.layout.num_layers == 2 and kv.windowed_groups == (0,)
    # Llama 4's chunked-local layers beside its full ones: windowed too (vLLM frees the
    # blocks of the chunks before the current one).
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    chunked = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                                        dtype=torch.float32, attention_chunk_size=64)
    kv = _engine_kv([(chunked, _names(0, 1, 2)), (full, _names(3))])
    assert [(g.kind, g.layers) for g in kv.groups] == [("chunked_local", (0, 1, 2)),
                                                       ("full", (3,))]
    assert kv.windowed_groups == kv.null_groups == (0,) and kv.loads_asynchronously
    # Without the hybrid manager every layer is one full-attention group, in model order.
    kv = _engine_kv([(full, _names(0, 1, 2, 3))])
    assert [(g.kind, g.layers) for g in kv.groups] == [("full", (0, 1, 2, 3))]


def test_groups_hostkv_cannot_hold_are_refused_naming_what_they_are():
    from vllm.v1.kv_cache_interface import CrossAttentionSpec, MambaSpec, MLAAttentionSpec

    full, sliding = _specs()
    # Recurrent state without prefix caching: vLLM keeps no state at block ends.
    mamba = MambaSpec(block_size=BLOCK, shapes=((3, 64), (2, 16, 16)),
                      dtypes=(torch.float32, torch.float32))
    with pytest.raises(ValueError, match=r"MambaSpec \(MAMBA2\).*has 'none'"):
        _engine_kv([(mamba, ["model.layers.0.linear_attn"]), (full, _names(1))])
    # A cross-attention layer's blocks hold the encoder's tokens, not the prompt's.
    cross = CrossAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                               dtype=torch.float32)
    with pytest.raises(ValueError, match="group 1 of 2 is CrossAttentionSpec"):
        _engine_kv([(full, _names(0)), (cross, _names(1))])
    # Groups of other shapes: a page is one layout.
    wide, _ = _specs(dim=128)
    with pytest.raises(ValueError, match="groups 0 and 1 differ: head_size 64 and 128"):
        _engine_kv([(sliding, _names(0)), (wide, _names(1))])
    mla = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576,
                           dtype=torch.float32)
    with pytest.raises(ValueError, match="MLA only as a model's one KV-cache group"):
        _engine_kv([(mla, _names(0)), (sliding, _names(1))], total_heads=1)


def test_speculative_decoding_is_refused_for_every_model():
    """A dense model with speculative decoding is refused like a hybrid one: a drafter's KV
    at a position comes from the next token too, and draft tokens' KV is written before
    verification rejects it, so no page's bytes would be a function of its key."""
    full, sliding = _specs()
    for groups in ([(full, _names(0, 1))], [(sliding, _names(0)), (full, _names(1))]):
        assert _engine_kv(groups).layout is not None
        for method in ("eagle", "ngram", "mtp"):
            with pytest.raises(ValueError, match=rf"speculative decoding is not supported "
                                                 rf"\(method '{method}'\)"):
                _engine_kv(groups, speculative_config=SimpleNamespace(method=method))


def _group_copies(cache, kv, tensors, asynchronous=False):
    vllm_module()
    from hostkv.vllm.groups import GroupCopies

    return GroupCopies(cache.pages_tensor(), kv, dict(zip(kv.layer_names, tensors)),
                       heads=(0, kv.layout.num_kv_heads), writes=True,
                       asynchronous=asynchronous,
                       parts_pool=cache.parts_tensor() if kv.layout.window_layers else None)


def test_a_failed_submit_waits_for_the_copies_already_started(make_cache):
    """When one group's copy cannot start, the error goes up only once the other groups'
    copies are over: the caller frees the blocks and pages next, which no copy may still
    touch."""
    from hostkv.transfers import Transfer

    full, sliding = _specs(heads=4, dim=8)
    kv = _engine_kv([(sliding, _names(0, 2)), (full, _names(1, 3))], total_heads=4)
    tensors = [as_vllm(r) for r in reference_kv(layers=4, heads=4, dim=8)]
    cache = make_cache(kv.layout)
    copies = _group_copies(cache, kv, tensors, asynchronous=True)
    assert len(copies.engines) == 2
    first, second = copies.engines[0][1], copies.engines[1][1]
    started = []

    def slow(submit, *args):
        # The first group's copy, still running when the second's submit fails.
        real = submit(*args)
        transfer = Transfer(real.nbytes)
        threading.Timer(0.3, lambda: (real.wait(), transfer._finish(real.error))).start()
        started.append(transfer)
        return transfer

    def refuse(*args):
        raise RuntimeError("copy engine gone")

    for name in ("submit_save", "submit_load"):
        started.clear()
        setattr(first, name, functools.partial(slow, getattr(first, name)))
        setattr(second, name, refuse)
        with pytest.raises(RuntimeError, match="copy engine gone"):
            if name == "submit_save":
                copies.submit_save([[7, 2], [4, 9]], [3, 5])
            else:
                copies.submit_load([3, 5], [[7, 2], [4, 9]])
        assert len(started) == 1 and started[0].done()
        # The stand-ins hold their engine: dropped, or the pool view outlives the test.
        del vars(first)[name], vars(second)[name]
    copies.close()
    del copies, first, second


def test_each_group_copies_its_layers_from_its_own_blocks(make_cache):
    """Layers 0 and 2 (sliding) take blocks from their table, 1 and 3 (full) from theirs:
    the page holds every layer's KV of the same tokens, and loads put it back where each
    group's table says, skipping the sliding window's null blocks."""
    full, sliding = _specs(heads=4, dim=8)
    kv = _engine_kv([(sliding, _names(0, 2)), (full, _names(1, 3))], total_heads=4)
    layout = hostkv.KVLayout(4, 4, 8, "float32")
    assert kv.layout == layout
    ref = reference_kv(layers=4, heads=4, dim=8)        # [blocks, kv, tokens, heads, dim]
    tensors = [as_vllm(r) for r in ref]
    cache = make_cache(layout)
    copies = _group_copies(cache, kv, tensors)
    pages = [3, 5]
    sliding_blocks, full_blocks = [7, 2], [4, 9]
    transfer = copies.submit_save([sliding_blocks, full_blocks], pages)
    assert transfer.wait() and transfer.error is None
    pool = cache.pages_tensor().view(torch.float32).view(-1, 4, 2, BLOCK, 4, 8)
    for i, page in enumerate(pages):
        for layer in range(4):
            block = (sliding_blocks if layer in (0, 2) else full_blocks)[i]
            assert torch.equal(pool[page, layer], ref[layer][block].to(pool.dtype))
    # A load of the two pages, the first out of the window (its sliding blocks are vLLM's
    # null block): the full layers get both pages, the sliding layers only the second.
    back = [torch.zeros_like(t) for t in tensors]
    loader = _group_copies(cache, kv, back)
    loader.submit_load(pages, [[0, 6], [1, 10]]).wait()
    for layer in range(4):
        got = back[layer]
        if layer in (0, 2):
            assert not got[0].any()                      # the null block stays untouched
            assert torch.equal(got[6], tensors[layer][2])
        else:
            assert torch.equal(got[1], tensors[layer][4])
            assert torch.equal(got[10], tensors[layer][9])
    # A save that names a null block of a sliding group reads KV that is gone: refused
    # before anything moves.
    before = cache.pages_tensor().clone()
    with pytest.raises(ValueError, match="null block"):
        copies.submit_save([[0, 7], [4, 9]], [1, 2])
    with pytest.raises(ValueError, match="outside"):
        copies.submit_save([[7, 2], [4, 99]], [1, 2])
    with pytest.raises(ValueError, match=r"blocks of \[2\] for 2 groups and 2 pages"):
        copies.submit_save([[7, 2]], [1, 2])
    assert torch.equal(cache.pages_tensor(), before)
    copies.close()
    loader.close()
    del copies, loader, pool, before


def test_window_parts_take_the_windowed_layers_out_of_the_page(make_cache):
    """With window parts the sliding layers (0 and 2) live in the pages' parts: a page
    holds the full layers, its part the sliding ones. A page without a part is saved
    without them, whatever its sliding block (gone from the window, or not); a load reads
    them from the parts, skips null blocks, and refuses a kept block whose page has no
    part. An all-sliding model keeps its layers in the page (none would be left there)."""
    full, sliding = _specs(heads=4, dim=8)
    groups = [(sliding, _names(0, 2)), (full, _names(1, 3))]
    hv = vllm_module()
    from vllm.config import ParallelConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(n, s) for s, n in groups])
    vllm_config = SimpleNamespace(parallel_config=ParallelConfig(tensor_parallel_size=1),
                                  model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 4))
    kv = hv.layout.engine_kv(vllm_config, config, window_parts=True)
    layout = hostkv.KVLayout(4, 4, 8, "float32", window_layers=(0, 2))
    assert kv.layout == layout
    only_sliding = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(_names(0, 1), sliding)])
    assert hv.layout.engine_kv(vllm_config, only_sliding,
                               window_parts=True).layout.window_layers == ()
    ref = reference_kv(layers=4, heads=4, dim=8)
    tensors = [as_vllm(r) for r in ref]
    cache = make_cache(layout, num_parts=4)
    copies = _group_copies(cache, kv, tensors)
    pages, parts = [3, 5, 6], [2, -1, -1]
    sliding_blocks, full_blocks = [7, 2, 0], [4, 9, 5]
    transfer = copies.submit_save([sliding_blocks, full_blocks], pages, parts)
    assert transfer.wait() and transfer.error is None
    pool = cache.pages_tensor().view(torch.float32).view(-1, 2, 2, BLOCK, 4, 8)
    part_pool = cache.parts_tensor().view(torch.float32).view(-1, 2, 2, BLOCK, 4, 8)
    assert part_pool.shape[0] == 4
    for i, page in enumerate(pages):
        for slot, layer in enumerate((1, 3)):
            assert torch.equal(pool[page, slot], ref[layer][full_blocks[i]])
    for slot, layer in enumerate((0, 2)):
        assert torch.equal(part_pool[2, slot], ref[layer][7])
    assert not part_pool[[0, 1, 3]].any()                # no part but page 3's written
    back = [torch.zeros_like(t) for t in tensors]
    loader = _group_copies(cache, kv, back)
    assert loader.submit_load(pages[:2], [[6, 0], [1, 3]], parts[:2]).wait()
    for layer in range(4):
        if layer in (0, 2):
            assert torch.equal(back[layer][6], tensors[layer][7]) and not back[layer][0].any()
        else:
            assert torch.equal(back[layer][1], tensors[layer][4])
            assert torch.equal(back[layer][3], tensors[layer][9])
    before = (cache.pages_tensor().clone(), cache.parts_tensor().clone())
    with pytest.raises(ValueError, match="without a part"):
        loader.submit_load(pages[:2], [[6, 5], [1, 3]], parts[:2])
    with pytest.raises(ValueError, match="null block"):
        copies.submit_save([[0, 2], [4, 9]], [3, 5], [2, -1])
    with pytest.raises(ValueError, match="needs a part for each"):
        copies.submit_save([[7, 2], [4, 9]], [3, 5])
    assert torch.equal(cache.pages_tensor(), before[0])
    assert torch.equal(cache.parts_tensor(), before[1])
    copies.close()
    loader.close()
    del copies, loader, pool, part_pool, before


@pytest.mark.parametrize("gpu_path", [False, True], ids=["cpu", "gpu-standin"])
def test_engines_over_slices_of_the_layers_give_a_whole_engines_bytes(make_cache, gpu_path):
    layout = hostkv.KVLayout(5, 4, 8, "float32")
    ref = reference_kv(layers=5, heads=2, dim=8)          # rank 1 of 2: heads [2, 4)
    tensors = [as_vllm(r) for r in ref]
    blocks, pages = [7, 0, 3], [2, 9, 0]
    whole_cache, parts_cache = make_cache(layout), make_cache(layout)
    CopyEngine(whole_cache.pages_tensor(), layout, BLOCK, tensors, copy_engine.VLLM,
               heads=(2, 4)).save(blocks, pages)
    engines = []
    for run in [(0, 5, 2), (1, 4, 2)]:
        engine = CopyEngine(parts_cache.pages_tensor(), layout, BLOCK,
                            [tensors[i] for i in range(*run)], copy_engine.VLLM,
                            heads=(2, 4), layers=run)
        if gpu_path:
            engine._cuda = engine._cuda_copier(cuda=RecordingCuda(), register=False)
        engine.save(blocks, pages)
        engines.append(engine)
    assert torch.equal(parts_cache.pages_tensor(), whole_cache.pages_tensor())
    for engine in engines:
        engine.close()
    with pytest.raises(ValueError, match=r"layers \(4, 7, 1\) of pages of 5"):
        CopyEngine(parts_cache.pages_tensor(), layout, BLOCK, tensors[:3], copy_engine.VLLM,
                   layers=(4, 7, 1))
    del engines, engine
    assert np.array_equal(parts_cache.pages_array(), whole_cache.pages_array())


# -- the scheduler side with a sliding-window group (the review's findings, as regressions) --

# vllm_request hashes blocks of this size.
SCHED_BLOCK = BLOCK_SIZE

def _scheduler(hv, segment, windowed_groups=(0,), async_loads=True, num_pages=64):
    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
    settings = hv.HostKVSettings(segment=segment, num_pages=num_pages, async_saves=False)
    cache = hv.open_segment(settings, layout, SCHED_BLOCK)
    return hv.scheduler.SchedulerSide(cache, settings, SCHED_BLOCK, b"model", hv.metrics.Failures(),
                                      hv.metrics.Counters(), windowed_groups=windowed_groups,
                                      async_loads=async_loads)


def _cache_prefix(hv, sched, tokens):
    with hostkv.WorkerView(sched.cache) as view:
        view.allocate_pages_for_sequences_with_prefix(
            [hostkv.SequenceRequest(1, tokens, hv.scheduler._namespace(b"model", None, None))])
        view.release([1])


def _sliding_manager(window):
    """vLLM's own KVCacheManager over one sliding-window group, as its scheduler holds it."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    spec = SlidingWindowSpec(block_size=SCHED_BLOCK, num_kv_heads=2, head_size=64,
                             dtype=torch.float32, sliding_window=window)
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(_names(0, 1), spec)])
    return KVCacheManager(config, max_model_len=4096, scheduler_block_size=SCHED_BLOCK,
                          hash_block_size=SCHED_BLOCK)


def test_a_sliding_window_hit_that_cannot_be_loaded_whole_fails_the_whole_request(
        segment_name):
    """All layers sliding (one group). The hit's last page is evicted between lookup and
    borrow. A block-level error would make vLLM recompute from that block, attending to
    window blocks it never allocated (null): wrong KV, which hostkv would then save. So the
    load is asynchronous and fails whole: vLLM computes the request from its first token,
    nothing of this attempt is saved, and the request is offered no hit again."""
    hv = vllm_module()
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    manager = _sliding_manager(window=2 * SCHED_BLOCK)
    sched = _scheduler(hv, segment_name)
    sched.kv_cache_manager = manager
    try:
        rng = np.random.default_rng(5)
        history = rng.integers(1, 1000, 6 * SCHED_BLOCK + 8).tolist()
        _cache_prefix(hv, sched, history)
        request = vllm_request("r1", history + rng.integers(1, 1000, 60).tolist())
        offered, asynchronous = sched.get_num_new_matched_tokens(request, 0)
        assert (offered, asynchronous) == (6 * SCHED_BLOCK, True)
        assert sched.cache.evict(1) == 1                      # the hit's last page
        assert manager.allocate_slots(request, request.num_tokens - offered,
                                      num_external_computed_tokens=offered) is not None
        table = list(manager.get_block_ids("r1")[0])
        assert table[:4] == [0, 0, 0, 0]                      # out of the window: null
        sched.update_state_after_alloc(request, manager.get_blocks("r1"), offered)
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert meta.recv_failed == ["r1"] and meta.loads == [] and meta.bad_blocks == []
        # vLLM frees its blocks and admits it again, from token 0: no hit is offered.
        manager.free(request)
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        request.num_computed_tokens = 0
        assert manager.allocate_slots(request, request.num_tokens) is not None
        table = list(manager.get_block_ids("r1")[0])
        sched.update_state_after_alloc(request, manager.get_blocks("r1"), 0)
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = [NewRequestData.from_request(request, (table,))]
        out.num_scheduled_tokens = {"r1": request.num_tokens}
        meta = sched.build_connector_meta(out)
        assert meta.loads == [] and meta.recv_failed == [] and meta.bad_blocks == []
        # A request that finishes with its load outstanding: vLLM keeps its blocks by
        # itself until the load is reported (it knows whether it was); hostkv asks nothing.
        other = vllm_request("r2", history[:3 * SCHED_BLOCK] + rng.integers(1, 1000, 9).tolist())
        offered, asynchronous = sched.get_num_new_matched_tokens(other, 0)
        assert asynchronous and offered == 3 * SCHED_BLOCK
        assert sched.request_finished(other) is False
        sched.request_finished(request)
        sched.cache.check()
    finally:
        sched.shutdown()


def test_asynchronous_loads_never_run_with_asynchronous_saves(segment_name):
    """A finished request would be reported both received and finished sending: vLLM
    frees its blocks at the first report and fails at the second."""
    hv = vllm_module()
    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
    settings = hv.HostKVSettings(segment=segment_name, num_pages=8, async_saves=True)
    with hv.open_segment(settings, layout, SCHED_BLOCK) as cache:
        with pytest.raises(ValueError, match="asynchronous loads with asynchronous saves"):
            hv.scheduler.SchedulerSide(cache, settings, SCHED_BLOCK, b"model", hv.metrics.Failures(),
                                       hv.metrics.Counters(), windowed_groups=(0,),
                                       async_loads=True)


def test_copiers_of_one_pool_split_at_the_same_registration_edges(make_cache):
    """Only the first engine of a hybrid model's pool registers it; every engine splits its
    copies at the registration chunks' edges, so none spans a registered and a pageable
    range."""
    from lib.kv_layouts import TOKENS

    layout = hostkv.KVLayout(4, 4, 8, "float32")
    cache = make_cache(layout)
    tensors = [as_vllm(r) for r in reference_kv(layers=4, heads=4, dim=8)]
    page = cache.pages_tensor()[0].numel() * cache.pages_tensor().element_size()
    engines = []
    for run, register in [((0, 4, 2), True), ((1, 4, 2), False)]:
        engine = CopyEngine(cache.pages_tensor(), layout, TOKENS,
                            [tensors[i] for i in range(*run)], copy_engine.VLLM, layers=run)
        engine._cuda = engine._cuda_copier(cuda=RecordingCuda(), register=register,
                                           register_chunk_bytes=2 * page)
        engines.append(engine)
    pages = np.array([1, 2])                 # chunk 0 = pages {0, 1}, chunk 1 = {2, 3}
    for engine in engines:
        assert len(engine._cuda.piece_copies(pages, 0, 2, 0)) == 2
    for engine in reversed(engines):
        engine.close()
