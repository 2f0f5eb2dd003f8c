"""Recurrent state (Mamba, Gated DeltaNet and other linear attention) in hostkv pages.

A model with state layers keeps, per request, one state per state layer: what the layer
has read of every token so far. vLLM with prefix caching on (``mamba_cache_mode="align"``)
keeps the state of a block boundary in that block of the layer's table (block ``k`` holds
the state after ``(k + 1) * block_size`` tokens), but only at the boundaries where a step's
computation ended: a prefill chunk's end, the prompt's last whole block. Each step it
offers the connector those states (``SchedulerOutput.kv_connector_block_state``'s
``boundary_state_offloads``: request, group, block, boundary).

The protocol, on top of a page being one block of every layer
(:mod:`hostkv.vllm.layout`):

1. **Save.** A page's save takes, for each state group, the block vLLM offered for the
   page's end in this step, or :data:`~hostkv.vllm.groups.NULL_BLOCK` when it offered none.
   Every rank writes its share of each state layer's slot and its marker
   (:meth:`~hostkv.vllm.layout.StateLayout.marker_bytes` after a state, zeros without
   one), so a slot never keeps a marker from an earlier page. The page is committed, as
   every page, once every rank confirmed the step: its state is then whole or absent,
   never partial.
2. **Lookup.** A hit must end at a page that holds a state: the scheduler walks the longest
   match back to the last page whose every state layer has the markers of every rank that
   wrote it (:func:`pages_with_state`; rank 0's marker names the degree). KV of the pages
   before it is loaded as usual; their states are not needed.
3. **Borrow.** Once the pages are held, the scheduler reads the last one's markers again (it
   may have been evicted and saved anew, without a state, between lookup and borrow); a
   page without them fails the request's (asynchronous) load, and vLLM computes it whole.
4. **Load.** The state group's blocks name only the hit's last block, where vLLM reads the
   state of a hit from; the worker checks the markers before copying
   (:class:`StateCopies`).

Where hostkv knows how a model's state splits over tensor-parallel ranks
(:data:`~hostkv.vllm.layout.CANONICAL_STATES`) a slot holds the whole state and each rank
copies its shares, so engines of every degree share the pages; otherwise the slot holds
each rank's bytes as vLLM keeps them and the degree is in the engine's namespace
(:class:`~hostkv.vllm.layout.StateLayout`). Saves are synchronous: vLLM may hand a
boundary block to another request at a later step.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hostkv.transfers import Transfer
from hostkv.vllm.layout import STATE_MARKER_BYTES, STATE_MARKER_PREFIX, EngineKV, StateLayout

__all__ = ["StateCopies", "offered_state_blocks", "pages_with_state", "slot_holds_state",
           "state_blocks_to_load"]

_NULL_BLOCK = 0


def _state_slots(kv: EngineKV, groups: Optional[Sequence[int]] = None
                 ) -> List[Tuple[int, StateLayout]]:
    """(page layer, state layout) of every state layer of ``groups`` (default: all state
    groups)."""
    return [(layer, kv.groups[g].state)  # type: ignore[misc]
            for g in (kv.state_groups if groups is None else groups)
            for layer in kv.groups[g].layers]


def slot_holds_state(slot: np.ndarray, state: StateLayout) -> bool:
    """Whether a layer's page slot (its bytes) holds a whole state: rank 0's marker names
    the degree that wrote it, and every rank of that degree marked its share. An opaque
    layout (:attr:`StateLayout.canonical` false) takes only its own degree's."""
    at = state.data_bytes
    first = slot[at:at + STATE_MARKER_BYTES].tobytes()
    if first[:-2] != STATE_MARKER_PREFIX or first[-2] != 0:
        return False
    degree = first[-1]
    if degree < 1 or at + degree * STATE_MARKER_BYTES > slot.shape[0]:
        return False
    if not state.canonical and degree != state.tp_world:
        return False
    return all(slot[at + r * STATE_MARKER_BYTES:at + (r + 1) * STATE_MARKER_BYTES].tobytes()
               == STATE_MARKER_PREFIX + bytes((r, degree)) for r in range(1, degree))


