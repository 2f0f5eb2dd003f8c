"""A model-based harness for the vLLM connector: vLLM 0.32's own scheduler (``Scheduler``,
or ``AsyncScheduler`` with its batch queue of two) with HostKVConnector as its connector,
and one worker-role HostKVConnector per tensor-parallel rank over CPU KV tensors holding
that rank's slice of the heads, copying into a real hostkv segment.

The "forward" writes KV that is a function of the request's token ids up to each position,
its head and its layer, so every block's correct bytes are known; but only if every earlier
position of the request, on every rank, holds its correct KV when the forward runs
(attention reads them, and tensor parallelism mixes the heads): otherwise it writes a
poison value. KV computed on top of blocks that were never loaded is therefore visible in
every byte it reaches.

A model with recurrent-state layers (the "state" groups: Gated DeltaNet beside full
attention, as Qwen3-Next) runs vLLM's MambaManager in "align" mode. Such a layer keeps no KV
per position but one state per request, in the block of its table that vLLM names for the
tokens computed so far; the forward does what vLLM's model runner does with it
(``mamba_utils.preprocess_mamba``: the state moves from the block the previous step wrote
into this step's block, then the kernel reads it and writes the state after the step's
tokens there). A state is a function of the request's token prefix and of the rank (each
rank holds its shard); a forward that starts from a state that is not exactly that of the
tokens computed before it (a state loaded wrong, or not at all) writes poison.

After every step the harness checks the promise: every page committed in the segment holds
exactly its tokens' KV (and, where its markers say it holds a state, every rank's part of
the state after its last token), and every block vLLM computes on holds its tokens' KV or
was reported bad to vLLM (every state a forward starts from is right: a state model's loads
fail whole, so vLLM never computes on one). Failures are injected at random: a rank's save
or load failing, a rank's step report lost, pages evicted by another handle between lookup
and borrow (for a state model, also the hit's tokens saved anew without a state there), the
connector's lock not had, the segment's calls raising, build_connector_meta failing, held
asynchronous copies, aborts and preemptions, and resets of vLLM's caches with the
connector's after which the model's weights are new (every position's KV is then another,
so a page of the old weights loaded after the reset is wrong KV).
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import warnings
from collections import deque
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np

import hostkv

BS = 16                 # tokens per block and per page
LAYERS = 2              # the layers of a model of one full-attention group
MAX_LAYERS = 4
HEADS = 4               # KV heads of the model; each rank holds HEADS // tp of them
DIM = 8
POISON = -1.0           # KV computed on top of wrong KV
UNWRITTEN = -2.0        # a block no forward or load has written
_HASH_MOD = (1 << 61) - 1
# One offset per (layer, K/V, head, dim): the page layout's order [layers, 2, heads, dim].
_OFFSETS = np.arange(1, MAX_LAYERS * 2 * HEADS * DIM + 1, dtype=np.int64).reshape(
    MAX_LAYERS, 2, 1, HEADS, DIM)
NULL_BLOCK = 0          # vLLM's null block: a windowed or state group's unheld blocks

# KV-cache groups of each kind of model, as vLLM's hybrid manager makes them:
# (kind, layers, span in tokens: the sliding window, or the chunk of chunked-local
# attention). "hybrid" interleaves the kinds the way
# Gemma-style models do, so each group's layers are a strided run of the page's layers
# and a page's layers come from two block tables. "state" interleaves recurrent-state
# layers (vLLM's MambaSpec, align mode) with full attention, as Qwen3-Next does.
GROUPS = {
    "full": (("full", (0, 1), None),),
    "hybrid": (("sliding_window", (0, 2), 2 * BS), ("full", (1, 3), None)),
    "sliding": (("sliding_window", (0, 1), BS + 8),),
    # Llama 4's kind: attention within chunks of two blocks beside full attention (vLLM
    # frees a whole chunk's blocks at once, and a hit ending where a chunk does needs
    # none of the group's).
    "chunked": (("chunked_local", (0, 2), 2 * BS), ("full", (1, 3), None)),
    "state": (("state", (0, 2), None), ("full", (1, 3), None)),
}
# A state layer's state on one rank, per block, as Gated DeltaNet's: a convolution window
# (its heads' channels x conv width - 1) and a recurrent state (heads x key dim x value
# dim), float32; each rank holds its heads' shard.
CONV_WIDTH = 3
STATE_ELEMENTS = HEADS * DIM * (CONV_WIDTH + DIM)       # of every rank together
# One offset per (layer, element of every rank's state), past the KV's.
_STATE_OFFSETS = np.arange(_OFFSETS.size + 1, _OFFSETS.size + 1 + MAX_LAYERS * STATE_ELEMENTS,
                           dtype=np.int64).reshape(MAX_LAYERS, STATE_ELEMENTS)


def state_shapes(tp: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """One rank's state tensors' shapes per block (vLLM's ``MambaSpec.shapes``)."""
    local = HEADS // tp
    return (local * DIM, CONV_WIDTH), (local, DIM, DIM)


def expected_state(prefix_hash: int, layer: int, rank: int, tp: int) -> np.ndarray:
    """A rank's correct state of a state layer after the tokens whose prefix hash is
    ``prefix_hash``: its tensors' elements in vLLM's order, flat, float32 (exact, as
    :func:`expected_kv`); another rank's shard, layer or prefix differs in every element."""
    count = STATE_ELEMENTS // tp
    offsets = _STATE_OFFSETS[layer, rank * count:(rank + 1) * count]
    return (((int(prefix_hash) * offsets) >> 9) % (1 << 23)).astype(np.float32)


class Violation(AssertionError):
    """The connector broke its promise (the message says how, with the seed)."""


@dataclasses.dataclass
class Options:
    """One run's shape."""

    seed: int
    steps: int
    tp: int = 1
    async_scheduling: bool = True
    async_saves: bool = False
    token_budget: int = 48          # small: long prompts are prefilled in chunks
    num_blocks: int = 28            # vLLM's KV blocks: small, so requests get preempted
    num_pages: int = 40             # hostkv's pages: small, so pages get evicted
    fault_rate: float = 0.08        # per step and per kind of fault
    kv_groups: str = "full"         # a key of GROUPS, "-parts" after it: window parts on


def prefix_hashes(tokens: List[int], weights: int = 0) -> np.ndarray:
    """hash(weights, tokens[0..p]) for every position p (31 bits each): the KV of a prefix
    is another for every version of the model's weights."""
    out = np.empty(len(tokens), dtype=np.int64)
    h = (7 + 1000033 * weights) % _HASH_MOD
    for i, t in enumerate(tokens):
        h = (h * 1000003 + int(t) + 1) % _HASH_MOD
        out[i] = h & 0x7FFFFFFF
    return out


def expected_kv(hashes: np.ndarray, layers: int = LAYERS) -> np.ndarray:
    """The correct KV of positions with these prefix hashes, [layers, 2, positions, heads,
    dim] float32 (the page layout), exact in float32 (below 2**23)."""
    return (((hashes.reshape(1, 1, -1, 1, 1) * _OFFSETS[:layers]) >> 9)
            % (1 << 23)).astype(np.float32)


def vllm_config(tp: int, async_scheduling: bool, token_budget: int, segment: str,
                extra: Dict[str, Any], layers: int = LAYERS, state: bool = False) -> Any:
    """A VllmConfig for a config-only Llama (no weights: nothing is loaded), the way
    vLLM's own connector unit tests build one. ``state``: the KV cache has recurrent-state
    groups, whose states vLLM keeps at block ends: ``mamba_cache_mode="align"``, what
    vLLM picks for a Mamba model with prefix caching on (``MambaModelConfig``), with
    chunked prefill; the scheduler then ends prefill chunks where a state must be kept
    (``Scheduler._mamba_block_aligned_split``)."""
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                             ParallelConfig, SchedulerConfig, VllmConfig)

    model = _model_dir(layers)
    model_config = ModelConfig(model=model, dtype="float32", seed=0, skip_tokenizer_init=True,
                               max_model_len=2048)
    scheduler_config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=token_budget, max_model_len=2048,
        enable_chunked_prefill=True, is_encoder_decoder=False,
        async_scheduling=async_scheduling)
    cache_config = CacheConfig(block_size=BS, gpu_memory_utilization=0.9, cache_dtype="auto",
                               enable_prefix_caching=True,
                               mamba_cache_mode="align" if state else "none")
    transfer = KVTransferConfig(
        kv_connector="HostKVConnector", kv_connector_module_path="hostkv.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"segment": segment, **extra})
    return VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                      cache_config=cache_config, kv_transfer_config=transfer,
                      device_config=DeviceConfig("cpu"),
                      parallel_config=ParallelConfig(tensor_parallel_size=tp))


