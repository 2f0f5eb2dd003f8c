"""Recurrent state (Mamba, Gated DeltaNet: vLLM's ``MambaSpec`` in "align" mode) in pages.

hostkv.vllm.state's protocol, piece by piece, without an engine: engine_kv reads a
Qwen3-Next-like model (linear-attention layers between full-attention ones) as one page of
every layer, a state layer's slot holding each rank's state then a marker per rank, and
refuses the state it cannot keep at page ends, saying why; GroupCopies moves K/V and state
between vLLM's blocks and pages with exact bytes, in both forms vLLM hands a state layer's
cache (its list of state tensors, and the one int8 view it registers with a connector), a
save without a state zeroing the marker a page had, a load of a page without one failing;
the pure functions that walk a match back to a page with the state and pick the blocks of
saves and loads; and the scheduler side with vLLM's own KVCacheManager: hits cut back to a
page with the state, a hit whose state went between lookup and borrow failed whole, loads
naming only the hit's last state block, saves taking the blocks vLLM offered, and a full
round trip from one request's saves to another's load.

The byte format (each rank's bytes rank after rank where hostkv knows no split, the whole
state where it does; then an 8-byte marker per rank naming the rank and the degree) is
spelled out here from the layout's docstring rather than read back from hostkv, so a change
to it fails here. The whole-state tests shard a GDN state as vLLM shards the weights that
make it, and check that ranks of TP=1, 2 and 4 write the same bytes and read their shares.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hostkv  # noqa: E402
from lib.kv_layouts import BLOCKS, TOKENS, as_vllm, make_cache, reference_kv  # noqa: E402, F401
from lib.vllm_engine import BLOCK_SIZE  # noqa: E402
from lib.vllm_helpers import vllm_module, vllm_request  # noqa: E402

BLOCK = TOKENS                      # the copy tests' pages (make_cache) are vLLM blocks


def marker(rank=0, degree=1):
    """The format's marker of a rank of a TP degree, spelled out."""
    return b"hkvst\x02" + bytes((rank, degree))


MARKER = marker()
# A rank's state per block, as vLLM declares it for a GDN layer: a conv state and an SSM
# state, of two element types: 3 * 20 * 4 + 2 * 4 * 8 * 2 = 368 bytes.
SHAPES = ((3, 20), (2, 4, 8))
DTYPES = (torch.float32, torch.bfloat16)
RANK_BYTES = 368
STATE_LAYERS, FULL_LAYERS = (0, 2), (1, 3)


def _state_name(i):
    return f"model.layers.{i}.linear_attn"


def _full_name(i):
    return f"model.layers.{i}.self_attn.attn"


def _state_spec(block=BLOCK, shapes=SHAPES, dtypes=DTYPES, mode="align", **more):
    vllm_module()
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=block, shapes=shapes, dtypes=dtypes, mamba_cache_mode=mode,
                     mamba_type=MambaAttentionBackendEnum.GDN_ATTN, **more)


def _full_spec(block=BLOCK, heads=4, dim=8):
    vllm_module()
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=dim,
                             dtype=torch.float32)


def _kv_cache_config(groups, num_blocks=BLOCKS):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec)
                                          for spec, names in groups])


def _engine_kv(groups, total_heads=4, tp=1, **config):
    """engine_kv over a KV-cache config of ``groups``: [(spec, layer names)]; config: more
    of the vLLM config's parts (speculative_config, cache_config)."""
    hv = vllm_module()
    from vllm.config import ParallelConfig
    from vllm.config.mamba import MambaConfig

    vllm_config = SimpleNamespace(parallel_config=ParallelConfig(tensor_parallel_size=tp),
                                  model_config=SimpleNamespace(
                                      get_total_num_kv_heads=lambda: total_heads),
                                  mamba_config=MambaConfig(), **config)
    return hv.layout.engine_kv(vllm_config, _kv_cache_config(groups))


def _qwen3_next_groups(state=None, full=None, block=BLOCK, heads=4, dim=8):
    """Layers 0 and 2 linear attention (one state group), 1 and 3 full attention, in the
    order vLLM lists Qwen3-Next's groups."""
    return [(state or _state_spec(block=block), [_state_name(i) for i in STATE_LAYERS]),
            (full or _full_spec(block=block, heads=heads, dim=dim),
             [_full_name(i) for i in FULL_LAYERS])]


