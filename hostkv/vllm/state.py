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
   Every rank writes its part of each state layer's slot and its marker
   (:data:`~hostkv.vllm.layout.STATE_MARKER` after a state, zeros without one), so a slot
   never keeps a marker from an earlier page. The page is committed, as every page, once
   every rank confirmed the step: its state is then whole or absent, never partial.
2. **Lookup.** A hit must end at a page that holds a state: the scheduler walks the longest
   match back to the last page whose every marker is set (:func:`pages_with_state`). KV of
   the pages before it is loaded as usual; their states are not needed.
3. **Borrow.** Once the pages are held, the scheduler reads the last one's markers again (it
   may have been evicted and saved anew, without a state, between lookup and borrow); a
   page without them fails the request's (asynchronous) load, and vLLM computes it whole.
4. **Load.** The state group's blocks name only the hit's last block, where vLLM reads the
   state of a hit from; the worker checks the markers before copying
   (:class:`StateCopies`).

A state's bytes are each rank's shard as vLLM holds it, so pages with state mean the same
only to engines of one tensor-parallel degree: the degree is in the engine's namespace.
Saves are synchronous: vLLM may hand a boundary block to another request at a later step.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hostkv.transfers import Transfer
from hostkv.vllm.layout import STATE_MARKER, EngineKV, StateLayout

__all__ = ["StateCopies", "offered_state_blocks", "pages_with_state", "state_blocks_to_load"]

_MARKER = np.frombuffer(STATE_MARKER, dtype=np.uint8)
_NULL_BLOCK = 0


def _state_slots(kv: EngineKV, groups: Optional[Sequence[int]] = None
                 ) -> List[Tuple[int, StateLayout]]:
    """(page layer, state layout) of every state layer of ``groups`` (default: all state
    groups)."""
    return [(layer, kv.groups[g].state)  # type: ignore[misc]
            for g in (kv.state_groups if groups is None else groups)
            for layer in kv.groups[g].layers]


def pages_with_state(kv: EngineKV, pool: np.ndarray, pages: Sequence[int]) -> int:
    """How many of ``pages`` (a prefix's, in order) make the longest prefix that ends at a
    page holding every state layer's state (every rank's marker set); 0 if none does.

    Args:
        kv: The engine's KV cache as pages.
        pool: The page pool as bytes (``HostKVCache.pages_array()``).
        pages: The prefix's pages.
    """
    slots = _state_slots(kv)
    if not slots:
        return len(pages)
    slot_bytes = pool.shape[1] // kv.layout.num_layers
    size = len(STATE_MARKER)
    for count in range(len(pages), 0, -1):
        page = pool[int(pages[count - 1])]
        if all(np.array_equal(page[layer * slot_bytes + state.marker(rank):
                                   layer * slot_bytes + state.marker(rank) + size], _MARKER)
               for layer, state in slots for rank in range(state.tp_world)):
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

    The copies run inline (a state is tens of kilobytes a layer); the transfer they answer
    is over.

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
        slot_bytes = self.page_bytes // kv.layout.num_layers
        # Byte offsets into the flat pool, and each state tensor as [num_blocks, bytes]:
        # a copy is then one slice each side (the per-copy Python is most of a small
        # state's cost; see hostkv.vllm.state_bench).
        self.pool = pool.view(-1)           # a view or an error, never a copy
        self.marker = torch.frombuffer(bytearray(STATE_MARKER), dtype=torch.uint8)
        # (part's offset in a page, marker's offset in a page, the layer's state tensors
        # as [num_blocks, bytes])
        self.layers: List[Tuple[int, int, List[torch.Tensor]]] = []
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
            self.layers.append((layer * slot_bytes + state.part(rank)[0],
                                layer * slot_bytes + state.marker(rank),
                                [t.view(t.shape[0], -1).view(torch.uint8) for t in tensors]))

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
        num_blocks = min((t.shape[0] for _, _, ts in self.layers for t in ts), default=0)
        for block, page in zip(blocks, pages):
            if not 0 <= int(block) < num_blocks or not 0 <= int(page) < self.num_pages:
                raise ValueError(f"hostkv: state block {block} or page {page} out of range "
                                 f"({num_blocks} blocks, {self.num_pages} pages)")

    def save(self, blocks: Sequence[int], pages: Sequence[int]) -> Transfer:
        """Writes block ``blocks[i]``'s state of every state layer into page ``pages[i]``
        with this rank's marker; a null block writes zeros for the marker (no state)."""
        moved = 0
        size = len(STATE_MARKER)
        for block, page in zip(blocks, pages):
            block, base = int(block), int(page) * self.page_bytes
            for part, mark, tensors in self.layers:
                marker = self.pool[base + mark:base + mark + size]
                if block == _NULL_BLOCK:
                    marker.zero_()
                    continue
                at = base + part
                for tensor in tensors:
                    data = tensor[block]
                    self.pool[at:at + data.numel()].copy_(data)
                    at += data.numel()
                marker.copy_(self.marker)
                moved += at - base - part
        return Transfer.finished(moved)

    def load(self, pages: Sequence[int], blocks: Sequence[int]) -> Transfer:
        """Copies page ``pages[i]``'s state into block ``blocks[i]`` of every state layer,
        null blocks skipped; the transfer fails (nothing of that page copied) where a page
        holds no state of this rank."""
        moved = 0
        size = len(STATE_MARKER)
        for block, page in zip(blocks, pages):
            block, base = int(block), int(page) * self.page_bytes
            if block == _NULL_BLOCK:
                continue
            if any(not torch.equal(self.pool[base + mark:base + mark + size], self.marker)
                   for _, mark, _ in self.layers):
                return Transfer.finished(moved, ValueError(
                    f"hostkv: page {page} holds no state of rank {self.rank}"))
            for part, _, tensors in self.layers:
                at = base + part
                for tensor in tensors:
                    target = tensor[block]
                    target.copy_(self.pool[at:at + target.numel()])
                    at += target.numel()
                moved += at - base - part
        return Transfer.finished(moved)