_MODEL_DIR: Dict[int, str] = {}


def _model_dir(layers: int) -> str:
    if layers not in _MODEL_DIR:
        import json
        import tempfile

        path = tempfile.mkdtemp(prefix="hostkv-model-test-")
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                       "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 256,
                       "num_hidden_layers": layers, "num_attention_heads": HEADS,
                       "num_key_value_heads": HEADS, "head_dim": DIM,
                       "max_position_embeddings": 4096, "torch_dtype": "float32",
                       "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2}, f)
        _MODEL_DIR[layers] = path
    return _MODEL_DIR[layers]


class _OneShot:
    """Replaces obj.name with a function that raises once (then restores the original)."""

    def __init__(self, obj: Any, name: str, exc: BaseException) -> None:
        original = getattr(obj, name)

        def broken(*args: Any, **kwargs: Any) -> Any:
            setattr(obj, name, original)
            raise exc

        setattr(obj, name, broken)


class Harness:
    """One engine: vLLM's scheduler with HostKVConnector, tp worker connectors, a second
    handle on the segment (another process, for evictions and checks)."""

    def __init__(self, opts: Options, segment: str) -> None:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.core.kv_cache_coordinator import (HybridKVCacheCoordinator,
                                                        UnitaryKVCacheCoordinator)
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
        from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec,
                                                KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                                SlidingWindowSpec)
        from vllm.v1.structured_output import StructuredOutputManager

        import hostkv.vllm.connector as connector_module

        self.opts = opts
        self.rng = random.Random(opts.seed)
        self.segment = segment
        self.log: deque = deque(maxlen=int(os.environ.get("HOSTKV_MODEL_LOG", "40")))        # the last events, for the failure message
        self.step_no = 0
        tp = opts.tp
        extra = {"num_pages": opts.num_pages, "async_saves": opts.async_saves}
        self.window_parts = opts.kv_groups.endswith("-parts")
        if self.window_parts:
            # Few parts: the part LRU takes them from cached pages every few steps.
            extra.update(window_parts=True, window_part_fraction=0.3)
        self.groups = groups = GROUPS[opts.kv_groups[:-len("-parts")] if self.window_parts
                                      else opts.kv_groups]
        self.layers = 1 + max(layer for _, layers, _ in groups for layer in layers)
        # layer -> its group; group -> its span (None: full attention or state) and kind.
        self.layer_group = [next(g for g, (_, layers, _) in enumerate(groups) if i in layers)
                            for i in range(self.layers)]
        self.windows = [window for _, _, window in groups]
        self.kinds = [kind for kind, _, _ in groups]
        self.state_groups = [g for g, (kind, _, _) in enumerate(groups) if kind == "state"]
        # The layers with KV per position, and those with a recurrent state.
        self.attention_layers = [i for i in range(self.layers)
                                 if self.layer_group[i] not in self.state_groups]
        self.state_layers = [i for i in range(self.layers)
                             if self.layer_group[i] in self.state_groups]
        self.layer_names = tuple(f"model.layers.{i}.linear_attn" if i in self.state_layers
                                 else f"model.layers.{i}.self_attn.attn"
                                 for i in range(self.layers))
        config = vllm_config(tp, opts.async_scheduling, opts.token_budget, segment, extra,
                             self.layers, state=bool(self.state_groups))
        if len(groups) > 1:
            # A GPU engine's default with a connector that supports the hybrid manager
            # (vLLM turns it off on a CPU platform, which has none).
            config.scheduler_config.disable_hybrid_kv_cache_manager = False
        group_specs = []
        for kind, layers, window in groups:
            shape = dict(block_size=BS, num_kv_heads=HEADS // tp, head_size=DIM,
                         dtype=torch.float32)
            if kind == "state":
                # Padded to an attention page, as vLLM pads a hybrid model's state so
                # that every group's blocks come from one pool.
                spec = MambaSpec(block_size=BS, shapes=state_shapes(tp),
                                 dtypes=(torch.float32, torch.float32),
                                 page_size_padded=FullAttentionSpec(**shape).page_size_bytes,
                                 mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                                 mamba_cache_mode="align")
            elif kind == "sliding_window":
                spec = SlidingWindowSpec(sliding_window=window, **shape)
            elif kind == "chunked_local":
                spec = ChunkedLocalAttentionSpec(attention_chunk_size=window, **shape)
            else:
                spec = FullAttentionSpec(**shape)
            group_specs.append(KVCacheGroupSpec([self.layer_names[i] for i in layers], spec))
        kv_config = KVCacheConfig(num_blocks=opts.num_blocks, kv_cache_tensors=[],
                                  kv_cache_groups=group_specs)
        config.cache_config.num_gpu_blocks = opts.num_blocks
        cls = AsyncScheduler if opts.async_scheduling else Scheduler
        self.scheduler = cls(vllm_config=config, kv_cache_config=kv_config, log_stats=False,
                             structured_output_manager=StructuredOutputManager(config),
                             block_size=BS)
        # The coordinator vLLM runs for such a model (hybrid: a block table per group,
        # sliding-window blocks freed behind the window).
        coordinator = self.scheduler.kv_cache_manager.coordinator
        want = HybridKVCacheCoordinator if len(groups) > 1 else UnitaryKVCacheCoordinator
        assert type(coordinator) is want, type(coordinator)
        if self.state_groups:
            # vLLM's align mode: states kept at block ends, chunks split to end there.
            from vllm.v1.core.single_type_kv_cache_manager import MambaManager

            assert self.scheduler.need_mamba_block_aligned_split
            assert all(type(coordinator.single_type_managers[g]) is MambaManager
                       for g in self.state_groups)
        self.conn = self.scheduler.connector
        self.sched = self.conn._sched
        assert self.sched is not None and self.sched.tp_world == tp
        self.workers = []
        # Per rank, numpy views of the same memory: the forward's reads and writes (torch's
        # indexing by lists is ~100x slower here): an attention layer's KV tensor, a state
        # layer's state [num_blocks, elements] (its tensors' elements, flat), and every
        # tensor the layers share.
        self.tensors: List[Dict[str, Any]] = []
        self.states: List[Dict[str, Any]] = []
        self.pools: List[List[Any]] = []
        original_rank = connector_module._tensor_parallel_rank
        try:
            for rank in range(tp):
                connector_module._tensor_parallel_rank = lambda rank=rank: rank
                worker = connector_module.HostKVConnector(config, KVConnectorRole.WORKER,
                                                          kv_config)
                tensors, states, shared = self._kv_tensors(torch)
                worker.register_kv_caches(tensors)
                self.workers.append(worker)
                self.tensors.append({name: t.numpy() for name, t in tensors.items()
                                     if name not in states})
                self.states.append({name: t.numpy() for name, t in states.items()})
                self.pools.append([t.numpy() for t in shared])
        finally:
            connector_module._tensor_parallel_rank = original_rank
        self.other = hostkv.HostKVCache.attach(segment)
        self.aggregator = KVOutputAggregator(tp)
        self.queue: deque = deque()
        self.depth = 2 if opts.async_scheduling else 1
        # req_id -> (prompt, max_tokens); the generated token at position p is a function
        # of the request and p, so every token a request will ever hold is known.
        # Every request ever added (vLLM's Request: its token ids, also after it ended), and
        # the token each last sampled.
        self.requests: Dict[str, Any] = {}
        self.last_sampled: Dict[str, int] = {}
        self.hashes: Dict[str, np.ndarray] = {}
        # The model's weights, a new version at each reset of the caches (as after a
        # weight update), and the version each of the connector's namespaces was written
        # with: a page of one version read by a forward of another is wrong KV.
        self.weights = 0
        self.namespace_weights: Dict[int, int] = {self._plain_namespace(): 0}
        self.next_req = 0
        self.block_tables: Dict[str, List[List[int]]] = {}     # one table per group
        self.bad_known: Set[int] = set()
        self.expected_pages: Dict[Tuple[int, Tuple[int, ...]], np.ndarray] = {}
        self.holds: List[Tuple[int, threading.Event]] = []
        self.counts: Dict[str, int] = {}
        self.aborted: Set[str] = set()
        # The model runner's index, per request, of the state-table block its last step
        # wrote the state into (vLLM's mamba_state_idx); this step's state reads, request
        # -> {state group: (the block the forward reads its state from, the block that
        # state came from)}; and blocks of state groups a load named, until a forward reads
        # them.
        self.state_idx: Dict[str, int] = {}
        self.state_reads: Dict[str, Dict[int, Tuple[int, int]]] = {}
        self.loaded_states: Set[int] = set()
        self.expected_states: Dict[Tuple[int, Tuple[int, ...]], List[List[np.ndarray]]] = {}

    def _kv_tensors(self, torch: Any) -> Tuple[Dict[str, Any], Dict[str, Any], List[Any]]:
        """One rank's KV tensors, shared by groups as vLLM's hybrid allocation shares them:
        the i-th layer of every group in one tensor (block ids come from one pool, so a
        block is one group's at a time), which a copy into another group's block would
        show in the KV of the request that owns it. A state layer's state (its tensors,
        ``state_shapes``, one after the other) is at the start of each block's bytes, as
        vLLM lays a padded state page out. Returns (what vLLM registers with a connector:
        a KV tensor per attention layer, a state layer's bytes [num_blocks, 1, 1, state
        bytes] as ``allocate_kv_cache`` views them; each state layer's elements
        [num_blocks, elements], float32; the shared tensors)."""
        tp = self.opts.tp
        num_blocks = self.opts.num_blocks
        shape = (num_blocks, HEADS // tp, BS, 2 * DIM)
        tensors: Dict[str, Any] = {}
        states: Dict[str, Any] = {}
        pools = []
        members = [layers for _, layers, _ in self.groups]
        for i in range(max(len(layers) for layers in members)):
            shared = torch.full(shape, UNWRITTEN)
            pools.append(shared)
            flat = shared.view(num_blocks, -1)
            for layers in members:
                if i >= len(layers):
                    continue
                name = self.layer_names[layers[i]]
                if layers[i] not in self.state_layers:
                    tensors[name] = shared
                    continue
                count = STATE_ELEMENTS // tp
                tensors[name] = (shared.view(torch.int8).view(num_blocks, -1)[:, :count * 4]
                                 .view(num_blocks, 1, 1, count * 4))
                states[name] = flat[:, :count]
        order = sorted(tensors, key=self.layer_names.index)
        return {name: tensors[name] for name in order}, states, pools

    # -- the model's truth ------------------------------------------------------------------

    def sample(self, req_id: str, p: int) -> int:
        """The token the "model" samples for position p of a request: one per request.
        vLLM appends a step's token wherever the request ends when the output arrives,
        which after a load error (a step's output dropped, the next one's kept) is not the
        position it was sampled for; a token independent of the position keeps every
        token id, and so every block's correct KV, the same whichever step sampled it."""
        return int(req_id[1:]) * 7919 % 997 + 3

    def tokens_upto(self, req_id: str, n: int) -> List[int]:
        """The request's token ids [0, n) as the model runner has them: vLLM's, then the
        tokens it sampled in steps whose output vLLM has not processed yet."""
        tokens = list(self.requests[req_id].all_token_ids[:n])
        return tokens + [self.sample(req_id, p) for p in range(len(tokens), n)]

    def hashes_upto(self, req_id: str, n: int) -> np.ndarray:
        tokens = self.tokens_upto(req_id, n)
        have = self.hashes.get(req_id)
        if have is None or have[0][:n] != tokens or have[2] != self.weights:
            have = (tokens, prefix_hashes(tokens, self.weights), self.weights)
            self.hashes[req_id] = have
        return have[1][:n]

    def _plain_namespace(self) -> int:
        """The connector's namespace now of a request without salt, adapter or images (the
        harness's requests)."""
        from hostkv.vllm.scheduler import _namespace

        return _namespace(self.sched.namespace_base, None, None)

    def note(self, what: str) -> None:
        self.log.append(f"step {self.step_no}: {what}")
        key = what.split(" ")[0]
        self.counts[key] = self.counts.get(key, 0) + 1

    def fail(self, what: str) -> None:
        events = "\n  ".join(self.log)
        raise Violation(f"seed {self.opts.seed} ({self.opts}), step {self.step_no}: {what}\n"
                        f"last events:\n  {events}")

    # -- requests ---------------------------------------------------------------------------

    def add_request(self) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        rng = self.rng
        req_id = f"r{self.next_req}"
        self.next_req += 1
        served = [r for r in self.requests if r not in self.aborted]
        kind = rng.random()
        if served and kind < 0.35:
            # Another turn of an earlier conversation: its prompt and what it generated.
            base = rng.choice(served)
            prompt = list(self.requests[base].all_token_ids)
        elif kind < 0.7:
            # A shared system prompt.
            base_rng = random.Random(rng.randrange(3))
            prompt = [base_rng.randrange(3, 1000) for _ in range(40 + 23 * base_rng.randrange(3))]
        else:
            prompt = []
        prompt = prompt + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 60))]
        max_tokens = rng.randrange(1, 24)
        init_none_hash(sha256)
        request = Request(req_id, list(prompt),
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                          block_hasher=get_request_block_hasher(BS, sha256))
        self.requests[req_id] = request
        self.scheduler.add_request(request)
        self.note(f"add {req_id} prompt {len(prompt)} max_tokens {max_tokens}")

    # -- faults on the scheduler side --------------------------------------------------------

    def _maybe(self, kind: str) -> bool:
        return self.rng.random() < self.opts.fault_rate

    def _install_scheduler_faults(self) -> None:
        """Wraps the scheduler connector's calls with this step's faults."""
        conn, harness = self.conn, self

        def without_lock(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                if harness._maybe("lock"):
                    harness.note(f"lock-timeout {name}")
                    # Held by "another thread": a threading.Lock is not reentrant, so a
                    # lock_timeout of 0 fails just as if another thread held it.
                    settings = conn._settings
                    conn._settings = dataclasses.replace(settings, lock_timeout=0.0)
                    assert harness.sched.lock.acquire()
                    try:
                        return call(*args, **kwargs)
                    finally:
                        harness.sched.lock.release()
                        conn._settings = settings
                return call(*args, **kwargs)
            return wrapped

        cls = type(conn)

        def lookup(request: Any, num_computed_tokens: int) -> Any:
            answer = cls.get_num_new_matched_tokens(conn, request, num_computed_tokens)
            if answer[0] and harness._maybe("evict"):
                # Another engine evicts between the lookup and the borrow.
                n = harness.rng.randrange(1, 6)
                harness.note(f"evict {harness.other.evict(n)} of {n} pages after the lookup "
                             f"of {request.request_id} ({answer[0]} tokens offered)")
            elif answer[0] and harness.state_groups and harness._maybe("resave"):
                harness._resave_without_state(request, num_computed_tokens + answer[0])
            elif (answer[0] and harness.window_parts and harness.opts.fault_rate
                  and harness.rng.random() < 0.4):
                # Another engine's allocation takes the parts of every unlocked prefix
                # (the part LRU), the lookup's pages staying cached. Often: hits are rare
                # with few parts, and each of these must fail its load whole.
                from hostkv import _radix

                seg = harness.other._segment
                freed = _radix.evict_parts(seg, harness.other.config.num_parts)
                harness.note(f"parts-evict {freed} after the lookup of {request.request_id} "
                             f"({answer[0]} tokens offered)")
            return answer

        conn.get_num_new_matched_tokens = lookup
        conn.update_state_after_alloc = without_lock(
            "update_state_after_alloc",
            lambda *a: cls.update_state_after_alloc(conn, *a))

        def build(out: Any) -> Any:
            # Independent of how the scheduler side is written: a segment call it makes
            # while planning raises, or the call fails before it starts.
            if harness._maybe("plan"):
                harness.note("build_connector_meta: page_table raises")
                _OneShot(harness.sched.view, "page_table", RuntimeError("planning failed"))
            elif harness._maybe("early"):
                harness.note("build_connector_meta fails at once")
                _OneShot(harness.sched, "build_connector_meta", RuntimeError("failed early"))
            return without_lock("build_connector_meta",
                                lambda o: cls.build_connector_meta(conn, o))(out)

        conn.build_connector_meta = build
        conn.update_connector_output = without_lock(
            "update_connector_output", lambda o: cls.update_connector_output(conn, o))
        conn.request_finished = without_lock(
            "request_finished", lambda r, b: cls.request_finished(conn, r, b))

    def _resave_without_state(self, request: Any, hit: int) -> None:
        """Between the lookup and the borrow, another engine evicts every page it can and
        saves the hit's tokens anew without a state (vLLM offered it none): the pages the
        borrow holds then have the tokens' KV, and the last one no state."""
        from hostkv.worker_view import SequenceRequest, WorkerView

        _, tokens, namespace = self.sched.lookups[request.request_id]
        evicted = self.other.evict(self.opts.num_pages)
        tokens = np.asarray(tokens[:hit], dtype=np.int32)
        tp = self.opts.tp
        first_marker = STATE_ELEMENTS // tp * 4 * tp       # after every rank's part
        with WorkerView(self.other) as view:
            try:
                seq = view.allocate_pages_for_sequences_with_prefix(
                    [SequenceRequest(1, tokens, namespace)])[0]
            except hostkv.errors.OutOfPagesError:
                self.note(f"resave of {request.request_id}'s {hit} tokens: no pages")
                return
            pages = view.page_table(1)
            pool = self.other.pages_tensor().numpy()
            try:
                hashes = prefix_hashes(tokens.tolist(), self.namespace_weights[namespace])
                for k in range(seq.reused_tokens // BS, hit // BS):
                    page = pool[pages[k]]
                    page[...] = expected_kv(hashes[k * BS:(k + 1) * BS],
                                            self.layers).reshape(page.shape)
                    slots = page.view(np.uint8).reshape(self.layers, -1)
                    slots[self.state_layers, first_marker:first_marker + 8 * tp] = 0
            finally:
                pool = page = slots = None   # no view of the pool may outlive the handle
            view.release([1])
        self.note(f"resave {request.request_id}'s {hit} tokens without a state after its "
                  f"lookup ({evicted} pages evicted, {seq.reused_tokens} tokens still held)")

    def _segment_faults(self) -> None:
        """This step, one of the scheduler's segment calls raises (a lock timeout)."""
        view = self.sched.view
        for name in ("append_tokens", "commit", "allocate_pages_for_sequences_with_prefix",
                     "release"):
            if self._maybe("segment"):
                self.note(f"segment {name} raises")
                _OneShot(view, name, hostkv.errors.LockTimeoutError("segment lock")
                         if hasattr(hostkv.errors, "LockTimeoutError")
                         else TimeoutError("segment lock"))
                return

    # -- one engine step ------------------------------------------------------------------------

    def step(self) -> None:
        """One call of EngineCore.step (or step_with_batch_queue with async scheduling)."""
        self.step_no += 1
        rng = self.rng
        if rng.random() < 0.25 and self.scheduler.get_num_unfinished_requests() < 10:
            self.add_request()
        self._segment_faults()
        scheduler = self.scheduler
        if self._maybe("reset") and rng.random() < 0.1:
            self.reset_caches()
        if scheduler.has_requests():
            out = scheduler.schedule()
            worker_out = self._execute(out)
            self.queue.appendleft((out, worker_out))
            if len(self.queue) < self.depth and (out.total_num_scheduled_tokens > 0
                                                 or scheduler.has_requests()):
                return
        elif not self.queue:
            return
        out, model_out = self.queue.pop()
        # Aborts that arrived during the model's execution (EngineCore processes them
        # before the step's output).
        running = [r for r in scheduler.requests if r not in self.aborted]
        if running and rng.random() < 0.04:
            from vllm.v1.request import RequestStatus

            victim = rng.choice(running)
            self.aborted.add(victim)
            self.note(f"abort {victim}")
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        scheduler.update_from_output(out, model_out)
        self._release_holds()
        self.check_committed()
        self.check_null_block()

    def reset_caches(self) -> bool:
        """What EngineCore's pause with ``clear_cache`` does (after a weight update): the
        steps in flight finish, then every running request is preempted (resumed by the
        next schedule, which also names it preempted) and the prefix cache is reset with
        the connector's, and the model's weights change. vLLM refuses the reset while a
        request it keeps for the connector holds blocks (False); its running requests
        stay preempted."""
        scheduler = self.scheduler
        while self.queue:
            out, model_out = self.queue.pop()
            scheduler.update_from_output(out, model_out)
            self._release_holds()
            self.check_committed()
        try:
            scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
            # New weights from here on: every running request was preempted, and computes
            # again on what it finds under the connector's new namespace.
            self.weights += 1
            self.namespace_weights[self._plain_namespace()] = self.weights
            self.note("reset-caches: the prefix cache and the connector's")
            return True
        except RuntimeError as exc:
            self.note(f"reset-refused by vLLM: {str(exc)[:60]}")
            return False

    def _execute(self, out: Any) -> Any:
        """The workers' part of a step, in the order vLLM 0.32's model runner calls the
        connector (kv_connector_model_runner_mixin), each rank over its own tensors."""
        from vllm.v1.outputs import ModelRunnerOutput

        rng = self.rng
        meta = out.kv_connector_metadata
        self._update_block_tables(out)
        if out.new_block_ids_to_zero:
            # The model runner zeroes new blocks first (_update_states: vLLM does for a
            # model with state; it never names blocks a load is about to write).
            for pool in self.pools:
                for shared in pool:
                    shared[out.new_block_ids_to_zero] = 0.0
            self.loaded_states -= set(out.new_block_ids_to_zero)
        if meta.bad_blocks:
            self.note(f"meta {meta.step} bad blocks {sorted(meta.bad_blocks)}")
        for req_id, pages, blocks in meta.loads:
            self.note(f"meta {meta.step} load {req_id} blocks {blocks}")
            if any(part >= 0 for part in meta.load_parts.get(req_id, ())):
                self.note(f"parts-loaded {req_id} parts {meta.load_parts[req_id]}")
            for g in self.state_groups:
                self.loaded_states.update(b for b in blocks[g] if b != NULL_BLOCK)
        for req_id, blocks, pages in meta.saves:
            self.note(f"meta {meta.step} save {req_id} blocks {blocks}")
            if any(part < 0 for part in meta.save_parts.get(req_id, ())):
                self.note(f"partless-save {req_id} parts {meta.save_parts[req_id]}")
        if meta.preempted:
            # A held copy would hold handle_preemptions' wait forever; real copies end.
            self._release_holds(all_=True)
        for rank, worker in enumerate(self.workers):
            engine = worker._worker.engine
            if meta.loads and rng.random() < self.opts.fault_rate:
                self.note(f"load fails on rank {rank}")
                _OneShot(engine, "submit_load", OSError("load failed"))
            if meta.saves and rng.random() < self.opts.fault_rate:
                self.note(f"save fails on rank {rank}")
                _OneShot(engine, "submit_save", OSError("save failed"))
            if (self.opts.async_saves and rng.random() < self.opts.fault_rate
                    and engine.engines[0][1]._thread is not None):
                release = threading.Event()
                engine.engines[0][1]._thread.submit(release.wait, 0)
                self.holds.append((self.step_no + rng.randrange(1, 4), release))
                self.note(f"hold copies of rank {rank}")
            worker.bind_connector_metadata(meta)
            worker.handle_preemptions(meta)
            if out.has_sync_kv_loads:
                worker.start_load_kv(None)
        loads_late = not out.has_sync_kv_loads
        poisoned = self._forward(out)
        outputs = []
        step_bad: Set[int] = set(meta.bad_blocks)
        lost = rng.random() < self.opts.fault_rate / 2
        lost_rank = rng.randrange(len(self.workers))
        for rank, worker in enumerate(self.workers):
            if loads_late:
                worker.start_load_kv(None)
            worker.wait_for_save()
            # As vLLM 0.32's model runner asks (kv_connector_model_runner_mixin): the
            # asynchronous loads' failures come only with get_transfer_results.
            results = worker.get_transfer_results(out.finished_req_ids)
            invalid = worker.get_block_ids_with_load_errors()
            step_bad |= invalid
            worker_meta = worker.build_connector_worker_meta()
            worker.clear_connector_metadata()
            if lost and rank == lost_rank and worker_meta is not None:
                self.note(f"report of rank {rank} lost: {worker_meta.done}")
                worker_meta = None
            from vllm.v1.outputs import KVConnectorOutput

            if results.finished_recving:
                self.note(f"rank {rank} received {sorted(results.finished_recving)} failed "
                          f"{sorted(results.failed_recving)}")
            outputs.append(self._runner_output(out, KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=set(results.failed_recving or ()),
                invalid_block_ids=invalid, kv_connector_worker_meta=worker_meta)))
        if step_bad - set(meta.bad_blocks):
            self.note(f"load errors {sorted(step_bad - set(meta.bad_blocks))}")
        for req_id, block, written, what in poisoned:
            if block not in self.bad_known and block not in step_bad:
                self.fail(f"{req_id}'s forward {what}, which was never reported bad")
            # Computed on top of a block vLLM was told is bad: vLLM recomputes the request
            # from that block, these included. Until then a step planned before it knew
            # (asynchronous scheduling) reads them, and a sliding window may read only
            # them, no longer the bad block itself.
            self.bad_known |= written
        self.bad_known |= step_bad
        return self.aggregator.aggregate(outputs, 0)

    def _runner_output(self, out: Any, kv_out: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            computed_end = self.computed[req_id] + out.num_scheduled_tokens[req_id]
            if req_id in self.sampling:
                self.last_sampled[req_id] = self.sample(req_id, computed_end)
                sampled.append([self.last_sampled[req_id]])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kv_out)

    def _update_block_tables(self, out: Any) -> None:
        """The model runner's view of each request: its blocks and computed tokens."""
        self.computed: Dict[str, int] = {}
        self.scheduled: Dict[str, int] = dict(out.num_scheduled_tokens)
        # A windowed group's table keeps, as the model runner's does, the ids of blocks
        # vLLM freed behind the window or chunk (only new blocks come in the output); the
        # forward never reads them.
        for new in out.scheduled_new_reqs:
            self.block_tables[new.req_id] = [list(group) for group in new.block_ids]
            self.computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.block_tables[req_id] = ([list(group) for group in blocks]
                                             if blocks is not None
                                             else [[] for _ in self.windows])
            elif blocks is not None:
                for table, added in zip(self.block_tables[req_id], blocks):
                    table.extend(added)
            self.computed[req_id] = cached.num_computed_tokens[i]
        for req_id in out.finished_req_ids:
            self.block_tables.pop(req_id, None)
        # vLLM's cleanup_mamba_state_idx: such a request's next step starts from the state
        # of its computed tokens' last block.
        for req_id in (set(out.finished_req_ids) | set(out.preempted_req_ids or ())
                       | set(cached.resumed_req_ids)):
            self.state_idx.pop(req_id, None)
        for req_id, n in self.scheduled.items():
            self.log.append(f"step {self.step_no}: run {req_id} [{self.computed[req_id]}, "
                            f"{self.computed[req_id] + n}) blocks {self.block_tables[req_id]}")
        # A request samples in this step unless it is in the middle of its prefill.
        self.sampling = {r for r in out.num_scheduled_tokens
                         if not self.scheduler.requests[r].is_prefill_chunk}

    # -- the forward --------------------------------------------------------------------------

    def _read(self, rank: int, layer: int, blocks: List[int], lo: int, hi: int) -> np.ndarray:
        """Positions [lo, hi) of one layer of a request on a rank, from its group's block
        table: [2, hi - lo, heads, dim]."""
        local = HEADS // self.opts.tp
        first, last = lo // BS, -(-hi // BS)
        t = self.tensors[rank][self.layer_names[layer]][blocks[first:last]]  # [b, h, t, 2d]
        t = t.reshape(last - first, local, BS, 2, DIM).transpose(3, 0, 2, 1, 4)
        return t.reshape(2, (last - first) * BS, local, DIM)[:, lo - first * BS:hi - first * BS]

    def _reads(self, c: int) -> Dict[int, int]:
        """The first position each attention layer reads of a request's earlier KV when it
        computes from position c: every one for full attention; for chunked-local
        attention in chunks of w those of c's chunk (ChunkedLocalAttentionManager's);
        for a sliding window of w
        tokens the last w - 1 (vLLM frees the blocks before them:
        SlidingWindowManager.get_num_skipped_tokens). A state layer reads no KV (its
        state: :meth:`_state_wrong`)."""
        def first(group: int) -> int:
            window = self.windows[group]
            if window is None:
                return 0
            if self.kinds[group] == "chunked_local":
                return c // window * window
            return max(0, c - window + 1)

        return {layer: first(self.layer_group[layer]) for layer in self.attention_layers}

    def _write(self, req_id: str, start: int, values: np.ndarray) -> None:
        """Writes [layers, 2, n, heads, dim] at positions [start, start + n) on every rank
        (each its own heads), each layer into the block its group's table names."""
        tp = self.opts.tp
        local = HEADS // tp
        n = values.shape[2]
        pos = np.arange(start, start + n)
        slot = pos % BS
        tables = self.block_tables[req_id]
        blk = [np.array([table[p // BS] for p in pos]) for table in tables]
        for g, window in enumerate(self.windows):
            if window is not None and (blk[g] == NULL_BLOCK).any():
                raise AssertionError(f"harness: {req_id} computes into vLLM's null block "
                                     f"(group {g}, positions from {start}): {tables[g]}")
        for rank in range(tp):
            heads = values[:, :, :, rank * local:(rank + 1) * local]   # [l, 2, n, h, d]
            for li in self.attention_layers:
                v = heads[li].transpose(1, 2, 0, 3).reshape(n, local, 2 * DIM)  # [n, h, 2d]
                tensor = self.tensors[rank][self.layer_names[li]]
                tensor[blk[self.layer_group[li]], :, slot] = v

    # -- recurrent state (vLLM's align mode) ------------------------------------------------

    def _state_block(self, req_id: str, g: int, index: int) -> int:
        table = self.block_tables[req_id][g]
        if index >= len(table) or table[index] == NULL_BLOCK:
            raise AssertionError(f"harness: {req_id}'s state (group {g}) lives in block "
                                 f"index {index}, which vLLM left null or never gave: "
                                 f"{table}")
        return table[index]

    def _move_states(self) -> None:
        """vLLM's preprocess_mamba in align mode, before the forward: a request's state is
        in the block of the last step's last token (a new or resumed request's: its
        computed tokens' last block, where a hit's state is); when this step ends in
        another block, the state is copied there, and the step reads and writes it there.
        Copies run for every request before any forward."""
        self.state_reads = {}
        if not self.state_groups:
            return
        for req_id, n in self.scheduled.items():
            c = self.computed[req_id]
            prev = self.state_idx.get(req_id, (c - 1) // BS)
            curr = -(-(c + n) // BS) - 1
            self.state_idx[req_id] = curr
            for g in self.state_groups:
                target = self._state_block(req_id, g, curr)
                source = target
                if prev != -1 and prev != curr:
                    # vLLM copies whatever the table names, the null block included (a
                    # state the forward then finds wrong).
                    table = self.block_tables[req_id][g]
                    source = table[prev] if prev < len(table) else NULL_BLOCK
                    for rank in range(self.opts.tp):
                        for layer in self.state_layers:
                            if self.layer_group[layer] == g:
                                states = self.states[rank][self.layer_names[layer]]
                                states[target] = states[source]
                if c:
                    self.state_reads.setdefault(req_id, {})[g] = (target, source)

    def _state_wrong(self, req_id: str) -> Optional[int]:
        """The block the request's state came from if the state its forward starts from,
        on any state layer and rank, is not exactly that of its computed tokens; else
        None (also when it starts from no state: a first step)."""
        reads = self.state_reads.get(req_id)
        if reads is None:
            return None
        c = self.computed[req_id]
        h = self.hashes_upto(req_id, c)[c - 1]
        for layer in self.state_layers:
            target, source = reads[self.layer_group[layer]]
            for rank in range(self.opts.tp):
                if not np.array_equal(self.states[rank][self.layer_names[layer]][target],
                                      expected_state(h, layer, rank, self.opts.tp)):
                    return source
        return None

    def _write_states(self, req_id: str, poison: bool) -> Set[int]:
        """Writes the state after the step's tokens (or poison) into the block the step
        computes in; returns it."""
        if not self.state_groups:
            return set()
        c, n = self.computed[req_id], self.scheduled[req_id]
        curr = self.state_idx[req_id]
        h = self.hashes_upto(req_id, c + n)[c + n - 1]
        written = set()
        for layer in self.state_layers:
            block = self._state_block(req_id, self.layer_group[layer], curr)
            written.add(block)
            for rank in range(self.opts.tp):
                self.states[rank][self.layer_names[layer]][block] = (
                    POISON if poison else expected_state(h, layer, rank, self.opts.tp))
        loaded = [source for _, source in self.state_reads.get(req_id, {}).values()
                  if source in self.loaded_states]
        if loaded and not poison:
            self.note(f"state-loaded {req_id} started from the state loaded into {loaded}")
        self.loaded_states -= written
        return written

    def _forward(self, out: Any) -> List[Tuple[str, int, Set[int], str]]:
        """Computes every scheduled request's tokens; returns (request, block, blocks
        written, what it read) for each request that read wrong KV (the first wrong block)
        or started from a wrong state (the block it came from), which wrote poison."""
        pending = [r for r in out.num_scheduled_tokens]
        for worker in self.workers:
            for name in self.layer_names:
                worker.wait_for_layer_load(name)
        poisoned = []
        self._move_states()
        # KV written in a step is read by the same step's later layers: a request that
        # reads blocks another one writes in this step waits for it (a few passes).
        while pending:
            progress = False
            for req_id in list(pending):
                if self._first_wrong(req_id) is None:
                    self._compute(req_id, poison=False)
                    pending.remove(req_id)
                    progress = True
            if not progress:
                for req_id in pending:
                    wrong = self._first_wrong(req_id)
                    assert wrong is not None
                    first, block = wrong
                    what = (f"read wrong KV in block {block}" if first >= 0 else
                            f"started from a wrong state (from block {block})")
                    self.note(f"forward {req_id} {what} (position {first})")
                    poisoned.append((req_id, block, self._compute(req_id, poison=True), what))
                break
        return poisoned

    def _first_wrong(self, req_id: str) -> Optional[Tuple[int, int]]:
        """(position, block) of the first wrong KV the request's forward reads, over every
        layer and rank; (-1, the block it came from) for a wrong state; None if all it
        reads is right."""
        c = self.computed[req_id]
        if c == 0:
            return None
        state = self._state_wrong(req_id)
        if state is not None:
            return -1, state
        reads = self._reads(c)
        lo = min(reads.values())
        want = expected_kv(self.hashes_upto(req_id, c)[lo:], self.layers)
        tables = self.block_tables[req_id]
        tp = self.opts.tp
        local = HEADS // tp
        first: Optional[Tuple[int, int]] = None
        for layer, start in reads.items():
            table = tables[self.layer_group[layer]]
            for rank in range(tp):
                have = self._read(rank, layer, table, start, c)
                bad = np.nonzero((have != want[layer, :, start - lo:, rank * local:
                                               (rank + 1) * local]).any(axis=(0, 2, 3)))[0]
                if len(bad):
                    p = start + int(bad[0])
                    if first is None or p < first[0]:
                        first = (p, table[p // BS])
        return first

    def _compute(self, req_id: str, poison: bool) -> Set[int]:
        """Writes the request's scheduled positions: their KV, or poison; returns the blocks
        written. Every layer's KV rests on the attention of the layers before it, so a
        wrong read anywhere poisons every layer."""
        c = self.computed[req_id]
        n = self.scheduled[req_id]
        if poison:
            values = np.full((self.layers, 2, n, HEADS, DIM), POISON, dtype=np.float32)
        else:
            values = expected_kv(self.hashes_upto(req_id, c + n)[c:], self.layers)
            for p in range(c, c + n):
                if p % BS == 0:
                    for g, table in enumerate(self.block_tables[req_id]):
                        if g not in self.state_groups:
                            self.bad_known.discard(table[p // BS])
        self._write(req_id, c, values)
        states = self._write_states(req_id, poison)
        if not poison:
            self.bad_known -= states
        return states | {table[b] for g, table in enumerate(self.block_tables[req_id])
                         if g not in self.state_groups
                         for b in range(c // BS, (c + n - 1) // BS + 1)}

    def check_null_block(self) -> None:
        """vLLM's null block stands for KV nobody holds: no copy or forward writes it."""
        for rank, pool in enumerate(self.pools):
            for i, t in enumerate(pool):
                if not (t[NULL_BLOCK] == UNWRITTEN).all():
                    self.fail(f"rank {rank}'s KV tensor {i} (the layers at index {i} of "
                              "their groups) has its null block written")

    # -- checks ---------------------------------------------------------------------------------

    def check_committed(self) -> None:
        """Every committed page holds exactly its tokens' KV; a state layer's slot, where
        its markers say it holds a state, every rank's part of the state after the page's
        last token (:meth:`_check_state_slots`)."""
        from hostkv import _introspect

        seg = self.other._segment
        contents = seg.run_locked(_introspect.tree_contents, seg)
        pool = self.other.pages_tensor().numpy()
        layers = self.attention_layers if self.state_layers else slice(None)
        # With window parts the page holds the other layers; a part, where the page has
        # one, the windowed layers (the harness's window models have no state layers).
        layout = self.other.config.kv_layout
        window = list(layout.window_layers)
        page_layers = [layer for layer in range(self.layers) if layer not in window]
        parts_pool = self.other.parts_tensor().numpy() if window else None
        wrong = None
        try:
            for namespace, tokens, pages, _ in contents:
                parts = self.other.page_parts(pages) if window else None
                for k, page in enumerate(pages):
                    key = (namespace, tuple(tokens[:(k + 1) * BS]))
                    want = self.expected_pages.get(key)
                    if want is None:
                        want = expected_kv(prefix_hashes(list(key[1]), self.namespace_weights[
                            namespace])[k * BS:], self.layers)[layers]
                        self.expected_pages[key] = want
                    if window:
                        assert parts is not None and parts_pool is not None
                        have = pool[page].reshape(len(page_layers), *want.shape[1:])
                        want_here = want[page_layers]
                        if np.array_equal(have, want_here) and parts[k] >= 0:
                            have = parts_pool[parts[k]].view(np.float32).reshape(
                                len(window), *want.shape[1:])
                            want_here = want[window]
                    else:
                        have = pool[page].reshape(self.layers, *want.shape[1:])[layers]
                        want_here = want
                    if not np.array_equal(have, want_here):
                        what = ("poison: KV computed on wrong KV" if (have == POISON).any()
                                else "never written" if (have == UNWRITTEN).any()
                                else "other KV")
                        wrong = f"holds {what}"
                    elif self.state_layers:
                        wrong = self._check_state_slots(key, pool[page])
                    del have
                    if wrong:
                        owners = [r for r, request in self.requests.items()
                                  if list(request.all_token_ids[:len(key[1])]) == list(key[1])]
                        wrong = (f"committed page {page} (page {k} of a path of {len(pages)},"
                                 f" tokens of {owners}) {wrong}")
                        break
                if wrong:
                    break
        finally:
            del pool, parts_pool     # no view of the pool may outlive the handle
        if wrong:
            self.fail(wrong)
        if self.state_layers:
            self.counts["state_pages"] = len(self.expected_states)

    def _check_state_slots(self, key: Tuple[int, Tuple[int, ...]],
                           page: np.ndarray) -> Optional[str]:
        """What is wrong with a committed page's state slots, or None. The slot of a state
        layer holds every rank's part (its state tensors' bytes), rank after rank, then one
        8-byte marker per rank (hostkv.vllm.state): every marker of every state layer set,
        and every part the state after the page's tokens; or no marker set (no state)."""
        from hostkv.vllm.layout import STATE_MARKER_PREFIX

        tp = self.opts.tp
        part = STATE_ELEMENTS // tp * 4
        slots = page.view(np.uint8).reshape(self.layers, -1)
        markers = {(rank, slots[layer, tp * part + rank * 8:tp * part + (rank + 1) * 8]
                    .tobytes()) for layer in self.state_layers for rank in range(tp)}
        if {mark for _, mark in markers} == {bytes(8)}:
            return None
        # Each rank's marker names it and the degree.
        if markers != {(rank, STATE_MARKER_PREFIX + bytes((rank, tp))) for rank in range(tp)}:
            return f"holds a partial state: markers {sorted(markers)}"
        want = self.expected_states.get(key)
        if want is None:
            h = prefix_hashes(list(key[1]), self.namespace_weights[key[0]])[-1]
            want = [[expected_state(h, layer, rank, tp) for rank in range(tp)]
                    for layer in self.state_layers]
            self.expected_states[key] = want
        for layer, wants in zip(self.state_layers, want):
            for rank, state in enumerate(wants):
                have = slots[layer, rank * part:(rank + 1) * part].view(np.float32)
                if not np.array_equal(have, state):
                    what = ("poison: a state computed on a wrong one"
                            if (have == POISON).any() else "another state")
                    return f"holds, for layer {layer} rank {rank}, {what}"
        return None

    def _release_holds(self, all_: bool = False) -> None:
        keep = []
        for until, release in self.holds:
            if all_ or until <= self.step_no:
                release.set()
            else:
                keep.append((until, release))
        self.holds = keep

    # -- the run ----------------------------------------------------------------------------------

    def run(self) -> None:
        self._install_scheduler_faults()
        for _ in range(self.opts.steps):
            self.step()
        self.finish()

    def finish(self) -> None:
        """No new requests and no faults: run until vLLM has nothing left, then check that
        nothing leaked."""
        self.opts = dataclasses.replace(self.opts, fault_rate=0.0)
        self._release_holds(all_=True)
        for _ in range(2000):
            if not self.scheduler.has_requests() and not self.queue:
                break
            self.step_no += 1
            self._release_holds(all_=True)
            scheduler = self.scheduler
            if scheduler.has_requests():
                out = scheduler.schedule()
                self.queue.appendleft((out, self._execute(out)))
                if len(self.queue) < self.depth:
                    continue
            out, model_out = self.queue.pop()
            scheduler.update_from_output(out, model_out)
            self.check_committed()
            self.check_null_block()
        else:
            self.fail("vLLM never finished its requests")
        sched = self.scheduler
        assert not sched.requests and not sched.running and not sched.waiting, (
            f"seed {self.opts.seed}: vLLM kept requests {list(sched.requests)}")
        pool = sched.kv_cache_manager.block_pool
        if pool.free_block_queue.num_free_blocks != pool.num_gpu_blocks - 1:
            self.fail(f"vLLM leaked blocks: {pool.num_gpu_blocks - 1 - pool.free_block_queue.num_free_blocks}")
        if self.sched.reqs or self.sched.retiring:
            self.fail(f"the connector still holds requests {list(self.sched.reqs)} "
                      f"and {len(self.sched.retiring)} retiring")
        stats = self.other.stats()
        if stats.active_sequences:
            self.fail(f"{stats.active_sequences} sequences leaked in the segment")
        if self.window_parts:
            self.counts["parts_evicted"] = stats.parts_evicted
            self.counts["parts_donated"] = stats.parts_donated
            self.counts["pages_without_part"] = stats.pages_without_part

    def close(self) -> None:
        """Stops every thread and detaches every handle (failures included)."""
        self._release_holds(all_=True)
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()
        try:
            stats = self.other.stats()
            self.final_stats = stats
            self.other.check()
        finally:
            self.other.close()