def _qwen3_next_kv(tp=1, total_heads=4):
    return _engine_kv(_qwen3_next_groups(heads=total_heads // tp), total_heads=total_heads,
                      tp=tp)


# -- engine_kv -----------------------------------------------------------------------------


def test_a_qwen3_next_like_model_is_a_page_of_every_layer_with_state_slots():
    """Linear-attention and full-attention layers make one page in model order; the state
    group's layout is the spec's shapes and types, one part and one marker per rank."""
    kv = _qwen3_next_kv()
    # The header records which layers' slots hold a state.
    assert kv.layout == hostkv.KVLayout(4, 4, 8, "float32", state_layers=(0, 2))
    assert kv.page_size == BLOCK
    assert kv.layer_names == (_state_name(0), _full_name(1), _state_name(2), _full_name(3))
    assert [(g.kind, g.layers, g.sliding_window) for g in kv.groups] == [
        ("state", (0, 2), None), ("full", (1, 3), None)]
    assert kv.groups[1].state is None
    assert (kv.state_groups, kv.null_groups, kv.windowed_groups) == ((0,), (0,), ())
    # Two groups: vLLM takes only whole-request load failures.
    assert kv.loads_asynchronously
    state = kv.groups[0].state
    assert (state.shapes, state.dtypes, state.itemsizes, state.tp_world, state.kind) == (
        SHAPES, ("float32", "bfloat16"), (4, 2), 1, "MambaSpec (GDN_ATTN)")
    assert (state.rank_bytes, state.slot_bytes) == (RANK_BYTES, RANK_BYTES + 8)
    assert (state.runs(0), state.marker(0)) == ([(0, 0, RANK_BYTES)], RANK_BYTES)
    assert not state.canonical           # an architecture hostkv knows no split of
    # Two ranks: both parts, then both markers.
    state = _qwen3_next_kv(tp=2).groups[0].state
    assert (state.tp_world, state.rank_bytes, state.slot_bytes) == (2, RANK_BYTES,
                                                                    2 * RANK_BYTES + 16)
    assert [state.runs(r) for r in (0, 1)] == [[(0, 0, RANK_BYTES)],
                                               [(0, RANK_BYTES, RANK_BYTES)]]
    assert [state.marker(r) for r in (0, 1)] == [2 * RANK_BYTES, 2 * RANK_BYTES + 8]


def test_pages_with_state_name_the_tensor_parallel_degree_in_the_namespace():
    """A state is each rank's shard, so pages of a model with state mean the same only to
    engines of one TP degree: the parts description (part of engine_identity) names it.
    A model without state keeps the namespace it always had (no parts field at all)."""
    hv = vllm_module()
    import vllm

    one, two = _qwen3_next_kv(tp=1), _qwen3_next_kv(tp=2)
    # The bytes are vLLM's own: its version and Mamba backend are named too.
    assert one.parts_description() == ("layers [0, 2]: MambaSpec (GDN_ATTN) state of [3, 20] "
                                       "float32, [2, 4, 8] bfloat16 per rank, 1 rank(s), as "
                                       f"vLLM {vllm.__version__} on cpu, Mamba backend TRITON lays "
                                       "it out")
    assert two.parts_description() == one.parts_description().replace("1 rank(s)",
                                                                       "2 rank(s)")
    attention_only = _engine_kv([(_full_spec(), [_full_name(i) for i in range(4)])])
    assert attention_only.parts_description() == ""
    model = SimpleNamespace(model="no-such-org/no-such-model", revision=None, dtype="float32",
                            quantization=None, quantization_config=None, hf_overrides={},
                            max_model_len=2048, model_impl="auto", hf_config=None)
    config = SimpleNamespace(model_config=model)
    identity = hv.identity.engine_identity
    plain = identity(config, one.layout, "")
    assert identity(config, one.layout, "", attention_only.parts_description()) == plain
    by_tp = {identity(config, one.layout, "", kv.parts_description()) for kv in (one, two)}
    assert len(by_tp) == 2 and plain not in by_tp


def test_state_hostkv_cannot_keep_at_page_ends_is_refused_saying_why():
    """Each state hostkv cannot serve fails start-up with a message naming what it saw."""
    # Prefix caching off ("none") keeps no state at block ends; "all" keeps it elsewhere.
    for mode in ("none", "all"):
        with pytest.raises(ValueError, match=rf"mamba_cache_mode 'align' \(prefix caching "
                                             rf"on\); KV-cache group MambaSpec \(GDN_ATTN\) "
                                             rf"\(layers .*linear_attn.*\) has '{mode}'"):
            _engine_kv(_qwen3_next_groups(state=_state_spec(mode=mode)))
    # A pure state-space model: no attention layer to lay a page out by.
    with pytest.raises(ValueError, match=r"has none, only MambaSpec \(GDN_ATTN\) \(a pure "
                                         r"state-space model\)"):
        _engine_kv([(_state_spec(), [_state_name(i) for i in range(4)])])
    # Speculative decoding's extra state blocks hold states that are not at page ends; and
    # ReplaySSM writes states back late.
    with pytest.raises(ValueError, match=r"with speculative decoding \(1 speculative state "
                                         r"blocks\)"):
        _engine_kv(_qwen3_next_groups(state=_state_spec(num_speculative_blocks=1)))
    with pytest.raises(ValueError, match=r"speculative decoding is not supported \(method "
                                         r"'mtp'\)"):
        _engine_kv(_qwen3_next_groups(), speculative_config=SimpleNamespace(method="mtp"))
    with pytest.raises(ValueError, match="with use_replayssm: vLLM writes its states back"):
        _engine_kv(_qwen3_next_groups(), cache_config=SimpleNamespace(use_replayssm=True))
    # vLLM rounds a state model's block up to hold a state, to sizes hostkv's pages cannot
    # take (Qwen3-Next-80B's is 544 on a GPU): the message names the block size to ask for.
    with pytest.raises(ValueError, match=r"vLLM's block size is 544: start vLLM with "
                                         r"--block-size 1024"):
        _engine_kv(_qwen3_next_groups(block=544))
    # The state kept every 32 tokens, the pages 16.
    with pytest.raises(ValueError, match="keeps it every 32 tokens, the attention layers' "
                                         "pages hold 16"):
        _engine_kv(_qwen3_next_groups(state=_state_spec(block=32)))
    # A slot is one layer's K/V of a page: 2 * 16 tokens * 4 heads * 8 * 4 bytes = 4096;
    # 1022 float32 are 4088 bytes and the marker 8 fill it exactly, 1023 do not fit.
    _engine_kv(_qwen3_next_groups(state=_state_spec(shapes=((1022,),),
                                                    dtypes=(torch.float32,))))
    with pytest.raises(ValueError, match=r"state \(4092 bytes on each of 1 rank\(s\), and a "
                                         r"marker each\) does not fit a page's slot of 4096"):
        _engine_kv(_qwen3_next_groups(state=_state_spec(shapes=((1023,),),
                                                        dtypes=(torch.float32,))))
    # With two ranks each slot holds two parts and two markers: 2 * (2040 + 8) fits...
    _engine_kv(_qwen3_next_groups(state=_state_spec(shapes=((510,),), dtypes=(torch.float32,)),
                                  heads=2), tp=2)
    # ... 2 * (2044 + 8) does not.
    with pytest.raises(ValueError, match=r"2044 bytes on each of 2 rank\(s\)"):
        _engine_kv(_qwen3_next_groups(state=_state_spec(shapes=((511,),),
                                                        dtypes=(torch.float32,)),
                                      heads=2), tp=2)


# -- the copies ----------------------------------------------------------------------------


def _states(seed):
    """One state layer's tensors in vLLM's form: per declared shape, [BLOCKS, *shape]."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, *shape, generator=g).to(dtype)
            for shape, dtype in zip(SHAPES, DTYPES)]


def _state_bytes(tensors, block):
    """A block's state as the page holds it: each tensor's bytes, in vLLM's order."""
    return b"".join(t[block].contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)


def _connector_view(tensors, stride=512):
    """The form vLLM 0.32 registers with a connector: one int8 tensor [blocks, 1, 1, state
    bytes] over its pool, each block ``stride`` bytes after the last (padding between)."""
    base = torch.full((BLOCKS, stride), 0x5A, dtype=torch.uint8)
    for block in range(BLOCKS):
        base[block, :RANK_BYTES] = torch.frombuffer(bytearray(_state_bytes(tensors, block)),
                                                    dtype=torch.uint8)
    return torch.as_strided(base.view(torch.int8), (BLOCKS, 1, 1, RANK_BYTES),
                            (stride, RANK_BYTES, RANK_BYTES, 1)), base


def _caches(kv, kv_tensors, states):
    """vLLM's per-layer caches: K/V tensors of the attention layers, states of the others."""
    caches = {}
    for layer, name in enumerate(kv.layer_names):
        caches[name] = states[layer] if layer in STATE_LAYERS else kv_tensors[layer]
    return caches


def _copies(cache, kv, caches, rank=0):
    from hostkv.vllm.groups import GroupCopies

    return GroupCopies(cache.pages_tensor(), kv, caches, heads=kv.heads_of_rank(rank)[:2],
                       writes=True, asynchronous=False, rank=rank)


def _slot(cache, layer, page):
    """A layer's slot of a page, as bytes."""
    pool = cache.pages_array()
    slot = pool.shape[1] // 4
    data = pool[page, layer * slot:(layer + 1) * slot].tobytes()
    del pool
    return data


def _fill(cache, value):
    pool = cache.pages_array()
    pool[:] = value
    del pool


@pytest.mark.parametrize("form", ["tensors", "connector-view"])
def test_state_and_kv_round_trip_through_a_page_with_exact_bytes(make_cache, form):
    """A save writes each attention layer's K/V and each state layer's state and marker
    into the page, and nothing else of the slot; a load puts the state back into the one
    non-null block of the state group, and every block it does not name stays as it was.
    Both forms vLLM hands a state layer's cache: its list of state tensors, and the int8
    view it registers with a connector (blocks padded apart)."""
    kv = _qwen3_next_kv()
    ref = reference_kv(layers=4, heads=4, dim=8)
    kv_tensors = [as_vllm(r) for r in ref]
    states = {layer: _states(seed=layer) for layer in STATE_LAYERS}
    if form == "connector-view":
        held = {layer: _connector_view(states[layer]) for layer in STATE_LAYERS}
        caches = _caches(kv, kv_tensors, {layer: held[layer][0] for layer in STATE_LAYERS})
    else:
        caches = _caches(kv, kv_tensors, states)
    cache = make_cache(kv.layout)
    _fill(cache, 0xAB)
    copies = _copies(cache, kv, caches)
    pages, state_blocks, full_blocks = [3, 5], [7, 2], [4, 9]
    transfer = copies.submit_save([state_blocks, full_blocks], pages)
    assert transfer.wait() and transfer.error is None
    pool = cache.pages_tensor().view(torch.float32).view(-1, 4, 2, BLOCK, 4, 8)
    for page, state_block, full_block in zip(pages, state_blocks, full_blocks):
        for layer in FULL_LAYERS:
            assert torch.equal(pool[page, layer], ref[layer][full_block])
        for layer in STATE_LAYERS:
            slot = _slot(cache, layer, page)
            assert slot[:RANK_BYTES] == _state_bytes(states[layer], state_block)
            assert slot[RANK_BYTES:RANK_BYTES + 8] == MARKER
            assert slot[RANK_BYTES + 8:] == b"\xab" * (4096 - RANK_BYTES - 8)
    # Pages the save did not name are untouched.
    assert _slot(cache, 0, 4) == b"\xab" * 4096
    # A load of both pages, the state only into the hit's last block (10); vLLM's null
    # block 0 names no state to copy.
    back_kv = [torch.zeros_like(t) for t in kv_tensors]
    back_states = {layer: [torch.zeros_like(t) for t in states[layer]]
                   for layer in STATE_LAYERS}
    if form == "connector-view":
        back_held = {layer: _connector_view(back_states[layer]) for layer in STATE_LAYERS}
        back = _caches(kv, back_kv, {layer: back_held[layer][0] for layer in STATE_LAYERS})
    else:
        back = _caches(kv, back_kv, back_states)
    loader = _copies(cache, kv, back)
    transfer = loader.submit_load(pages, [[0, 10], [1, 11]])
    assert transfer.wait() and transfer.error is None
    for layer in FULL_LAYERS:
        assert torch.equal(back_kv[layer][1], kv_tensors[layer][4])
        assert torch.equal(back_kv[layer][11], kv_tensors[layer][9])
        assert not back_kv[layer][[b for b in range(BLOCKS) if b not in (1, 11)]].any()
    for layer in STATE_LAYERS:
        for block in range(BLOCKS):
            if form == "connector-view":
                row = back_held[layer][1][block]
                got = row[:RANK_BYTES].numpy().tobytes()
                # The padding between blocks is vLLM's: never written.
                assert row[RANK_BYTES:].numpy().tobytes() == b"\x5a" * (512 - RANK_BYTES)
            else:
                got = _state_bytes(back_states[layer], block)
            want = _state_bytes(states[layer], 2) if block == 10 else bytes(RANK_BYTES)
            assert got == want, (layer, block)
    # Out of range: refused before anything moves.
    before = cache.pages_tensor().clone()
    with pytest.raises(ValueError, match=rf"state block {BLOCKS} or page 3 out of range "
                                         rf"\({BLOCKS} blocks, 10 pages\)"):
        copies.submit_save([[BLOCKS, 1], [4, 9]], [3, 5])
    assert torch.equal(cache.pages_tensor(), before)
    copies.close()
    loader.close()
    del copies, loader, pool, before


def test_several_state_groups_each_copy_their_layers_through_their_own_blocks(make_cache):
    """Three state layers of every four (Qwen3-Next's default, LFM2's kind): vLLM makes
    groups of equal size, so three state groups of one layer and one attention group, each
    with its own block table, and the layers at one position of every group share one
    buffer (block b of layer 0 is block b of layer 1). Each group's layer is saved from,
    and loaded into, the block its own table names, never another group's."""
    state = _state_spec()
    kv = _engine_kv([(state, [_state_name(0)]), (state, [_state_name(1)]),
                     (state, [_state_name(2)]), (_full_spec(), [_full_name(3)])])
    assert kv.state_groups == (0, 1, 2) and kv.layout.state_layers == (0, 1, 2)
    shared = _connector_view(_states(seed=7))          # one buffer, every state layer's
    ref = reference_kv(layers=4, heads=4, dim=8)
    caches = {_state_name(i): shared[0] for i in range(3)}
    caches[_full_name(3)] = as_vllm(ref[3])
    cache = make_cache(kv.layout)
    copies = _copies(cache, kv, caches)
    # One page; each group names another block of the shared buffer.
    transfer = copies.submit_save([[5], [9], [3], [4]], [2])
    assert transfer.wait() and transfer.error is None
    want = {0: 5, 1: 9, 2: 3}
    for layer, block in want.items():
        slot = _slot(cache, layer, 2)
        assert slot[:RANK_BYTES] == shared[1][block, :RANK_BYTES].numpy().tobytes(), layer
        assert slot[RANK_BYTES:RANK_BYTES + 8] == MARKER
    # Loaded into three other blocks of a fresh shared buffer, one per group.
    back = _connector_view([torch.zeros_like(t) for t in _states(seed=7)])
    back_caches = {_state_name(i): back[0] for i in range(3)}
    back_caches[_full_name(3)] = torch.zeros_like(caches[_full_name(3)])
    loader = _copies(cache, kv, back_caches)
    transfer = loader.submit_load([2], [[1], [6], [8], [0]])
    assert transfer.wait() and transfer.error is None
    for layer, (saved, loaded) in enumerate([(5, 1), (9, 6), (3, 8)]):
        assert (back[1][loaded, :RANK_BYTES].numpy().tobytes()
                == shared[1][saved, :RANK_BYTES].numpy().tobytes()), layer
    untouched = [b for b in range(BLOCKS) if b not in (1, 6, 8)]
    assert not back[1][untouched, :RANK_BYTES].any()
    copies.close()
    loader.close()
    del copies, loader


def test_a_save_without_state_clears_the_marker_a_page_had(make_cache):
    """A page saved again without a state (vLLM offered none for its end: null block)
    gets a zero marker, whatever the slot held: a stale marker would pass the old state for
    this page's. A load of it then fails the transfer and copies no state; a load that
    names no state block of it still succeeds."""
    hv = vllm_module()
    kv = _qwen3_next_kv()
    kv_tensors = [as_vllm(r) for r in reference_kv(layers=4, heads=4, dim=8)]
    states = {layer: _states(seed=layer) for layer in STATE_LAYERS}
    cache = make_cache(kv.layout)
    copies = _copies(cache, kv, _caches(kv, kv_tensors, states))
    assert copies.submit_save([[7], [4]], [3]).error is None
    assert all(_slot(cache, layer, 3)[RANK_BYTES:RANK_BYTES + 8] == MARKER
               for layer in STATE_LAYERS)
    # Saved anew (another prefix, after an eviction), without a state.
    assert copies.submit_save([[0], [5]], [3]).error is None
    for layer in STATE_LAYERS:
        slot = _slot(cache, layer, 3)
        assert slot[RANK_BYTES:RANK_BYTES + 8] == bytes(8)
        # The stale state stays in the slot; only the marker says it is not this page's.
        assert slot[:RANK_BYTES] == _state_bytes(states[layer], 7)
    pool = cache.pages_array()
    assert hv.state.pages_with_state(kv, pool, [3]) == 0
    del pool
    back_states = {layer: [torch.zeros_like(t) for t in states[layer]]
                   for layer in STATE_LAYERS}
    back_kv = [torch.zeros_like(t) for t in kv_tensors]
    loader = _copies(cache, kv, _caches(kv, back_kv, back_states))
    transfer = loader.submit_load([3], [[6], [8]])
    assert transfer.wait()
    assert isinstance(transfer.error, ValueError)
    assert str(transfer.error) == "hostkv: page 3 holds no state of rank 0"
    assert all(not t.any() for layer in STATE_LAYERS for t in back_states[layer])
    # Without a state block (a page before the hit's last) it loads its K/V.
    transfer = loader.submit_load([3], [[0], [8]])
    assert transfer.wait() and transfer.error is None
    assert torch.equal(back_kv[1][8], kv_tensors[1][5])
    copies.close()
    loader.close()
    del copies, loader


def test_two_ranks_write_disjoint_parts_and_a_page_has_state_once_both_did(make_cache):
    """Tensor parallelism 2: each rank's StateCopies writes its own part and marker of the
    same slot, never the other's; the scheduler sees the state only once every rank's
    marker is set, and each rank loads back its own part."""
    hv = vllm_module()
    kv = _qwen3_next_kv(tp=2)
    cache = make_cache(kv.layout)
    ref = reference_kv(layers=4, heads=4, dim=8)
    ranks = []
    for rank in (0, 1):
        first, stop, _ = kv.heads_of_rank(rank)
        kv_tensors = [as_vllm(r[:, :, :, first:stop]) for r in ref]
        states = {layer: _states(seed=10 * rank + layer) for layer in STATE_LAYERS}
        ranks.append((states, _copies(cache, kv, _caches(kv, kv_tensors, states), rank)))
    (states0, copies0), (states1, copies1) = ranks

    def with_state():
        pool = cache.pages_array()
        try:
            return hv.state.pages_with_state(kv, pool, [5])
        finally:
            del pool

    assert copies0.submit_save([[2], [4]], [5]).error is None
    assert with_state() == 0                              # rank 1's marker is missing
    for layer in STATE_LAYERS:
        slot = _slot(cache, layer, 5)
        assert slot[:RANK_BYTES] == _state_bytes(states0[layer], 2)
        assert slot[RANK_BYTES:2 * RANK_BYTES] == bytes(RANK_BYTES)
        assert slot[2 * RANK_BYTES:2 * RANK_BYTES + 16] == marker(0, 2) + bytes(8)
    assert copies1.submit_save([[7], [4]], [5]).error is None
    assert with_state() == 1
    for layer in STATE_LAYERS:
        slot = _slot(cache, layer, 5)
        assert slot[:RANK_BYTES] == _state_bytes(states0[layer], 2)   # rank 0's, kept
        assert slot[RANK_BYTES:2 * RANK_BYTES] == _state_bytes(states1[layer], 7)
        assert slot[2 * RANK_BYTES:2 * RANK_BYTES + 16] == marker(0, 2) + marker(1, 2)
        assert slot[2 * RANK_BYTES + 16:] == bytes(4096 - 2 * RANK_BYTES - 16)
    # The full-attention layers: rank 0 wrote heads 0-1, rank 1 heads 2-3.
    pool = cache.pages_tensor().view(torch.float32).view(-1, 4, 2, BLOCK, 4, 8)
    for layer in FULL_LAYERS:
        assert torch.equal(pool[5, layer], ref[layer][4])
    for rank, (states, copies) in enumerate(ranks):
        back = {layer: [torch.zeros_like(t) for t in states[layer]] for layer in STATE_LAYERS}
        first, stop, _ = kv.heads_of_rank(rank)
        back_kv = [torch.zeros_like(as_vllm(r[:, :, :, first:stop])) for r in ref]
        loader = _copies(cache, kv, _caches(kv, back_kv, back), rank)
        assert loader.submit_load([5], [[3], [3]]).error is None
        for layer in STATE_LAYERS:
            assert _state_bytes(back[layer], 3) == _state_bytes(states[layer],
                                                                2 if rank == 0 else 7)
        loader.close()
    # Rank 1 saves the page anew without a state: the page has none, for either rank.
    assert copies1.submit_save([[0], [4]], [5]).error is None
    assert with_state() == 0
    copies0.close()
    copies1.close()
    del ranks, copies0, copies1, loader, pool


def test_state_tensors_other_than_the_spec_declared_are_refused(make_cache):
    """A state layer's tensors that are not what the spec declared (shape, type, a block's
    bytes not contiguous, another byte count in the connector's view) fail start-up."""
    kv = _qwen3_next_kv()
    kv_tensors = [as_vllm(r) for r in reference_kv(layers=4, heads=4, dim=8)]
    cache = make_cache(kv.layout)
    good = _states(seed=0)
    bad = {
        "shape": [torch.zeros(BLOCKS, 3, 21), good[1]],
        "dtype": [good[0], good[1].float()],
        "strided": [torch.zeros(BLOCKS, 20, 3).transpose(1, 2), good[1]],
        "view bytes": [torch.zeros(BLOCKS, 1, 1, RANK_BYTES + 8, dtype=torch.int8)],
    }
    for what, tensors in bad.items():
        caches = _caches(kv, kv_tensors, {0: tensors, 2: good})
        with pytest.raises(ValueError, match=rf"state layer {_state_name(0)}'s tensors are"):
            _copies(cache, kv, caches)
        del caches


# -- the protocol's pure functions ---------------------------------------------------------


def _marker_at(kv, page_bytes, layer, rank):
    """A rank's marker's offset in a page (the format: slot of the layer, every rank's
    part, then the markers in rank order; the part's size is pinned by the first test)."""
    state = kv.groups[kv.state_groups[0]].state
    return (layer * (page_bytes // kv.layout.num_layers) + state.tp_world * state.rank_bytes
            + 8 * rank)


def _set_marker(pool, kv, page, layers=STATE_LAYERS, ranks=None, value=None):
    for layer in layers:
        for rank in ranks if ranks is not None else range(kv.tp_world):
            at = _marker_at(kv, pool.shape[1], layer, rank)
            mark = value if value is not None else marker(rank, kv.tp_world)
            pool[page, at:at + 8] = np.frombuffer(mark, dtype=np.uint8)


def test_pages_with_state_walks_back_to_the_last_page_with_every_marker():
    """The longest prefix ending at a page whose every state layer has every rank's
    marker: a page with one layer's (or one rank's) marker only does not count."""
    hv = vllm_module()
    pages_with_state = hv.state.pages_with_state
    for tp in (1, 2):
        kv = _qwen3_next_kv(tp=tp)
        pool = np.zeros((10, kv.layout.page_bytes(BLOCK)), dtype=np.uint8)
        prefix = [4, 1, 7, 2, 9]
        assert pages_with_state(kv, pool, prefix) == 0
        _set_marker(pool, kv, 1)
        assert pages_with_state(kv, pool, prefix) == 2
        _set_marker(pool, kv, 2)
        assert pages_with_state(kv, pool, prefix) == 4
        _set_marker(pool, kv, 9, layers=(2,))                  # layer 0's missing
        assert pages_with_state(kv, pool, prefix) == 4
        if tp == 2:
            _set_marker(pool, kv, 9, layers=(0,), ranks=(1,))  # rank 0's of layer 0 missing
            assert pages_with_state(kv, pool, prefix) == 4
        _set_marker(pool, kv, 9, layers=(0,))
        assert pages_with_state(kv, pool, prefix) == 5
        # One wrong byte of one marker.
        _set_marker(pool, kv, 9, layers=(2,), ranks=(tp - 1,),
                    value=marker(tp - 1, tp)[:5] + b"\x01" + marker(tp - 1, tp)[6:])
        assert pages_with_state(kv, pool, prefix) == 4
        # A marker of another rank, or of another degree, where this one's goes.
        _set_marker(pool, kv, 9, layers=(2,), ranks=(tp - 1,), value=marker(tp, tp))
        assert pages_with_state(kv, pool, prefix) == 4
        _set_marker(pool, kv, 9, layers=(2,), ranks=(tp - 1,), value=marker(tp - 1, tp + 1))
        assert pages_with_state(kv, pool, prefix) == 4
        assert pages_with_state(kv, pool, prefix[:1]) == 0
        assert pages_with_state(kv, pool, []) == 0
    # A model without state: every page is a place to end a hit.
    attention_only = _engine_kv([(_full_spec(), [_full_name(i) for i in range(4)])])
    assert pages_with_state(attention_only, np.zeros((10, 4 * 4096), np.uint8), [3, 4]) == 2


def test_saves_take_offered_boundary_blocks_and_loads_only_the_last_block():
    """A save's state blocks: for each page, the block vLLM offered for its end (the
    boundary (page + 1) * page_size, in that group), else the null block. A load's: the null
    block but for the hit's last page, whose block vLLM reads a hit's state from."""
    hv = vllm_module()
    offered = hv.state.offered_state_blocks
    offers = [(0, 11, 32), (0, 12, 64), (1, 99, 48), (0, 13, 40), (0, 14, 16)]
    assert offered(offers, 0, 16, 1, 4) == [11, 0, 12]     # pages 1-3 end at 32, 48, 64
    assert offered(offers, 1, 16, 1, 4) == [0, 99, 0]
    assert offered(offers, 0, 16, 0, 1) == [14]
    assert offered(offers, 0, 8, 3, 6) == [11, 13, 0]      # ends 32, 40, 48
    assert offered([], 0, 16, 0, 3) == [0, 0, 0]
    assert offered(offers, 0, 16, 2, 2) == []
    to_load = hv.state.state_blocks_to_load
    table = [0, 0, 0, 8, 5]
    assert to_load(table, 1, 4) == [0, 0, 8]
    assert to_load(table, 0, 5) == [0, 0, 0, 0, 5]
    assert to_load(table, 3, 4) == [8]
    assert to_load(table, 2, 2) == []


# -- the scheduler side --------------------------------------------------------------------

SCHED_BLOCK = BLOCK_SIZE                          # vllm_request hashes blocks of this size
SCHED_SHAPES = ((3, 64), (2, 16, 16))


def _sched_groups():
    return _qwen3_next_groups(
        state=_state_spec(block=SCHED_BLOCK, shapes=SCHED_SHAPES,
                          dtypes=(torch.float32, torch.float32)),
        block=SCHED_BLOCK, heads=2, dim=64)


def _state_scheduler(hv, segment):
    """The scheduler side of a Qwen3-Next-like engine, as the connector builds it."""
    kv = _engine_kv(_sched_groups(), total_heads=2)
    settings = hv.HostKVSettings(segment=segment, num_pages=64, async_saves=False)
    cache = hv.open_segment(settings, kv.layout, SCHED_BLOCK)
    return kv, hv.scheduler.SchedulerSide(
        cache, settings, SCHED_BLOCK, b"model", hv.metrics.Failures(), hv.metrics.Counters(),
        tp_world=kv.tp_world, windowed_groups=kv.windowed_groups,
        async_loads=kv.loads_asynchronously, kv=kv)


def _state_manager(num_blocks=64):
    """vLLM's own KVCacheManager over the state group and the full-attention group."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    return KVCacheManager(_kv_cache_config(_sched_groups(), num_blocks=num_blocks),
                          max_model_len=4096, scheduler_block_size=SCHED_BLOCK,
                          hash_block_size=SCHED_BLOCK)


def _cache_prefix(hv, sched, tokens):
    """Commits pages of tokens in the scheduler's namespace (their slots all zeros: no
    state), returning the pages."""
    namespace = hv.scheduler._namespace(b"model", None, None)
    with hostkv.WorkerView(sched.cache) as view:
        view.allocate_pages_for_sequences_with_prefix(
            [hostkv.SequenceRequest(1, tokens, namespace)])
        view.release([1])
    return sched.cache.match_prefix(tokens, namespace).pages.tolist()


def _mark(kv, cache, page, **where):
    pool = cache.pages_array()
    try:
        _set_marker(pool, kv, page, **where)
    finally:
        del pool


def _hit(hv, sched, manager, request, offered):
    """vLLM's admission of a request with an asynchronous hostkv hit: blocks for the
    external tokens only, then update_state_after_alloc."""
    assert manager.allocate_slots(request, 0, num_external_computed_tokens=offered,
                                  delay_cache_blocks=True) is not None
    sched.update_state_after_alloc(request, manager.get_blocks(request.request_id), offered)
    return [list(group) for group in manager.get_block_ids(request.request_id)]


def test_a_hit_ends_at_the_last_page_with_state_and_loads_it_into_the_last_block(
        segment_name):
    """Six pages match, with the state only after pages 1 and 3 (page 5 has one layer's
    marker only): the hit is cut back to four pages. vLLM allocates a state block for the
    hit's last block only; the load names it there and the null block before, and the
    full-attention group's blocks as usual."""
    hv = vllm_module()
    from vllm.v1.core.sched.output import SchedulerOutput

    kv, sched = _state_scheduler(hv, segment_name)
    manager = _state_manager()
    sched.kv_cache_manager = manager
    try:
        rng = np.random.default_rng(5)
        history = rng.integers(1, 1000, 6 * SCHED_BLOCK + 8).tolist()
        pages = _cache_prefix(hv, sched, history)
        assert len(pages) == 6
        request = vllm_request("r1", history + rng.integers(1, 1000, 60).tolist())
        # No page with the state: a miss, whatever matched.
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        _mark(kv, sched.cache, pages[1])
        _mark(kv, sched.cache, pages[3])
        _mark(kv, sched.cache, pages[5], layers=(0,))
        assert sched.get_num_new_matched_tokens(request, 0) == (4 * SCHED_BLOCK, True)
        tables = _hit(hv, sched, manager, request, 4 * SCHED_BLOCK)
        assert tables[0][:3] == [0, 0, 0] and tables[0][3] != 0
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert meta.recv_failed == [] and meta.bad_blocks == []
        assert meta.loads == [("r1", pages[:4], [[0, 0, 0, tables[0][3]], tables[1][:4]])]
        sched.request_finished(request)
        sched.cache.check()
    finally:
        sched.shutdown()


def test_a_hit_whose_last_page_lost_its_state_before_borrow_fails_whole(segment_name):
    """Between lookup and borrow the hit's last page was evicted and saved anew without a
    state (its marker zeroed). Held now, it is read again: the request's asynchronous load
    is reported failed, nothing is loaded, and the request is offered no hit again (vLLM
    computes it from its first token)."""
    hv = vllm_module()
    from vllm.v1.core.sched.output import SchedulerOutput

    kv, sched = _state_scheduler(hv, segment_name)
    manager = _state_manager()
    sched.kv_cache_manager = manager
    try:
        rng = np.random.default_rng(6)
        history = rng.integers(1, 1000, 6 * SCHED_BLOCK + 8).tolist()
        pages = _cache_prefix(hv, sched, history)
        for page in pages:
            _mark(kv, sched.cache, page)
        request = vllm_request("r1", history + rng.integers(1, 1000, 60).tolist())
        assert sched.get_num_new_matched_tokens(request, 0) == (6 * SCHED_BLOCK, True)
        _mark(kv, sched.cache, pages[5], layers=(2,), value=bytes(8))
        _hit(hv, sched, manager, request, 6 * SCHED_BLOCK)
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert meta.recv_failed == ["r1"] and meta.loads == [] and meta.bad_blocks == []
        manager.free(request)
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        sched.request_finished(request)
        # Another request, same prefix: the hit ends at page 4, the last with its state.
        other = vllm_request("r2", history + rng.integers(1, 1000, 9).tolist())
        assert sched.get_num_new_matched_tokens(other, 0) == (5 * SCHED_BLOCK, True)
        sched.request_finished(other)
        sched.cache.check()
    finally:
        sched.shutdown()


def _tables(state, full):
    """vLLM's KVCacheBlocks of the state group's and the full-attention group's blocks."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks((tuple(KVCacheBlock(b) for b in state),
                          tuple(KVCacheBlock(b) for b in full)))


@pytest.mark.parametrize("state_table", [[0] * 7 + [9], [4, 5, 6, 7, 8, 9, 10, 11]],
                         ids=["null-at-the-hit-end", "no-null-blocks"])
def test_state_tables_other_than_vllm_032s_load_only_the_hit_end(segment_name, state_table):
    """Tables vLLM 0.32's manager does not hand today, which hostkv must not trip on. A
    state table with the null block at the hit's last position: nowhere to load the state
    into, so the load is reported failed rather than loading K/V without it. A table with a
    block at every position: only the hit's last is loaded (the pages before it hold no
    state: a load of them would fail)."""
    hv = vllm_module()
    from vllm.v1.core.sched.output import SchedulerOutput

    kv, sched = _state_scheduler(hv, segment_name)
    try:
        rng = np.random.default_rng(7)
        history = rng.integers(1, 1000, 4 * SCHED_BLOCK).tolist()
        pages = _cache_prefix(hv, sched, history)
        _mark(kv, sched.cache, pages[3])
        request = vllm_request("r1", history + rng.integers(1, 1000, 100).tolist())
        assert sched.get_num_new_matched_tokens(request, 0) == (4 * SCHED_BLOCK, True)
        full = list(range(20, 28))
        sched.update_state_after_alloc(request, _tables(state_table, full), 4 * SCHED_BLOCK)
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert meta.bad_blocks == []
        if state_table[3] == 0:
            assert meta.recv_failed == ["r1"] and meta.loads == []
        else:
            assert meta.recv_failed == []
            assert meta.loads == [("r1", pages, [[0, 0, 0, 7], full[:4]])]
        sched.request_finished(request)
        sched.cache.check()
    finally:
        sched.shutdown()


def test_saves_take_only_the_blocks_vllm_offered_never_the_table(segment_name):
    """The state block of a page end is the one vLLM offered for that boundary, which need
    not be in the table (vLLM offers the copy-on-write copy of a partial-tail state); a
    table's block at a page's position without an offer holds some other token's state:
    the page is saved without one."""
    hv = vllm_module()
    from vllm.v1.core.sched.output import (KVConnectorBlockState, NewRequestData,
                                           SchedulerOutput)

    kv, sched = _state_scheduler(hv, segment_name)
    try:
        rng = np.random.default_rng(9)
        request = vllm_request("r1", rng.integers(1, 1000, 3 * SCHED_BLOCK + 5).tolist())
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        state, full = [30, 31, 32, 33], [40, 41, 42, 43]
        sched.update_state_after_alloc(request, _tables(state, full), 0)
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = [NewRequestData.from_request(request, (state, full))]
        out.num_scheduled_tokens = {"r1": request.num_tokens}
        out.kv_connector_block_state = KVConnectorBlockState(
            req_ids={"r1"}, resolve_block_ids=lambda req_id: (state, full),
            boundary_state_offloads={"r1": [(0, 44, 96), (1, 45, 64)]})
        meta = sched.build_connector_meta(out)
        [(req_id, blocks, pages)] = meta.saves
        assert req_id == "r1" and len(pages) == 3
        assert blocks == [[0, 0, 44], full[:3]]
        sched.request_finished(request)
        sched.cache.check()
    finally:
        sched.shutdown()


def _block_state(manager, offers):
    from vllm.v1.core.sched.output import KVConnectorBlockState

    return KVConnectorBlockState(req_ids=set(offers), resolve_block_ids=manager.get_block_ids,
                                 boundary_state_offloads=offers)


def test_saves_take_the_blocks_vllm_offered_and_a_later_request_loads_them(segment_name):
    """A prompt of three pages and a bit, prefilled in two chunks (64, then 32 tokens) as
    vLLM's aligned split does. Each step's saves take, per page, the state block vLLM's
    own manager offered for the page's end in that step (page 0: none, the null block);
    a worker copies them; once confirmed, another request's lookup ends at page 2, the last
    with the state, and its load puts exactly that state into its own last block."""
    hv = vllm_module()
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    kv, sched = _state_scheduler(hv, segment_name)
    manager = _state_manager()
    sched.kv_cache_manager = manager
    # The worker: vLLM's tensors of 64 blocks, in the scheduler's segment.
    g = torch.Generator().manual_seed(3)
    kv_tensors = [torch.randn(64, 2, SCHED_BLOCK, 128, generator=g) for _ in range(4)]
    states = {layer: [torch.randn(64, *shape, generator=g) for shape in SCHED_SHAPES]
              for layer in STATE_LAYERS}
    worker = _copies(sched.cache, kv, _caches(kv, kv_tensors, states))
    loader = None
    try:
        rng = np.random.default_rng(8)
        request = vllm_request("r1", rng.integers(1, 1000, 3 * SCHED_BLOCK + 5).tolist())
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        # Step 1: the first 64 tokens.
        assert manager.allocate_slots(request, 64) is not None
        sched.update_state_after_alloc(request, manager.get_blocks("r1"), 0)
        tables = [list(group) for group in manager.get_block_ids("r1")]
        offers = manager.take_boundary_state_offloads()
        assert offers == {"r1": [(0, tables[0][1], 64)]}
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = [NewRequestData.from_request(request, tuple(tables))]
        out.num_scheduled_tokens = {"r1": 64}
        # An offer for another request changes nothing of this one's saves.
        out.kv_connector_block_state = _block_state(manager, {**offers, "r9": [(0, 5, 32)]})
        meta1 = sched.build_connector_meta(out)
        [(req_id, blocks1, pages1)] = meta1.saves
        assert req_id == "r1" and len(pages1) == 2
        assert blocks1 == [[0, tables[0][1]], tables[1][:2]]
        # Step 2: 32 more tokens, to the prompt's last whole block.
        request.num_computed_tokens = 64
        added = manager.allocate_slots(request, 32).get_block_ids()
        offers = manager.take_boundary_state_offloads()
        assert offers == {"r1": [(0, added[0][0], 96)]}
        cached = CachedRequestData.make_empty()
        cached.req_ids = ["r1"]
        cached.new_block_ids = [tuple(list(group) for group in added)]
        cached.num_computed_tokens = [64]
        out = SchedulerOutput.make_empty()
        out.scheduled_cached_reqs = cached
        out.num_scheduled_tokens = {"r1": 32}
        out.kv_connector_block_state = _block_state(manager, offers)
        meta2 = sched.build_connector_meta(out)
        [(req_id, blocks2, pages2)] = meta2.saves
        assert req_id == "r1" and blocks2 == [[added[0][0]], [added[1][0]]]
        # The worker runs both steps' saves and confirms them.
        for meta in (meta1, meta2):
            for _, blocks, pages in meta.saves:
                assert worker.submit_save(blocks, pages).error is None
        sched.update_connector_output(KVConnectorOutput(
            kv_connector_worker_meta=hv.HostKVWorkerMetadata(
                done=[(meta1.step, 0, []), (meta2.step, 0, [])])))
        assert sched.counters.values["committed_pages"] == 3
        pages = pages1 + pages2
        for layer in STATE_LAYERS:
            slots = [_slot(sched.cache, layer, page) for page in pages]
            assert [slot[2816:2824] for slot in slots] == [bytes(8), MARKER, MARKER]
            assert slots[1][:2816] == _state_bytes(states[layer], tables[0][1])
            assert slots[2][:2816] == _state_bytes(states[layer], added[0][0])
        # Another request with the same three pages: its hit ends at page 2.
        other = vllm_request("r2", request.all_token_ids[:96] + rng.integers(1, 1000,
                                                                             40).tolist())
        assert sched.get_num_new_matched_tokens(other, 0) == (96, True)
        other_tables = _hit(hv, sched, manager, other, 96)
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        last = other_tables[0][2]
        assert meta.loads == [("r2", pages, [[0, 0, last], other_tables[1][:3]])]
        # Another engine's worker loads it into blocks of its own.
        back_kv = [torch.zeros_like(t) for t in kv_tensors]
        back = {layer: [torch.zeros_like(t) for t in states[layer]] for layer in STATE_LAYERS}
        loader = _copies(sched.cache, kv, _caches(kv, back_kv, back))
        [(_, load_pages, load_blocks)] = meta.loads
        assert loader.submit_load(load_pages, load_blocks).error is None
        for layer in STATE_LAYERS:
            for block in range(64):
                want = (_state_bytes(states[layer], added[0][0]) if block == last
                        else bytes(2816))
                assert _state_bytes(back[layer], block) == want, (layer, block)
        for layer in FULL_LAYERS:
            for i, block in enumerate(other_tables[1][:3]):
                source = (tables[1][:2] + [added[1][0]])[i]
                assert torch.equal(back_kv[layer][block], kv_tensors[layer][source])
        sched.request_finished(request)
        sched.request_finished(other)
        sched.cache.check()
    finally:
        worker.close()
        if loader is not None:
            loader.close()
        del worker, loader
        sched.shutdown()


def test_pages_a_hit_is_cut_back_from_are_not_reported_removed(segment_name):
    """This engine saved three pages (vLLM offered no state for page 2's end); a later
    lookup ends its hit at page 1, the last with the state. Page 2 is still cached, and a
    longer prompt may still take it inside a hit: no BlockRemoved event may say it left
    (a KV-aware router would stop sending its prefix here). Once it is evicted, it is."""
    hv = vllm_module()
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    kv, sched = _state_scheduler(hv, segment_name)
    try:
        rng = np.random.default_rng(10)
        request = vllm_request("r1", rng.integers(1, 1000, 3 * SCHED_BLOCK + 5).tolist())
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        state, full = [0, 0, 0, 33], [40, 41, 42, 43]
        sched.update_state_after_alloc(request, _tables(state, full), 0)
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = [NewRequestData.from_request(request, (state, full))]
        out.num_scheduled_tokens = {"r1": request.num_tokens}
        meta = sched.build_connector_meta(out)
        [(_, _, pages)] = meta.saves
        sched.update_connector_output(KVConnectorOutput(
            kv_connector_worker_meta=hv.HostKVWorkerMetadata(done=[(meta.step, 0, [])])))
        stored = [h for e in sched.take_events() if type(e).__name__ == "BlockStored"
                  for h in e.block_hashes]
        assert stored == [maybe_convert_block_hash(h) for h in request.block_hashes[:3]]
        _mark(kv, sched.cache, pages[1])
        other = vllm_request("r2", request.all_token_ids[:96] + rng.integers(1, 1000,
                                                                             40).tolist())
        assert sched.get_num_new_matched_tokens(other, 0) == (64, True)
        assert [e for e in sched.take_events() if type(e).__name__ == "BlockRemoved"] == []
        sched.request_finished(other)
        sched.request_finished(request)
        sched.cache.evict(64)
        again = vllm_request("r3", request.all_token_ids)
        assert sched.get_num_new_matched_tokens(again, 0) == (0, False)
        removed = [h for e in sched.take_events() if type(e).__name__ == "BlockRemoved"
                   for h in e.block_hashes]
        assert removed == stored
        sched.request_finished(again)
        sched.cache.check()
    finally:
        sched.shutdown()


def test_the_state_bench_copies_a_step_of_states_beside_a_plain_copy():
    """`python -m hostkv.vllm.state_bench`'s small shape, two rounds: every save and load
    through StateCopies succeeds (it asserts so) and the report counts the step's bytes."""
    import warnings

    vllm_module()
    from hostkv.vllm import state_bench

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # vLLM's Mamba modules' deprecations on import
        result = state_bench.measure("tiny", rounds=2)
    # vLLM's GDN state of 2 heads of 64 at TP=1: a conv state of 384 channels x 3 and a
    # 2 x 64 x 64 recurrent state, bfloat16.
    assert result["layer_bytes"] == (384 * 3 + 2 * 64 * 64) * 2
    assert result["bytes"] == 8 * 3 * result["layer_bytes"]
    assert result["copies"] == 8 * 3 * 2
    assert set(result["gbps"]) == {"save", "load", "plain"}
    assert all(rate > 0 for rate in result["gbps"].values())
    assert "tiny: 8 pages x 3 state layers" in state_bench.report(result)


# -- whole states, shared by every tensor-parallel degree ----------------------------------

# A tiny Gated DeltaNet's whole state: 2 key heads and 4 value heads of 8, a kernel of 4.
GDN_KEY_HEADS, GDN_VALUE_HEADS, GDN_DIM, GDN_KERNEL = 2, 4, 8, 4
GDN_CHANNELS = 2 * GDN_KEY_HEADS * GDN_DIM + GDN_VALUE_HEADS * GDN_DIM


def _gdn_whole(seed, conv_dim_first):
    """A block's whole GDN state as one engine holds it: the convolution's channels
    (queries, keys, values) beside its kernel - 1 columns, and the value heads' states."""
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(GDN_CHANNELS, GDN_KERNEL - 1, generator=g).to(torch.bfloat16)
    return [conv if conv_dim_first else conv.t().contiguous(),
            torch.randn(GDN_VALUE_HEADS, GDN_DIM, GDN_DIM, generator=g)]


def _gdn_shard(whole, rank, tp, conv_dim_first):
    """A rank's share, as vLLM shards the weights that make it: each of the queries',
    keys' and values' channels split in tp pieces (mamba_v2_sharded_weight_loader), the
    value heads evenly."""
    conv, ssm = whole
    channels = conv if conv_dim_first else conv.t()
    keys, values = GDN_KEY_HEADS * GDN_DIM, GDN_VALUE_HEADS * GDN_DIM
    parts = [channels[:keys], channels[keys:2 * keys], channels[2 * keys:]]
    mine = torch.cat([p[rank * p.shape[0] // tp:(rank + 1) * p.shape[0] // tp] for p in parts])
    heads = GDN_VALUE_HEADS // tp
    return [(mine if conv_dim_first else mine.t()).contiguous(),
            ssm[rank * heads:(rank + 1) * heads].contiguous()]


def _gdn_kv(tp, conv_dim_first, architecture="Qwen3NextForCausalLM"):
    """An EngineKV of a state layer (0) and a full-attention layer (1), as engine_kv reads
    a Qwen3-Next at TP degree ``tp``."""
    from hostkv.config import KVLayout
    from hostkv.copy_engine import VLLM
    from hostkv.vllm.layout import EngineKV, KVGroup, StateLayout, state_splits

    vllm_module()
    shard = _gdn_shard(_gdn_whole(0, conv_dim_first), 0, tp, conv_dim_first)
    shapes = tuple(tuple(t.shape) for t in shard)
    state = StateLayout(shapes=shapes, dtypes=("bfloat16", "float32"), itemsizes=(2, 4),
                        tp_world=tp, kind="MambaSpec (GDN_ATTN)",
                        splits=state_splits("GDN_ATTN", (architecture,), shapes,
                                            conv_dim_first))
    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=4, head_dim=32, dtype="float32",
                             state_layers=(0,))
    return EngineKV(layout, 16, ("model.layers.0.linear_attn", "model.layers.1.attn"), VLLM,
                    tp, "test", (KVGroup("state", (0,), state=state),
                                 KVGroup("full", (1,))))


def _gdn_blocks(whole_by_block, rank, tp, conv_dim_first):
    """A rank's state tensors [blocks, *shape] holding each block's share."""
    shards = [_gdn_shard(w, rank, tp, conv_dim_first) for w in whole_by_block]
    return [torch.stack([s[i] for s in shards]) for i in range(2)]


def test_state_splits_are_known_only_for_models_whose_sharding_hostkv_checked():
    """Qwen3-Next's GDN state splits in three channel parts and even heads; LFM2's short
    convolution in one part; any other architecture or kind, or shapes that do not add
    up, is kept per degree (None)."""
    vllm_module()
    from hostkv.vllm.layout import state_splits

    qwen = ("Qwen3NextForCausalLM",)
    # Per rank at TP=2: 32 channels (8 queries, 8 keys, 16 values), 2 value heads.
    no, three = (False,), (False,) * 3
    assert state_splits("GDN_ATTN", qwen, ((3, 32), (2, 8, 8)), False) == (
        (1, (8, 8, 16), three), (0, (2,), no))
    assert state_splits("GDN_ATTN", qwen, ((32, 3), (2, 8, 8)), True) == (
        (0, (8, 8, 16), three), (0, (2,), no))
    for lfm2 in ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM"):
        assert state_splits("SHORT_CONV", (lfm2,), ((3, 128),), False) == ((1, (128,), no),)
    assert state_splits("GDN_ATTN", ("BailingMoeV3ForCausalLM",), ((3, 32), (2, 8, 8)),
                        False) is None
    assert state_splits("MAMBA2", qwen, ((3, 32), (2, 8, 8)), False) is None
    # Mamba-2 (vLLM's MambaMixer2) per rank at TP=2: x of 2 heads of 8, then B and C of
    # 16 each: a share of 8 groups of state size 4, or a copy of one group of 16.
    granite = ("GraniteMoeHybridForCausalLM",)
    assert state_splits("MAMBA2", granite, ((3, 48), (2, 8, 4)), False, False, 8, 2) == (
        (1, (16, 16, 16), three), (0, (2,), no))
    assert state_splits("MAMBA2", ("NemotronHForCausalLM",), ((48, 3), (2, 8, 4)), True,
                        False, 8, 2) == ((0, (16, 16, 16), three), (0, (2,), no))
    assert state_splits("MAMBA2", granite, ((3, 48), (2, 8, 16)), False, False, 1, 2) == (
        (1, (16, 16, 16), (False, True, True)), (0, (2,), no))
    assert state_splits("MAMBA2", ("Zamba2ForCausalLM",), ((3, 48), (2, 8, 4)), False,
                        False, 8, 2) == ((1, (16, 16, 16), three), (0, (2,), no))
    # A number of groups the config does not give, one vLLM refuses (2 at TP=4), or shapes
    # that do not add up to the config's: kept per degree.
    assert state_splits("MAMBA2", granite, ((3, 48), (2, 8, 4)), False, False, None, 2) is None
    assert state_splits("MAMBA2", granite, ((3, 40), (1, 8, 4)), False, False, 2, 4) is None
    assert state_splits("MAMBA2", granite, ((3, 48), (2, 8, 4)), False, False, 1, 2) is None
    assert state_splits("MAMBA2", granite, ((3, 48), (2, 8, 4)), False, False, 4, 2) is None
    assert state_splits("GDN_ATTN", qwen, ((3, 33), (2, 8, 8)), False) is None
    assert state_splits("GDN_ATTN", qwen, ((3, 16), (2, 8, 8)), False) is None


def test_a_mamba2_models_groups_are_read_where_its_architecture_keeps_them():
    """Granite-4.0-H and Falcon-H1 give their number of groups as mamba_n_groups,
    Nemotron-H as n_groups, Zamba2 as mamba_ngroups; any other architecture, or no
    positive number there, is None."""
    vllm_module()
    from types import SimpleNamespace

    from hostkv.vllm.layout import mamba2_groups

    def engine(architecture, **hf):
        return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(
            architectures=[architecture], **hf)))

    assert mamba2_groups(engine("GraniteMoeHybridForCausalLM", mamba_n_groups=1)) == 1
    assert mamba2_groups(engine("FalconH1ForCausalLM", mamba_n_groups=2, n_groups=4)) == 2
    assert mamba2_groups(engine("NemotronHForCausalLM", n_groups=8, mamba_n_groups=1)) == 8
    assert mamba2_groups(engine("NemotronHForCausalLM", mamba_n_groups=8)) is None
    assert mamba2_groups(engine("Zamba2ForCausalLM", mamba_ngroups=2, n_groups=4)) == 2
    assert mamba2_groups(engine("GraniteMoeHybridForCausalLM", mamba_n_groups=0)) is None
    assert mamba2_groups(engine("BambaForCausalLM", mamba_n_groups=1)) is None


@pytest.mark.parametrize("conv_dim_first", [False, True], ids=["SD", "DS"])
def test_every_degree_writes_the_same_whole_state_and_reads_its_share(conv_dim_first):
    """The runs of a degree's ranks cover the slot's state exactly once, and put every
    byte where an engine of TP=1 puts it: ranks of TP=2 and TP=4 save a state a TP=1 engine
    loads whole, and a TP=1 engine's save loads into each rank of TP=2 and TP=4 as that
    rank's share. The slot's bytes are the same whatever the degree that wrote them."""
    from hostkv.vllm.state import StateCopies

    wholes = [_gdn_whole(seed, conv_dim_first) for seed in range(4)]   # block 0: null
    written = {}
    for tp in (1, 2, 4):
        kv = _gdn_kv(tp, conv_dim_first)
        state = kv.groups[0].state
        assert state.canonical
        # Each rank's runs, together, are the state's bytes, once.
        covered = sorted((at, size) for r in range(tp) for _, at, size in state.runs(r))
        assert sum(size for _, size in covered) == state.data_bytes
        assert all(a + n <= b for (a, n), (b, _) in zip(covered, covered[1:]))
        pool = torch.zeros(6, kv.layout.page_bytes(16), dtype=torch.uint8)
        for rank in range(tp):
            tensors = _gdn_blocks(wholes, rank, tp, conv_dim_first)
            copies = StateCopies(pool, kv, {kv.layer_names[0]: tensors}, rank, 0)
            assert copies.save([1, 2, 0], [3, 4, 5]).error is None
        slot = kv.layout.page_bytes(16) // 2
        written[tp] = pool[3:5, :state.data_bytes].clone()
        assert torch.equal(pool[3:5, state.marker(0):state.marker(0) + 8 * tp],
                           torch.tensor([list(b"".join(marker(r, tp) for r in range(tp)))] * 2,
                                        dtype=torch.uint8))
        assert not pool[5, :slot].any()                         # the null block: no marker
        # Every degree reads its shares of every degree's save.
        for reader in (1, 2, 4):
            kv_r = _gdn_kv(reader, conv_dim_first)
            for rank in range(reader):
                back = [torch.zeros_like(t) for t in _gdn_blocks(wholes, rank, reader,
                                                                   conv_dim_first)]
                copies = StateCopies(pool, kv_r, {kv_r.layer_names[0]: back}, rank, 0)
                assert copies.load([3, 4], [2, 1]).error is None
                want = _gdn_blocks(wholes, rank, reader, conv_dim_first)
                for got, expected in zip(back, want):
                    assert torch.equal(got[2], expected[1]), (tp, reader, rank)
                    assert torch.equal(got[1], expected[2]), (tp, reader, rank)
                # The page saved without a state loads nothing.
                assert isinstance(copies.load([5], [3]).error, ValueError)
    assert torch.equal(written[1], written[2]) and torch.equal(written[1], written[4])


# A tiny Mamba-2: 4 heads of 8, groups of state size 4, a kernel of 4.
M2_HEADS, M2_DIM, M2_STATE, M2_KERNEL = 4, 8, 4, 4


def _mamba2_rank_channels(groups, rank, tp):
    """Which of the whole convolution's channels (x, then the groups' B, then C) a rank
    holds, in its order, as vLLM 0.32 loads them: its own weight loader
    (mamba_v2_sharded_weight_loader with MambaMixer2's shard settings) applied to the
    channels' indices."""
    from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    x = M2_HEADS * M2_DIM
    extra = MambaStateShapeCalculator.extra_groups_for_head_shards(groups, tp)
    group_channels = (groups + extra) * M2_STATE
    settings = (group_channels, extra * M2_STATE, groups == 1)
    param = torch.full(((x + 2 * group_channels) // tp,), -1.0, dtype=torch.float64)
    loader = mamba_v2_sharded_weight_loader([(x, 0, False), settings, settings], tp, rank)
    loader(param, torch.arange(x + 2 * groups * M2_STATE, dtype=torch.float64))
    assert (param >= 0).all()
    return param.long()


def _mamba2_shard(whole, groups, rank, tp, conv_dim_first):
    """A rank's Mamba-2 state: its channels of the whole convolution state (vLLM's
    loader's) and its heads' SSM states."""
    conv, ssm = whole                                  # conv: [channels, kernel - 1]
    mine = conv[_mamba2_rank_channels(groups, rank, tp)]
    heads = M2_HEADS // tp
    return [(mine if conv_dim_first else mine.t()).contiguous(),
            ssm[rank * heads:(rank + 1) * heads].contiguous()]


def _mamba2_kv(groups, tp, conv_dim_first):
    """An EngineKV of a Mamba-2 layer (0) and a full-attention layer (1), as engine_kv reads
    a Granite-4.0-H of ``groups`` groups at TP degree ``tp``."""
    from hostkv.copy_engine import VLLM
    from hostkv.vllm.layout import EngineKV, KVGroup, StateLayout, state_splits

    vllm_module()
    channels = _mamba2_rank_channels(groups, 0, tp).numel()
    conv = (channels, M2_KERNEL - 1) if conv_dim_first else (M2_KERNEL - 1, channels)
    shapes = (conv, (M2_HEADS // tp, M2_DIM, M2_STATE))
    state = StateLayout(shapes=shapes, dtypes=("float32", "float32"), itemsizes=(4, 4),
                        tp_world=tp, kind="MambaSpec (MAMBA2)",
                        splits=state_splits("MAMBA2", ("GraniteMoeHybridForCausalLM",),
                                            shapes, conv_dim_first, False, groups, tp))
    assert state.canonical
    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=4, head_dim=32, dtype="float32",
                             state_layers=(0,))
    return EngineKV(layout, 16, ("model.layers.0.mamba", "model.layers.1.attn"), VLLM,
                    tp, "test", (KVGroup("state", (0,), state=state),
                                 KVGroup("full", (1,))))


@pytest.mark.parametrize("conv_dim_first", [False, True], ids=["SD", "DS"])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_every_degree_writes_a_mamba2_models_whole_state_and_reads_its_share(groups,
                                                                             conv_dim_first):
    """A Mamba-2 state sharded by vLLM's own weight loader: the groups' B and C channels
    shared out where the degree divides them, one group copied to every rank (each rank
    writing its copy to the same place). Ranks of every degree vLLM allows write the slot
    a TP=1 engine writes, byte for byte, and read back exactly their own state; the
    description (the namespace) is the same at every degree."""
    from hostkv.vllm.state import StateCopies

    g = torch.Generator().manual_seed(groups)
    channels = M2_HEADS * M2_DIM + 2 * groups * M2_STATE
    wholes = [[torch.randn(channels, M2_KERNEL - 1, generator=g),
               torch.randn(M2_HEADS, M2_DIM, M2_STATE, generator=g)] for _ in range(3)]
    degrees = [tp for tp in (1, 2, 4) if groups % tp == 0 or groups == 1]
    written, described = {}, set()
    for tp in degrees:
        kv = _mamba2_kv(groups, tp, conv_dim_first)
        state = kv.groups[0].state
        described.add(state.describe())
        assert state.data_bytes == (channels * (M2_KERNEL - 1)
                                    + M2_HEADS * M2_DIM * M2_STATE) * 4
        pool = torch.zeros(4, kv.layout.page_bytes(16), dtype=torch.uint8)
        for rank in range(tp):
            shards = [_mamba2_shard(w, groups, rank, tp, conv_dim_first) for w in wholes]
            tensors = [torch.stack([s[i] for s in shards]) for i in range(2)]
            copies = StateCopies(pool, kv, {kv.layer_names[0]: tensors}, rank, 0)
            assert copies.save([1, 2], [2, 3]).error is None
        written[tp] = pool[2:4, :state.data_bytes].clone()
        for reader in degrees:
            kv_r = _mamba2_kv(groups, reader, conv_dim_first)
            for rank in range(reader):
                back = [torch.zeros(3, *t.shape) for t in
                        _mamba2_shard(wholes[0], groups, rank, reader, conv_dim_first)]
                copies = StateCopies(pool, kv_r, {kv_r.layer_names[0]: back}, rank, 0)
                assert copies.load([2, 3], [2, 1]).error is None
                for block, whole in ((2, wholes[1]), (1, wholes[2])):
                    want = _mamba2_shard(whole, groups, rank, reader, conv_dim_first)
                    for got, expected in zip(back, want):
                        assert torch.equal(got[block], expected), (tp, reader, rank)
    assert all(torch.equal(written[1], slot) for slot in written.values())
    assert len(described) == 1, described


def test_a_state_is_whole_only_with_every_marker_of_the_degree_that_wrote_it():
    """A page saved with a state at TP=2, then saved anew at TP=1: without a state it has
    none (rank 0's zero marker, rank 1's stale one ignored), with one it has a whole state.
    A TP=2 save that only rank 0 made is no state to a reader of any degree."""
    from hostkv.vllm.state import StateCopies, pages_with_state

    wholes = [_gdn_whole(seed, False) for seed in range(3)]
    kv1, kv2 = _gdn_kv(1, False), _gdn_kv(2, False)
    pool = torch.zeros(4, kv1.layout.page_bytes(16), dtype=torch.uint8)

    def saver(kv, rank):
        tensors = _gdn_blocks(wholes, rank, kv.tp_world, False)
        return StateCopies(pool, kv, {kv.layer_names[0]: tensors}, rank, 0)

    def whole(kv):
        return pages_with_state(kv, pool.numpy(), [2])

    assert saver(kv2, 0).save([1], [2]).error is None
    assert (whole(kv1), whole(kv2)) == (0, 0)               # rank 1's share is missing
    assert saver(kv2, 1).save([1], [2]).error is None
    assert (whole(kv1), whole(kv2)) == (1, 1)
    assert saver(kv1, 0).save([0], [2]).error is None        # TP=1, no state
    assert (whole(kv1), whole(kv2)) == (0, 0)
    assert saver(kv1, 0).save([2], [2]).error is None        # TP=1, a state
    assert (whole(kv1), whole(kv2)) == (1, 1)
    back = [torch.zeros_like(t) for t in _gdn_blocks(wholes, 1, 2, False)]
    assert StateCopies(pool, kv2, {kv2.layer_names[0]: back}, 1, 0).load(
        [2], [1]).error is None
    assert all(torch.equal(b[1], w[2]) for b, w in zip(back, _gdn_blocks(wholes, 1, 2, False)))


def test_whole_states_name_no_degree_in_the_namespace_and_per_degree_ones_do():
    """Engines of two degrees of a model whose split hostkv knows describe their pages
    alike (they share them); of one it does not know, differently (they never do)."""
    known = [_gdn_kv(tp, False).parts_description() for tp in (1, 2, 4)]
    assert len(set(known)) == 1
    assert "[3, 64] bfloat16 in parts [16, 16, 32] along axis 1" in known[0]
    assert "[4, 8, 8] float32 in parts [4] along axis 0, whole" in known[0]
    unknown = [_gdn_kv(tp, False, "OtherForCausalLM").parts_description() for tp in (1, 2)]
    assert len(set(unknown)) == 2 and "2 rank(s)" in unknown[1]



def test_a_split_that_does_not_add_up_to_the_tensor_is_refused():
    """A StateLayout whose splits name no axis of a tensor, or parts that do not add up to
    it, or another count of tensors, is a ValueError naming it."""
    vllm_module()
    from hostkv.vllm.layout import StateLayout

    base = dict(shapes=((3, 32), (2, 8, 8)), dtypes=("bfloat16", "float32"), itemsizes=(2, 4),
                tp_world=2, kind="GDN_ATTN")
    no, three = (False,), (False,) * 3
    StateLayout(**base, splits=((1, (8, 8, 16), three), (0, (2,), no)))
    for splits, what in [(((2, (32,), no), (0, (2,), no)), "axis 2"),
                         (((1, (8, 8, 8), three), (0, (2,), no)), r"parts \[8, 8, 8\]"),
                         (((1, (0, 32), no * 2), (0, (2,), no)), r"parts \[0, 32\]"),
                         (((1, (8, 8, 16), no), (0, (2,), no)), r"\(copied: \[False\]\)"),
                         (((1, (32,), no),), "1 splits for 2 state tensors")]:
        with pytest.raises(ValueError, match=what):
            StateLayout(**base, splits=splits)