def pages_with_state(kv: EngineKV, pool: np.ndarray, pages: Sequence[int]) -> int:
    """How many of ``pages`` (a prefix's, in order) make the longest prefix that ends at a
    page holding every state layer's whole state (:func:`slot_holds_state`); 0 if none
    does.

    Args:
        kv: The engine's KV cache as pages.
        pool: The page pool as bytes (``HostKVCache.pages_array()``).
        pages: The prefix's pages.
    """
    slots = _state_slots(kv)
    if not slots:
        return len(pages)
    slot_bytes = pool.shape[1] // len(kv.layout.page_layers)
    for count in range(len(pages), 0, -1):
        page = pool[int(pages[count - 1])]
        # (A state layer is never a window layer: its slot is in the page.)
        if all(slot_holds_state(page[kv.layout.slot(layer)[1] * slot_bytes:
                                     (kv.layout.slot(layer)[1] + 1) * slot_bytes], state)
               for layer, state in slots):
            return count
    return 0


def offered_state_blocks(offers: Iterable[Tuple[int, int, int]], group: int, page_size: int,
                         start: int, end: int) -> List[int]:
    """A save's blocks of state group ``group`` for pages [start, end) of a request: the
    block vLLM offered this step for a page's end (its last token's state), else the null
    block (the page is saved without a state).

    Args:
        offers: vLLM's boundary-state offers for the request, (group, block, boundary).
    """
    at = {boundary: block for g, block, boundary in offers if g == group}
    return [at.get((page + 1) * page_size, _NULL_BLOCK) for page in range(start, end)]


def state_blocks_to_load(table: Sequence[int], start: int, end: int) -> List[int]:
    """A load's blocks of a state group for pages [start, end): the null block but for the
    last page's, where vLLM reads the state of a hit from (``table`` is the group's)."""
    return [_NULL_BLOCK] * (end - start - 1) + [int(table[end - 1])] if end > start else []


