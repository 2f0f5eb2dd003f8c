"""What vLLM declares about its KV cache, read as hostkv pages; and the segment that holds them.

A hostkv page is one vLLM block (page_size = block_size) of every layer, in the model's
layer order and the canonical layout of :class:`hostkv.KVLayout`: the model's total KV heads
(a tensor-parallel rank holds a slice), or one latent vector per token for MLA. Everything
here is read from vLLM's KV-cache config and its spec classes, never guessed from a
tensor's shape.

With vLLM's hybrid KV-cache manager a model's layers come in KV-cache groups, one per
attention kind, each with its own block table. hostkv holds full-attention,
sliding-window and chunked-local-attention groups of one shape: a page is still every
layer's block of its tokens, so pages mean the same whether the manager is on or off (off,
vLLM keeps every token of a sliding-window or chunked-local layer; on, it frees the blocks
that fell out of the layer's span, the window or the chunks before the current one, and a
load fills only the blocks vLLM kept, the span at the hit's end).

A layer with recurrent state (Mamba, Gated DeltaNet and other linear attention: vLLM's
``MambaSpec``) has a page slot too, of the attention layers' size, as vLLM's own block pool
pads its state to an attention page: the slot holds the layer's state after the page's last
token, when vLLM kept it (``hostkv.vllm.state``): the whole state, each rank writing its
share, where hostkv knows how the model splits it over ranks (:data:`CANONICAL_STATES`),
so that engines of every tensor-parallel degree share the pages; else each rank's bytes,
for engines of one degree. Other kinds (cross attention, vLLM's other spec classes, which
keep blocks otherwise) are refused at start-up.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, List, Optional, Sequence, Set, Tuple

from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec,
                                        MambaSpec, MLAAttentionSpec, SlidingWindowSpec)

from hostkv.cache import HostKVCache
from hostkv.config import HostKVConfig, KVLayout
from hostkv.copy_engine import VLLM, VLLM_MLA, BlockLayout, head_slice_for_rank
from hostkv.errors import (
    AbandonedSegmentError,
    IncompatibleSegmentError,
    SegmentFormatError,
    SegmentInUseError,
)
from hostkv.vllm.settings import HostKVSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["CANONICAL_STATES", "EngineKV", "KVGroup", "MAMBA2_GROUPS_ATTRIBUTE",
           "StateLayout", "conv_state_dim_first", "describe_layout", "engine_kv",
           "layer_runs", "mamba2_groups", "open_segment", "state_splits"]

logger = logging.getLogger("hostkv.vllm")


# The marker a rank writes after its share of a layer's state: the slot holds the state
# after the page's last token. Every save of a page of a model with state writes a marker
# or zeros, so a slot's stale bytes never pass for a state. Its last two bytes name the
# rank and the tensor-parallel degree that wrote it (see StateLayout.marker_bytes).
STATE_MARKER_PREFIX = b"hkvst\x02"
STATE_MARKER_BYTES = len(STATE_MARKER_PREFIX) + 2

# (offset in a rank's state bytes of one block, offset in the slot, bytes): one contiguous
# piece of a rank's state and where it goes in the slot.
StateRun = Tuple[int, int, int]

# How a state tensor is split over tensor-parallel ranks: (axis, each part's length on a
# rank along it, whether each part is copied whole to every rank rather than shared out).
StateSplit = Tuple[int, Tuple[int, ...], Tuple[bool, ...]]


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """How a recurrent-state layer's page slot holds the state: the state's bytes, then one
    8-byte marker per rank that wrote them (:meth:`marker_bytes`, or zeros).

    A state tensor is split over the tensor-parallel ranks along one axis, in parts (Gated
    DeltaNet's convolution state holds a rank's share of the queries', the keys' and the
    values' channels, in that order); a part may be copied whole to every rank instead
    (Mamba-2's B and C channels, when its one group is given to each rank). Where hostkv
    knows the split (``splits``), the slot
    holds the whole state, canonical: each tensor as one engine holds it, each part's shares
    in rank order. A rank writes and reads its shares wherever they lie, so engines of every
    tensor-parallel degree share the pages. Where it does not, the slot holds each rank's
    bytes as vLLM holds them (opaque to hostkv), rank after rank: such pages mean the same
    only to engines of one degree, which then goes into the namespace.

    Attributes:
        shapes: A rank's state tensors' shapes, per block (vLLM's ``MambaSpec.shapes``).
        dtypes: Their element types' names.
        itemsizes: Their element sizes in bytes.
        tp_world: Tensor-parallel ranks of this engine.
        kind: vLLM's name of the layer kind (``GDN_ATTN``, ``MAMBA2``, ...), for messages.
        writer: What lays the bytes out: vLLM's version and its Mamba backend. The bytes
            are vLLM's own, so a vLLM that keeps a state of the same shapes in another
            order must never read them (this goes into the namespace).
        splits: Per tensor, (axis, each part's length on a rank along it, whether each
            part is copied whole to every rank rather than shared out); None where the
            split is unknown (the opaque layout).
    """

    shapes: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[str, ...]
    itemsizes: Tuple[int, ...]
    tp_world: int
    kind: str
    writer: str = ""
    splits: Optional[Tuple[StateSplit, ...]] = None

    def __post_init__(self) -> None:
        if self.splits is None:
            return
        if len(self.splits) != len(self.shapes):
            raise ValueError(f"hostkv: {len(self.splits)} splits for {len(self.shapes)} "
                             "state tensors")
        for shape, (axis, parts, copied) in zip(self.shapes, self.splits):
            if not 0 <= axis < len(shape) or sum(parts) != shape[axis] or min(parts) <= 0 \
                    or len(copied) != len(parts):
                raise ValueError(f"hostkv: a state tensor of {list(shape)} split along "
                                 f"axis {axis} in parts {list(parts)} (copied: "
                                 f"{list(copied)})")

    def _whole_parts(self, split: StateSplit) -> List[int]:
        """A split's parts as one engine holds them: a share's times the degree, a copied
        part once."""
        _, parts, copied = split
        return [part if copy else part * self.tp_world for part, copy in zip(parts, copied)]

    @property
    def canonical(self) -> bool:
        """Whether the slot holds the whole state, the same for every tensor-parallel
        degree."""
        return self.splits is not None

    @staticmethod
    def _count(shape: Sequence[int]) -> int:
        count = 1
        for dim in shape:
            count *= int(dim)
        return count

    @property
    def rank_bytes(self) -> int:
        """Bytes of one rank's share: every tensor's state of one block."""
        return sum(self._count(shape) * size
                   for shape, size in zip(self.shapes, self.itemsizes))

    @property
    def data_bytes(self) -> int:
        """Bytes of the state in the slot: with a known split, the whole state (whatever
        the degree); else every rank's bytes."""
        if self.splits is None:
            return self.tp_world * self.rank_bytes
        return sum(self._count(shape) // shape[split[0]] * sum(self._whole_parts(split)) * size
                   for shape, size, split in zip(self.shapes, self.itemsizes, self.splits))

    @property
    def slot_bytes(self) -> int:
        """Bytes the slot must have: the state and this engine's ranks' markers."""
        return self.data_bytes + self.tp_world * STATE_MARKER_BYTES

    def marker(self, rank: int) -> int:
        """Offset of a rank's marker in the slot."""
        return self.data_bytes + rank * STATE_MARKER_BYTES

    def marker_bytes(self, rank: int) -> bytes:
        """The marker a rank of this engine writes after its share of a state: it names
        the rank and the degree, so a reader of any degree knows whose markers make the
        state whole."""
        return STATE_MARKER_PREFIX + bytes((rank, self.tp_world))

    def runs(self, rank: int) -> List[StateRun]:
        """Where a rank's state goes in the slot: (offset in the rank's bytes of a block,
        as vLLM lays its tensors one after another; offset in the slot; bytes), in the
        rank's byte order, adjacent runs merged."""
        if self.splits is None:
            return [(0, rank * self.rank_bytes, self.rank_bytes)]
        runs: List[StateRun] = []
        source = target = 0
        for shape, size, split in zip(self.shapes, self.itemsizes, self.splits):
            axis, parts, copied = split
            outer = self._count(shape[:axis])
            inner = self._count(shape[axis + 1:]) * size
            wholes = self._whole_parts(split)
            whole = sum(wholes)                           # along the axis, canonical
            for row in range(outer):
                before = 0                                # canonical, earlier parts
                for part, copy, part_whole in zip(parts, copied, wholes):
                    # A copied part: every rank holds (and writes) the same whole part.
                    share = 0 if copy else rank * part
                    at = target + (row * whole + before + share) * inner
                    if runs and runs[-1][0] + runs[-1][2] == source \
                            and runs[-1][1] + runs[-1][2] == at:
                        last = runs.pop()
                        runs.append((last[0], last[1], last[2] + part * inner))
                    else:
                        runs.append((source, at, part * inner))
                    source += part * inner
                    before += part_whole
            target += outer * whole * inner
        return runs

    def describe(self) -> str:
        """The layout in words; it goes into the engine's namespace. A canonical one names
        the whole tensors and their parts (never the degree); an opaque one each rank's
        tensors and the degree."""
        if self.splits is None:
            tensors = ", ".join(f"{list(shape)} {dtype}"
                                for shape, dtype in zip(self.shapes, self.dtypes))
            text = f"{self.kind} state of {tensors} per rank, {self.tp_world} rank(s)"
        else:
            whole = []
            for shape, dtype, split in zip(self.shapes, self.dtypes, self.splits):
                axis, parts = split[0], self._whole_parts(split)
                dims = [sum(parts) if i == axis else d for i, d in enumerate(shape)]
                whole.append(f"{dims} {dtype} in parts {parts} along axis {axis}")
            text = f"{self.kind} state of {', '.join(whole)}, whole"
        return text + (f", as {self.writer} lays it out" if self.writer else "")


@dataclasses.dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV-cache groups: layers that share a block table.

    Attributes:
        kind: "full", "sliding_window", "chunked_local" (Llama 4's attention within chunks
            of its ``attention_chunk_size``), "mla" or "state" (recurrent state: Mamba,
            linear attention).
        layers: The group's layers as indices into the page's layers (model order).
        sliding_window: The window in tokens (sliding-window groups), else None.
        state: How a page slot holds a layer's state ("state" groups), else None.
        attention_chunk: The chunk in tokens (chunked-local groups), else None.
        extra_retained: Tokens vLLM keeps behind a sliding window besides it (its
            ``extra_retained_tokens``: for speculative decoding, which hostkv refuses, so 0).
    """

    kind: str
    layers: Tuple[int, ...]
    sliding_window: Optional[int] = None
    state: Optional[StateLayout] = None
    attention_chunk: Optional[int] = None
    extra_retained: int = 0


def layer_runs(layers: Sequence[int]) -> List[Tuple[int, int, int]]:
    """Splits increasing page-layer indices into arithmetic runs, (start, stop, step) as a
    slice takes them: each is one strided view of the pool, so one copy engine moves it.
    Gemma-3's sliding-window layers (five of every six) make runs of five; its
    full-attention layers one run of step six."""
    runs: List[Tuple[int, int, int]] = []
    i = 0
    while i < len(layers):
        start = layers[i]
        step = layers[i + 1] - start if i + 1 < len(layers) else 1
        j = i + 1
        while j < len(layers) and layers[j] - layers[j - 1] == step:
            j += 1
        runs.append((start, layers[j - 1] + 1, step))
        i = j
    return runs


@dataclasses.dataclass(frozen=True)
class EngineKV:
    """One engine's KV cache as hostkv sees it.

    Attributes:
        layout: The canonical page layout (the model's total KV heads).
        page_size: Tokens per page (vLLM's block size).
        layer_names: vLLM's attention layers, in page order (the model's).
        block_layout: How vLLM lays out a layer's blocks.
        tp_world: Tensor-parallel ranks; the scheduler commits a page once every one of
            them confirmed its save.
        backend: The attention backend's name (for error messages).
        groups: vLLM's KV-cache groups, in vLLM's order (block tables come in it).
    """

    layout: KVLayout
    page_size: int
    layer_names: Tuple[str, ...]
    block_layout: BlockLayout
    tp_world: int
    backend: str
    groups: Tuple[KVGroup, ...] = ()

    def __post_init__(self) -> None:
        if not self.groups:
            # One group of every layer: what an engine without the hybrid manager has.
            kind = "mla" if self.layout.kind == "mla" else "full"
            object.__setattr__(self, "groups",
                               (KVGroup(kind, tuple(range(self.layout.num_layers))),))

    @property
    def loads_asynchronously(self) -> bool:
        """Whether hits load asynchronously, a failure failing the whole request: with a
        sliding-window or chunked-local group, vLLM recomputing from a bad block would
        attend to blocks of the span it never allocated (null), and with several groups it
        takes no block-level load errors at all."""
        return len(self.groups) > 1 or bool(self.windowed_groups)

    @property
    def state_groups(self) -> Tuple[int, ...]:
        """Indices of the recurrent-state groups (see :class:`StateLayout`)."""
        return tuple(i for i, group in enumerate(self.groups) if group.kind == "state")

    @property
    def null_groups(self) -> Tuple[int, ...]:
        """Indices of the groups whose block lists may name vLLM's null block: windowed
        groups (blocks out of the layers' span) and state groups (a page whose state is not
        copied)."""
        return tuple(sorted(self.windowed_groups + self.state_groups))

    def parts_description(self) -> str:
        """What a page holds beyond every layer's K/V (or latent) in the canonical layout,
        in words: the state layers' layouts, or "" (pages of any tensor-parallel degree
        mean the same)."""
        return "; ".join(f"layers {list(self.groups[g].layers)}: "
                         f"{self.groups[g].state.describe()}"  # type: ignore[union-attr]
                         for g in self.state_groups)

    @property
    def windowed_groups(self) -> Tuple[int, ...]:
        """Indices of the groups whose layers attend to a span that moves on, sliding
        windows and chunked-local attention: vLLM frees a block once it left the span
        (their tables then name vLLM's null block), and a hit needs only the span at its
        end."""
        return tuple(i for i, group in enumerate(self.groups)
                     if group.kind in ("sliding_window", "chunked_local"))

    def heads_of_rank(self, rank: int) -> Tuple[int, int, bool]:
        """(first head, stop, writes) of a rank's slice of every page (see
        :func:`hostkv.copy_engine.head_slice_for_rank`); MLA: every rank holds the whole
        latent and rank 0 writes."""
        if self.layout.kind == "mla":
            return 0, 1, rank == 0
        return head_slice_for_rank(self.layout.num_kv_heads, rank, self.tp_world)


def _backend_name(vllm_config: "VllmConfig", layer_names: List[str]) -> str:
    context = getattr(getattr(vllm_config, "compilation_config", None),
                      "static_forward_context", None) or {}
    layer = context.get(layer_names[0]) if layer_names else None
    backend = getattr(layer, "attn_backend", None)
    if backend is not None and hasattr(backend, "get_name"):
        try:
            return str(backend.get_name())
        except Exception:               # noqa: BLE001 - only for messages
            pass
    return "an unnamed attention backend"


def _refuse_packed(spec: object, backend: str) -> None:
    """Raises ValueError for a KV cache that is not dense K/V (or latent) elements."""
    packed = [(name, getattr(spec, name)) for name in ("state_content_bytes", "num_head_slots")
              if getattr(spec, name, None) is not None]
    if getattr(spec, "tokens_per_state", 1) != 1:
        packed.append(("tokens_per_state", spec.tokens_per_state))
    quant = getattr(spec, "kv_quant_mode", None)
    if quant is not None and getattr(quant, "name", "NONE") != "NONE":
        packed.append(("kv_quant_mode", quant.name))
    if packed:
        raise ValueError(f"hostkv holds dense K/V (or latent) elements; {backend}'s KV cache "
                         f"is packed or quantized: {', '.join(f'{k}={v}' for k, v in packed)}")


def engine_kv(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
              window_parts: bool = False) -> EngineKV:
    """Reads vLLM's KV-cache config and parallel config as hostkv pages.

    window_parts: the layers of sliding-window and chunked-local groups go to the pages'
    window parts (``KVLayout.window_layers``) where other layers remain to fill a page;
    a model all of whose layers are windowed keeps them in its pages.

    Raises:
        ValueError: a KV cache hostkv cannot hold, naming what it saw: KV-cache groups of
            other shapes, a group of another kind than full, sliding-window or
            chunked-local attention, MLA or recurrent state (naming it: cross attention,
            for one), a state hostkv cannot keep at page ends, K and V of other sizes,
            packed or quantized KV content, a block size that is not a power of two,
            pipeline, decode-context or prefill-context parallelism, speculative
            decoding, or KV heads that do not split over the tensor-parallel ranks.
    """
    parallel = vllm_config.parallel_config
    tp = int(parallel.tensor_parallel_size)
    if int(parallel.pipeline_parallel_size) != 1:
        raise ValueError(f"hostkv: pipeline parallelism is not supported (pp="
                         f"{parallel.pipeline_parallel_size}): each stage would hold other "
                         "layers of a page")
    if int(getattr(parallel, "decode_context_parallel_size", 1) or 1) != 1:
        raise ValueError("hostkv: decode context parallelism is not supported (dcp="
                         f"{parallel.decode_context_parallel_size})")
    if int(getattr(parallel, "prefill_context_parallel_size", 1) or 1) != 1:
        # As with decode context parallelism, vLLM spreads a request's KV over the
        # context-parallel ranks (cp_kv_cache_interleave_size tokens at a time): no rank's
        # block holds the page's tokens.
        raise ValueError("hostkv: prefill context parallelism is not supported (pcp="
                         f"{parallel.prefill_context_parallel_size})")
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is not None:
        # A step writes the KV of draft tokens before the target model rejects some of them,
        # and a drafter's KV (EAGLE, MTP) at a position is computed from the next token
        # too: a page's bytes would not be a function of the tokens that key it.
        raise ValueError(f"hostkv: speculative decoding is not supported (method "
                         f"{getattr(speculative, 'method', None)!r}): draft tokens' KV "
                         "and a drafter's KV depend on more than a page's tokens")
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise ValueError("hostkv: vLLM's KV-cache config has no KV-cache group")
    all_layers = [name for group in groups for name in group.layer_names]
    backend = _backend_name(vllm_config, all_layers)
    kinds = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        # Exactly these classes: their subclasses lay blocks out otherwise, or keep other
        # blocks (a sink, a ring, a chunk).
        if type(spec) is MLAAttentionSpec:
            kinds.append("mla")
        elif type(spec) is FullAttentionSpec:
            kinds.append("full")
        elif type(spec) is SlidingWindowSpec:
            kinds.append("sliding_window")
        elif type(spec) is ChunkedLocalAttentionSpec:
            kinds.append("chunked_local")
        elif type(spec) is MambaSpec:
            kinds.append("state")
        else:
            raise ValueError(
                f"hostkv holds full, sliding-window and chunked-local attention, MLA and "
                f"recurrent state; KV-cache group {index} of {len(groups)} is {_group_kind(spec)} "
                f"({_layers_text(group)}, {backend}): hostkv cannot serve this model")
    if "mla" in kinds and len(groups) != 1:
        raise ValueError(f"hostkv holds MLA only as a model's one KV-cache group; this one "
                         f"has {len(groups)}: {', '.join(kinds)}")
    attention = [group for kind, group in zip(kinds, groups) if kind != "state"]
    if not attention:
        raise ValueError(f"hostkv pages are laid out by a model's attention layers; this "
                         f"one has none, only {_group_kind(groups[0].kv_cache_spec)} "
                         "(a pure state-space model)")
    spec = attention[0].kv_cache_spec
    for index, group in enumerate(groups[1:], 1):
        if kinds[index] == "state":
            continue
        other = group.kv_cache_spec
        shape = ("block_size", "num_kv_heads", "head_size", "head_size_v", "dtype")
        differ = [f"{name} {getattr(spec, name)} and {getattr(other, name)}" for name in shape
                  if getattr(spec, name, None) != getattr(other, name, None)]
        if differ:
            # A page is one block of every layer in one layout.
            raise ValueError(f"hostkv holds KV-cache groups of one shape; groups "
                             f"{groups.index(attention[0])} and {index} differ: "
                             f"{'; '.join(differ)}")
    try:
        from vllm.model_executor.models.utils import extract_layer_index

        layers = sorted(all_layers, key=extract_layer_index)
    except (ImportError, AssertionError, ValueError):
        if len(groups) > 1:
            raise ValueError(f"hostkv: the layers {all_layers[:4]} name no layer index, so "
                             "their order in a page is unknown") from None
        layers = all_layers
    position = {name: i for i, name in enumerate(layers)}
    if kinds[0] == "mla":
        kind, block_layout = "mla", VLLM_MLA
        if spec.head_size_v not in (0, None):
            raise ValueError(f"hostkv: an MLA cache with a V part of {spec.head_size_v}")
    else:
        kind, block_layout = "mha", VLLM
        if spec.head_size_v != spec.head_size:
            raise ValueError(f"hostkv holds K and V of one head size; the model's are "
                             f"{spec.head_size} and {spec.head_size_v}")
    for group in attention:
        _refuse_packed(group.kv_cache_spec, backend)
    local_heads = int(spec.num_kv_heads)
    if kind == "mla":
        total_heads = 1
    else:
        total_heads = int(vllm_config.model_config.get_total_num_kv_heads())
        try:
            first, stop, _ = head_slice_for_rank(total_heads, 0, tp)
        except ValueError as exc:
            raise ValueError(f"hostkv: {exc} (tensor parallelism {tp})") from None
        if stop - first != local_heads:
            raise ValueError(f"hostkv: the model has {total_heads} KV heads and vLLM gives "
                             f"each of {tp} ranks {local_heads}; hostkv expected "
                             f"{stop - first}")
    dtype = str(spec.dtype).replace("torch.", "")
    state_layers = sorted(position[name] for kind, group in zip(kinds, groups)
                          if kind == "state" for name in group.layer_names)
    window_layers = sorted(position[name] for kind, group in zip(kinds, groups)
                           if kind in ("sliding_window", "chunked_local")
                           for name in group.layer_names)
    if not window_parts or len(window_layers) == len(layers):
        window_layers = []
    layout = KVLayout(num_layers=len(layers), num_kv_heads=total_heads,
                      head_dim=spec.head_size, dtype=dtype, kind=kind,
                      state_layers=tuple(state_layers), window_layers=tuple(window_layers))
    block_size = int(spec.block_size)
    if block_size & (block_size - 1):
        # vLLM rounds a model with state's block up until an attention page holds a state
        # (Qwen3-Next-80B: 544 tokens on a GPU, 640 on the CPU, by vLLM 0.32's rule); it keeps
        # a block size it is given that already does.
        raise ValueError(f"hostkv pages hold a power-of-two number of tokens; vLLM's block "
                         f"size is {block_size}: start vLLM with --block-size "
                         f"{1 << (block_size - 1).bit_length()}")
    slot_bytes = layout.layer_token_bytes * block_size
    kv_groups = tuple(
        KVGroup(kind, tuple(sorted(position[name] for name in group.layer_names)),
                int(group.kv_cache_spec.sliding_window) if kind == "sliding_window" else None,
                _state_layout(vllm_config, group, block_size, slot_bytes, tp)
                if kind == "state" else None,
                int(group.kv_cache_spec.attention_chunk_size)
                if kind == "chunked_local" else None,
                int(getattr(group.kv_cache_spec, "extra_retained_tokens", 0) or 0)
                if kind == "sliding_window" else 0)
        for kind, group in zip(kinds, groups))
    return EngineKV(layout, block_size, tuple(layers), block_layout, tp, backend, kv_groups)


def _group_kind(spec: object) -> str:
    """A KV-cache spec's kind for messages: its class, and its Mamba kind if any."""
    what = type(spec).__name__
    mamba = getattr(spec, "mamba_type", None)
    if mamba is not None:
        what += f" ({getattr(mamba, 'name', mamba)})"
    return what


def _layers_text(group: object) -> str:
    names = list(getattr(group, "layer_names", ()))
    return f"layers {names[:4]}{' ...' if len(names) > 4 else ''}"


def _state_writer(vllm_config: "VllmConfig") -> str:
    """vLLM's version, Mamba backend and platform: what lays a state's bytes out (vLLM's
    CPU kernels hold a GDN head's state as [key, value], its GPU kernels as [value, key])."""
    try:
        from vllm import __version__ as version
    except ImportError:
        version = "unknown"
    try:
        from vllm.platforms import current_platform

        platform = str(current_platform.device_type)
    except Exception:                   # noqa: BLE001 - an unknown platform is its own
        platform = "unknown"
    backend = getattr(getattr(vllm_config, "mamba_config", None), "backend", None)
    return f"vLLM {version} on {platform}, Mamba backend {getattr(backend, 'name', backend)}"


def _state_layout(vllm_config: "VllmConfig", group: object, block_size: int,
                  slot_bytes: int, tp: int) -> StateLayout:
    """How a page slot holds a recurrent-state group's state; raises ValueError where vLLM
    keeps no state hostkv can save at page ends, naming what it saw."""
    import torch

    spec = group.kv_cache_spec          # type: ignore[attr-defined]
    what = f"KV-cache group {_group_kind(spec)} ({_layers_text(group)})"
    kind = _mamba_kind(spec)
    mode = getattr(spec, "mamba_cache_mode", "none")
    if mode != "align":
        # Only "align" keeps the state at block ends; "all" keeps it elsewhere, "none"
        # (prefix caching off) keeps none.
        raise ValueError(f"hostkv stores recurrent state at page ends, which vLLM keeps "
                         f"only with mamba_cache_mode 'align' (prefix caching on); {what} "
                         f"has {mode!r}")
    if int(spec.block_size) != block_size:
        raise ValueError(f"hostkv stores recurrent state at page ends: {what} keeps it every "
                         f"{spec.block_size} tokens, the attention layers' pages hold "
                         f"{block_size}")
    speculative = int(getattr(spec, "num_speculative_blocks", 0) or 0)
    if speculative:
        # engine_kv refuses a speculative config; a spec built without one is refused too.
        raise ValueError(f"hostkv: {what} with speculative decoding ({speculative} "
                         "speculative state blocks): its states are not kept at page ends")
    if getattr(getattr(vllm_config, "cache_config", None), "use_replayssm", False):
        # ReplaySSM writes a state back only when it flushes, not at each step's end: a
        # block vLLM offers may not hold its boundary's state when the step's save reads it.
        raise ValueError(f"hostkv: {what} with use_replayssm: vLLM writes its states back "
                         "late, so no save can know one is there")
    dtypes = tuple(dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
                   for dtype in spec.dtypes)
    shapes = tuple(tuple(int(d) for d in shape) for shape in spec.shapes)
    state = StateLayout(
        shapes=shapes,
        dtypes=tuple(str(dtype).replace("torch.", "") for dtype in dtypes),
        itemsizes=tuple(torch.empty((), dtype=dtype).element_size() for dtype in dtypes),
        tp_world=tp, kind=_group_kind(spec), writer=_state_writer(vllm_config),
        splits=state_splits(
            kind, _architectures(vllm_config), shapes, conv_state_dim_first(),
            bool(getattr(spec, "tp_replicated", False)),
            mamba2_groups(vllm_config) if kind == "MAMBA2" else None, tp))
    if state.slot_bytes > slot_bytes:
        raise ValueError(f"hostkv: {what}'s state ({state.rank_bytes} bytes on each of {tp} "
                         f"rank(s), and a marker each) does not fit a page's slot of "
                         f"{slot_bytes} bytes (one layer's K/V of the page)")
    return state


# The models whose state split over tensor-parallel ranks hostkv knows, by vLLM's kind of
# state and the model's architecture: how vLLM 0.32 shards their weights (the convolution's
# channels by ``mamba_v2_sharded_weight_loader`` in parts, the heads evenly), read from
# vLLM's source and checked byte for byte against it in tests/test_vllm_state.py. Real
# engines of two degrees (tests/test_vllm_shapes.py) load each other's states and write the
# same whole states for the same prompts, to rounding (their tokens alone cannot show a
# wrong split). Any other model's state is kept per degree: a wrong split would be a wrong
# state.
CANONICAL_STATES = {
    ("GDN_ATTN", "Qwen3NextForCausalLM"): "gdn",
    # vLLM's ShortConv in both.
    ("SHORT_CONV", "Lfm2ForCausalLM"): "short_conv",
    ("SHORT_CONV", "Lfm2MoeForCausalLM"): "short_conv",
    # vLLM's MambaMixer2 in all four.
    ("MAMBA2", "GraniteMoeHybridForCausalLM"): "mamba2",
    ("MAMBA2", "NemotronHForCausalLM"): "mamba2",
    ("MAMBA2", "FalconH1ForCausalLM"): "mamba2",
    ("MAMBA2", "Zamba2ForCausalLM"): "mamba2",
}

# Where each Mamba-2 architecture's config gives its number of groups, as vLLM 0.32's model
# reads it for MambaMixer2.
MAMBA2_GROUPS_ATTRIBUTE = {
    "GraniteMoeHybridForCausalLM": "mamba_n_groups",
    "FalconH1ForCausalLM": "mamba_n_groups",
    "NemotronHForCausalLM": "n_groups",
    "Zamba2ForCausalLM": "mamba_ngroups",
}


def state_splits(kind: str, architectures: Sequence[str],
                 shapes: Sequence[Tuple[int, ...]], conv_dim_first: bool,
                 replicated: bool = False, mamba2_groups: Optional[int] = None,
                 tp_world: int = 1) -> Optional[Tuple[StateSplit, ...]]:
    """How a state's tensors split over tensor-parallel ranks (:attr:`StateLayout.splits`),
    or None where hostkv does not know.

    Args:
        kind: vLLM's kind of state (``GDN_ATTN``, ``SHORT_CONV``, ...).
        architectures: The model's architectures (its config's).
        shapes: A rank's state tensors' shapes, per block.
        conv_dim_first: Whether vLLM holds a convolution state as (channels, kernel - 1)
            rather than (kernel - 1, channels).
        replicated: Whether vLLM keeps the whole state on every rank (``tp_replicated``).
        mamba2_groups: A Mamba-2 model's number of groups (:func:`mamba2_groups`); None
            where the config does not say, and hostkv cannot tell how they are split.
        tp_world: The engine's tensor-parallel degree.
    """
    if replicated:
        return None
    rule = next((CANONICAL_STATES[(kind, arch)] for arch in architectures
                 if (kind, arch) in CANONICAL_STATES), None)
    axis = 0 if conv_dim_first else 1
    if rule == "short_conv" and len(shapes) == 1 and len(shapes[0]) == 2:
        return ((axis, (shapes[0][axis],), (False,)),)
    if rule == "gdn" and len(shapes) == 2 and len(shapes[0]) == 2 and len(shapes[1]) == 3:
        # The convolution's channels: a rank's queries, keys (as many) and values; the
        # recurrent state: a rank's value heads, each [value dim, key dim].
        channels = shapes[0][axis]
        values = shapes[1][0] * shapes[1][1]
        keys = (channels - values) // 2
        if keys > 0 and 2 * keys + values == channels:
            return ((axis, (keys, keys, values), (False,) * 3), (0, (shapes[1][0],), (False,)))
    if rule == "mamba2" and mamba2_groups and len(shapes) == 2 and len(shapes[0]) == 2 \
            and len(shapes[1]) == 3:
        # The convolution's channels: a rank's heads' x, then its share of the groups' B
        # and C (as many); the SSM state: a rank's heads, each [head dim, state size].
        # vLLM shares the groups out where the degree divides them, and gives every rank a
        # copy of one group (extra_groups_for_head_shards); it refuses any other number.
        if mamba2_groups % tp_world == 0:
            copied, group_channels = False, mamba2_groups * shapes[1][2] // tp_world
        elif mamba2_groups == 1:
            copied, group_channels = True, shapes[1][2]
        else:
            return None
        heads_x = shapes[1][0] * shapes[1][1]
        # Shapes that do not add up to what the config says are not what hostkv checked.
        if heads_x + 2 * group_channels == shapes[0][axis]:
            return ((axis, (heads_x, group_channels, group_channels), (False, copied, copied)),
                    (0, (shapes[1][0],), (False,)))
    return None


def mamba2_groups(vllm_config: "VllmConfig") -> Optional[int]:
    """A Mamba-2 model's number of groups (of B and C channels), from where its
    architecture's config gives it; None where hostkv does not know where that is, or the
    config holds no positive number there."""
    hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    for architecture in _architectures(vllm_config):
        if architecture in MAMBA2_GROUPS_ATTRIBUTE:
            groups = getattr(hf_config, MAMBA2_GROUPS_ATTRIBUTE[architecture], None)
            return groups if isinstance(groups, int) and groups > 0 else None
    return None


def _mamba_kind(spec: object) -> str:
    mamba = getattr(spec, "mamba_type", None)
    return str(getattr(mamba, "name", mamba))


def _architectures(vllm_config: "VllmConfig") -> Tuple[str, ...]:
    hf_config = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    return tuple(getattr(hf_config, "architectures", None) or ())


def conv_state_dim_first() -> bool:
    """Whether vLLM holds a convolution state as (channels, kernel - 1) ("DS"), not as
    (kernel - 1, channels) ("SD", its default on a CPU)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return bool(is_conv_state_dim_first())


def describe_layout(layout: Optional[KVLayout], page_size: int) -> str:
    """A layout in words, for messages: "2 layers x 4 KV heads x head_dim 64 float32 ..."."""
    if layout is None:
        return f"no KV layout, {page_size} tokens a page"
    state = (f" (layers {list(layout.state_layers)} hold recurrent state)"
             if layout.state_layers else "")
    if layout.window_layers:
        state += f" (layers {list(layout.window_layers)} in window parts)"
    if layout.kind == "mla":
        return (f"{layout.num_layers} layers x MLA latent {layout.head_dim} {layout.dtype}, "
                f"{page_size} tokens a page{state}")
    return (f"{layout.num_layers} layers x {layout.num_kv_heads} KV heads x head_dim "
            f"{layout.head_dim} {layout.dtype}, {page_size} tokens a page{state}")


def _processes_mapping(name: str) -> Set[int]:
    """Pids (of this PID namespace) other than this one that map /dev/shm/<name>.

    Only for a segment of another format: hostkv versions before layout 9 took no file lock
    while attached, so their users are invisible to the replacer's flock; this best-effort
    look (blind to other PID namespaces) is all that can still refuse to pull such a
    segment from under them. Segments of this format are guarded by the lock alone."""
    path = f"/dev/shm/{name}"
    found: Set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/maps", errors="replace") as maps:
                if any(line.rstrip("\n").endswith(" " + path) for line in maps):
                    found.add(int(entry))
        except OSError:
            continue                     # gone, or not ours to read
    return found


def open_segment(settings: HostKVSettings, layout: KVLayout, page_size: int) -> HostKVCache:
    """Attaches the segment, or creates it if none exists, atomically across engines.

    Engines (and their workers) starting at once all succeed: the create is exclusive, so
    exactly one wins and the others attach (waiting while the creator makes progress, and
    giving up after ``ready_timeout`` without any). A segment of another page layout, made
    by another hostkv version, or abandoned by a creator that died, is replaced once no live
    process has it attached (unless ``settings.replace_incompatible`` is false); looking at
    it takes no lease and no lock (see :meth:`hostkv.HostKVCache.open`).

    Raises:
        IncompatibleSegmentError: the segment holds another layout or version and live
            processes use it (the message names both layouts), or replacing is off.
        HostKVError: the segment could not be created or attached.
    """
    page_bytes = layout.page_bytes(page_size)
    num_parts = 0
    if layout.window_layers:
        # size pays for each page and its share of a window part.
        fraction = settings.window_part_fraction
        num_pages = settings.num_pages or max(
            1, int(settings.size // (page_bytes + fraction * layout.part_bytes(page_size))))
        num_parts = max(1, int(num_pages * fraction))
    else:
        num_pages = settings.num_pages or max(1, settings.size // page_bytes)
    config = HostKVConfig(num_pages=num_pages, page_size=page_size, kv_layout=layout,
                          max_processes=settings.max_processes, num_parts=num_parts)
    wanted = describe_layout(layout, page_size)
    name = settings.segment

    def what(reason: IncompatibleSegmentError, found: Optional[HostKVConfig]) -> str:
        if found is not None and found.num_parts:
            return (f"pages of {describe_layout(found.kv_layout, found.page_size)} with "
                    f"{found.num_parts} window parts of {found.part_bytes} bytes")
        if found is not None:
            return f"pages of {describe_layout(found.kv_layout, found.page_size)}"
        if isinstance(reason, SegmentFormatError):
            return f"another format ({reason})"
        return f"a half-made segment ({reason})"

    seen = {"found": "another layout or version"}

    def may_replace(reason: IncompatibleSegmentError, found: Optional[HostKVConfig]) -> bool:
        found_text = seen["found"] = what(reason, found)
        if isinstance(reason, SegmentFormatError):
            holders = len(_processes_mapping(name))
            if holders:
                raise IncompatibleSegmentError(
                    f"hostkv: segment {name!r} holds {found_text}, and {holders} live "
                    f"process(es) map it; this engine's KV cache is {wanted}: stop them, or "
                    "give this engine another segment")
        if not settings.replace_incompatible and not isinstance(reason, AbandonedSegmentError):
            raise IncompatibleSegmentError(
                f"hostkv: segment {name!r} holds {found_text}, but this engine's KV cache is "
                f"{wanted}; replace_incompatible is false: unlink it (python -m hostkv unlink "
                f"{name}) or use another segment")
        logger.warning("hostkv: segment %r holds %s; this engine's KV cache is %s: replacing "
                       "it unless a live process has it attached (its cached pages are "
                       "dropped)", name, found_text, wanted)
        return True

    try:
        cache = HostKVCache.open(
            name, config,
            # A committed page vouches for its part: parts of another size (or parts a
            # layout without window layers never fills) make another layout.
            compatible=lambda found: (found.kv_layout == layout and found.page_size == page_size
                                      and (found.num_parts > 0) == bool(layout.window_layers)),
            may_replace=may_replace, lock_timeout=settings.lock_timeout,
            ready_timeout=settings.ready_timeout)
    except SegmentInUseError:
        raise IncompatibleSegmentError(
            f"hostkv: segment {name!r} holds {seen['found']}, and live process(es) use it; "
            f"this engine's KV cache is {wanted}: stop them, or give this engine another "
            "segment") from None
    return cache