class StateCopies:
    """Copies of one rank's recurrent state of one state group between that group's blocks
    and page slots. A model has several state groups when it has more state layers than
    attention layers (vLLM makes groups of equal size: Qwen3-Next's three Gated DeltaNet
    layers of every four make three); each group has its own block table, and a block id
    of one group is another layer's memory in the next, so each group's layers are copied
    through its own blocks only.

    A rank's state goes into the slot in runs (:meth:`StateLayout.runs`): its shares of a
    whole state, or its bytes as they are. The copies run inline (a state is tens of
    kilobytes a layer); the transfer they answer is over.

    Args:
        pool: The page pool as bytes, [num_pages, page_bytes] (a uint8 tensor).
        kv: The engine's KV cache as pages.
        kv_caches: vLLM's per-layer caches; a state layer's is a list of its state
            tensors, each [num_blocks, *shape], or (what vLLM registers with a connector)
            one tensor of bytes, [num_blocks, ..., state bytes].
        rank: This worker's tensor-parallel rank.
        group: The state group (an index of ``kv.groups``).

    Raises:
        ValueError: a state layer's tensors are not what vLLM's spec declared.
    """

    def __init__(self, pool: torch.Tensor, kv: EngineKV,
                 kv_caches: Dict[str, object], rank: int, group: int) -> None:
        self.rank = rank
        self.group = group
        self.num_pages = pool.shape[0]
        self.page_bytes = pool.shape[1]
        self.slot_bytes = self.page_bytes // len(kv.layout.page_layers)
        # The flat pool (a copy slices it: the per-copy Python is most of a small state's
        # cost; see hostkv.vllm.state_bench), and the same host memory for reading markers.
        self.pool = pool.view(-1)           # a view or an error, never a copy
        self.pool_bytes = self.pool.numpy()
        # (slot's offset in a page, its layout, the layer's state tensors as [num_blocks,
        # bytes], and the pieces: (tensor, offset in its block's bytes, offset in the
        # slot, bytes))
        self.layers: List[Tuple[int, StateLayout, List[torch.Tensor],
                                List[Tuple[int, int, int, int]]]] = []
        for layer, state in _state_slots(kv, [group]):
            name = kv.layer_names[layer]
            tensors = kv_caches[name]
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)  # type: ignore[call-overload]
            if not self._matches(tensors, state):
                raise ValueError(f"hostkv: state layer {name}'s tensors are "
                                 f"{[tuple(t.shape) for t in tensors]} (strides "
                                 f"{[t.stride() for t in tensors]}, "
                                 f"{[str(t.dtype) for t in tensors]}); vLLM's spec declared "
                                 f"{list(state.shapes)} of {list(state.dtypes)} per block, "
                                 f"{state.rank_bytes} bytes")
            flat = [t.view(t.shape[0], -1).view(torch.uint8) for t in tensors]
            self.layers.append((kv.layout.slot(layer)[1] * self.slot_bytes, state, flat,
                                _pieces(state.runs(rank), [t.shape[1] for t in flat])))
        self.markers = {id(state): torch.frombuffer(bytearray(state.marker_bytes(rank)),
                                                    dtype=torch.uint8)
                        for _, state, _, _ in self.layers}

    @staticmethod
    def _matches(tensors: List[torch.Tensor], state: StateLayout) -> bool:
        """Whether a layer's tensors hold its state as the spec declares it: vLLM's own
        tensors (one a declared shape, each block's contiguous), or the connector's view of
        them (one tensor, each block's bytes contiguous, as many as the state's)."""
        if any(not t[0].is_contiguous() for t in tensors):
            return False
        if len(tensors) == 1 and tensors[0].dtype in (torch.int8, torch.uint8):
            return tensors[0][0].numel() == state.rank_bytes
        return (tuple(tuple(t.shape[1:]) for t in tensors) == state.shapes
                and tuple(str(t.dtype).replace("torch.", "") for t in tensors)
                == state.dtypes)

    def check(self, blocks: Sequence[int], pages: Sequence[int]) -> None:
        """Raises ValueError for a block or page out of range (before anything copies)."""
        num_blocks = min((t.shape[0] for _, _, ts, _ in self.layers for t in ts), default=0)
        for block, page in zip(blocks, pages):
            if not 0 <= int(block) < num_blocks or not 0 <= int(page) < self.num_pages:
                raise ValueError(f"hostkv: state block {block} or page {page} out of range "
                                 f"({num_blocks} blocks, {self.num_pages} pages)")

    def save(self, blocks: Sequence[int], pages: Sequence[int]) -> Transfer:
        """Writes block ``blocks[i]``'s state of every state layer into page ``pages[i]``
        (this rank's shares) with this rank's marker; a null block writes zeros for the
        marker (no state)."""
        moved = 0
        for block, page in zip(blocks, pages):
            block, base = int(block), int(page) * self.page_bytes
            for slot, state, tensors, pieces in self.layers:
                mark = base + slot + state.marker(self.rank)
                marker = self.pool[mark:mark + STATE_MARKER_BYTES]
                if block == _NULL_BLOCK:
                    marker.zero_()
                    continue
                for tensor, offset, at, size in pieces:
                    at += base + slot
                    self.pool[at:at + size].copy_(tensors[tensor][block, offset:offset + size])
                    moved += size
                marker.copy_(self.markers[id(state)])
        return Transfer.finished(moved)

    def load(self, pages: Sequence[int], blocks: Sequence[int]) -> Transfer:
        """Copies page ``pages[i]``'s state into block ``blocks[i]`` of every state layer
        (this rank's shares), null blocks skipped; the transfer fails (nothing of that page
        copied) where a page holds no whole state."""
        moved = 0
        for block, page in zip(blocks, pages):
            block, base = int(block), int(page) * self.page_bytes
            if block == _NULL_BLOCK:
                continue
            if any(not slot_holds_state(self.pool_bytes[base + slot:
                                                        base + slot + self.slot_bytes], state)
                   for slot, state, _, _ in self.layers):
                return Transfer.finished(moved, ValueError(
                    f"hostkv: page {page} holds no state of rank {self.rank}"))
            for slot, _, tensors, pieces in self.layers:
                for tensor, offset, at, size in pieces:
                    at += base + slot
                    tensors[tensor][block, offset:offset + size].copy_(self.pool[at:at + size])
                    moved += size
        return Transfer.finished(moved)


def _pieces(runs: Sequence[Tuple[int, int, int]], sizes: Sequence[int]
            ) -> List[Tuple[int, int, int, int]]:
    """A rank's runs (offset in its block's bytes, offset in the slot, bytes) cut where
    one of its tensors ends: (tensor, offset in that tensor's block, offset in the slot,
    bytes). ``sizes``: each tensor's bytes of a block, in vLLM's order."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces = []
    for source, target, size in runs:
        while size:
            tensor = max(i for i, start in enumerate(starts) if start <= source)
            offset = source - starts[tensor]
            take = min(size, sizes[tensor] - offset)
            pieces.append((tensor, offset, target, take))
            source, target, size = source + take, target + take, size - take
    return pieces
