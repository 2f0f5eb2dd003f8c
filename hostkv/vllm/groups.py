"""Copies of an engine whose layers come in KV-cache groups, each with its own block table.

vLLM's hybrid KV-cache manager gives each group of layers (full attention, sliding window,
chunked-local attention) a block table of its own: block ``b`` of a full-attention layer
and block ``b`` of a sliding-window layer are different tokens. A page is still one block
of every layer (``hostkv.vllm.layout``), so a step's copy of a page moves, for each group,
the group's layers from the block that group's table names. :class:`GroupCopies` builds one
:class:`hostkv.copy_engine.CopyEngine` per arithmetic run of a group's page layers (one
strided view of the pool each) and hands each its group's blocks.

A windowed group's table (sliding window, chunked-local attention) names vLLM's null block
for the blocks that fell out of the layers' span: a load skips them (vLLM never reads
them), a save refuses them (the page's KV for those layers is gone, so the page cannot be
written).

With window parts (``KVLayout.window_layers``) a windowed group's layers live in the
pages' parts, not in the pages: its engines run over the part pool, page ``i``'s bytes at
part ``parts[i]``. A save skips those layers of a page without a part (it is committed
without them, and a hit never needs them: ``hostkv.vllm.window``); a load of a kept block
whose page has no part fails (the scheduler promised one). A recurrent-state group's layers
are copied by
:class:`hostkv.vllm.state.StateCopies`: a null block there saves a page without a state,
and loads nothing.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from hostkv.config import KVLayout
from hostkv.copy_engine import CopyEngine
from hostkv.transfers import Transfer
from hostkv.vllm.layout import EngineKV, layer_runs
from hostkv.vllm.state import StateCopies

__all__ = ["GroupCopies", "GroupTransfer", "NULL_BLOCK", "real_blocks"]

# vLLM's block pool hands out block 0 as the null block: never a request's KV.
NULL_BLOCK = 0


def real_blocks(groups: Sequence[Sequence[int]], with_null: Sequence[int]) -> List[int]:
    """Every block of every group, but the null blocks of the groups ``with_null``
    (windowed groups, state: :attr:`EngineKV.null_groups`), which are never KV."""
    return [b for g, blocks in enumerate(groups) for b in blocks
            if g not in with_null or b != NULL_BLOCK]


class GroupTransfer:
    """The transfers of one step's copy over every group, as one: done when all are, and
    failed if any failed. The interface of :class:`hostkv.transfers.Transfer`."""

    def __init__(self, parts: List[Transfer]) -> None:
        self.parts = parts
        self.nbytes = sum(part.nbytes for part in parts)

    @property
    def error(self) -> Optional[BaseException]:
        """The first part's error, once done; None if every part succeeded."""
        return next((part.error for part in self.parts if part.error is not None), None)

    @property
    def seconds(self) -> float:
        """The parts' copy time, summed."""
        return sum(part.seconds for part in self.parts)

    def done(self) -> bool:
        """True once every part is over; never blocks."""
        return all(part.done() for part in self.parts)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until every part is over (``timeout`` for each); True if all are."""
        return all([part.wait(timeout) for part in self.parts])

    def wait_all_layers(self) -> None:
        """For a load: orders what the engine runs next after every part's copies."""
        for part in self.parts:
            part.wait_all_layers()


def _submit_all(parts: List[Transfer],
                submits: Sequence[Callable[[], Transfer]]) -> List[Transfer]:
    """parts plus the transfer of each submit. If a submit raises, the transfers already
    started are waited for before the error goes up: the caller then frees the blocks and
    pages, which no copy may still be reading or writing."""
    parts = list(parts)
    try:
        for submit in submits:
            parts.append(submit())
    except BaseException:
        for part in parts:
            part.wait()
        raise
    return parts


class GroupCopies:
    """Copies between an engine's grouped KV blocks and hostkv's pages.

    Args:
        pool: The page pool (``HostKVCache.pages_tensor()``).
        parts_pool: The window parts (``HostKVCache.parts_tensor()``), with a layout that
            has window layers; else None.
        kv: The engine's KV cache as hostkv pages (its groups and layers).
        kv_caches: vLLM's per-layer KV tensors, by layer name.
        heads: (first, stop) of this rank's KV heads.
        writes: False for a rank whose saves move nothing (of the K/V; every rank writes
            its part of a state).
        asynchronous: As :class:`CopyEngine` takes it.
        rank: This worker's tensor-parallel rank (its part of a state).

    Raises:
        ValueError: as :class:`CopyEngine` raises for a tensor it cannot map.
    """

    def __init__(self, pool: torch.Tensor, kv: EngineKV, kv_caches: Dict[str, torch.Tensor],
                 heads: Tuple[int, int], writes: bool, asynchronous: bool,
                 rank: int = 0, parts_pool: Optional[torch.Tensor] = None) -> None:
        self.kv = kv
        layout = kv.layout
        if bool(layout.window_layers) != (parts_pool is not None):
            raise ValueError("hostkv: window layers need the part pool, and only they do")
        # The page's and the part's layers, each a layout of its own for the copy engine.
        pools = {"page": (pool, KVLayout(len(layout.page_layers), layout.num_kv_heads,
                                         layout.head_dim, layout.dtype, layout.kind)),
                 "part": (parts_pool, KVLayout(max(1, len(layout.window_layers)),
                                               layout.num_kv_heads, layout.head_dim,
                                               layout.dtype, layout.kind))}
        self.engines: List[Tuple[int, CopyEngine]] = []
        # The groups whose engines index the part pool.
        self.in_parts: Set[int] = set()
        runs = []
        for index, group in enumerate(kv.groups):
            if group.kind == "state":
                continue
            where = {layout.slot(layer)[0] for layer in group.layers}
            if len(where) != 1:
                raise ValueError(f"hostkv: group {index}'s layers are in both the page and "
                                 "the window part")
            where_one = where.pop()
            if where_one == "part":
                self.in_parts.add(index)
            # Runs over the slots; the layers of a run are the group's in that order.
            slot_of = {layout.slot(layer)[1]: layer for layer in group.layers}
            for run in layer_runs(sorted(slot_of)):
                runs.append((index, where_one, run, [slot_of[s] for s in range(*run)]))
        # One per state group, each through its own group's blocks.
        self.states: List[StateCopies] = []
        # On a GPU the engines share one budget of staging (each rounds up to a page), and
        # the first registers the pool for all.
        staging = None
        # (Only the engines' K/V tensors: a state layer's cache may be a list of tensors.)
        if any(kv_caches[kv.layer_names[i]].device.type == "cuda"
               for _, _, _, layers in runs for i in layers):
            from hostkv.cuda_copy import DEFAULT_STAGING_BYTES

            staging = DEFAULT_STAGING_BYTES // len(runs)
        try:
            registered: Set[str] = set()
            for index, where, run, layers in runs:
                tensors = [kv_caches[kv.layer_names[i]] for i in layers]
                target, target_layout = pools[where]
                whole = (0, target_layout.num_layers, 1)
                engine = CopyEngine(target, target_layout, kv.page_size, tensors,
                                    kv.block_layout, heads=heads, writes=writes,
                                    asynchronous=asynchronous,
                                    layers=None if run == whole else run,
                                    staging_bytes=staging, register=where not in registered)
                registered.add(where)
                self.engines.append((index, engine))
            pool_bytes = pool.view(pool.shape[0], -1).view(torch.uint8)
            self.states = [StateCopies(pool_bytes, kv, kv_caches, rank, g)
                           for g in kv.state_groups]
        except BaseException:
            self.close()
            raise
        self.windowed = set(kv.windowed_groups)

    def _pairs(self, group: int, blocks: Sequence[int], pages: Sequence[int],
               parts: Optional[Sequence[int]], saving: bool) -> Tuple[List[int], List[int]]:
        if group in self.in_parts:
            # The group's bytes are the pages' parts.
            if parts is None or len(parts) != len(pages):
                raise ValueError(f"hostkv: a copy of window group {group} needs a part for "
                                 f"each of its {len(pages)} pages, got {parts}")
            if not saving and any(b != NULL_BLOCK and q < 0 for b, q in zip(blocks, parts)):
                raise ValueError(f"hostkv: a load of window group {group} reads a page "
                                 f"without a part: parts {list(parts)[:16]}")
            # A page without a part is saved without those layers.
            kept = [(b, q) for b, q in zip(blocks, parts) if q >= 0]
            blocks, pages = [b for b, _ in kept], [q for _, q in kept]
        if group not in self.windowed or NULL_BLOCK not in blocks:
            return list(blocks), list(pages)
        if saving:
            raise ValueError(f"hostkv: a save of windowed group {group} names vLLM's null "
                             f"block (KV out of the layers' span is gone): {list(blocks)[:16]}")
        kept = [(b, p) for b, p in zip(blocks, pages) if b != NULL_BLOCK]
        return [b for b, _ in kept], [p for _, p in kept]

    def _check(self, blocks: Sequence[Sequence[int]], pages: Sequence[int]) -> None:
        if len(blocks) != len(self.kv.groups) or any(len(b) != len(pages) for b in blocks):
            raise ValueError(f"hostkv: blocks of {[len(b) for b in blocks]} for "
                             f"{len(self.kv.groups)} groups and {len(pages)} pages")

    def _plans(self, blocks: Sequence[Sequence[int]], pages: Sequence[int],
               parts: Optional[Sequence[int]],
               saving: bool) -> List[Tuple[CopyEngine, List[int], List[int]]]:
        """Each engine's (blocks, pages or parts), every index checked before any group
        copies."""
        self._check(blocks, pages)
        plans = [(engine, *self._pairs(g, blocks[g], pages, parts, saving))
                 for g, engine in self.engines]
        for engine, b, p in plans:
            engine._indices(b, p)
        for state in self.states:
            state.check(blocks[state.group], pages)
        return plans

    def _state_parts(self, blocks: Sequence[Sequence[int]], pages: Sequence[int],
                     saving: bool) -> List[Transfer]:
        return [state.save(blocks[state.group], pages) if saving
                else state.load(pages, blocks[state.group]) for state in self.states]

    def submit_save(self, blocks: Sequence[Sequence[int]], pages: Sequence[int],
                    parts: Optional[Sequence[int]] = None) -> GroupTransfer:
        """Starts copying, for every group, its block ``blocks[group][i]`` of the group's
        layers into page ``pages[i]`` (see :meth:`CopyEngine.submit_save`), a window
        group's into part ``parts[i]`` (-1: none, those layers not saved); a state group's
        null block saves the page without a state.

        Raises:
            ValueError: lengths that differ, an index out of range, no parts where window
                layers need them, or a null block in a windowed group where a part would
                be written; nothing was copied.
        """
        plans = self._plans(blocks, pages, parts, saving=True)
        parts = self._state_parts(blocks, pages, saving=True)
        submits = [functools.partial(engine.submit_save, b, p) for engine, b, p in plans]
        return GroupTransfer(_submit_all(parts, submits))

    def submit_load(self, pages: Sequence[int], blocks: Sequence[Sequence[int]],
                    parts: Optional[Sequence[int]] = None) -> GroupTransfer:
        """Starts copying page ``pages[i]`` into every group's block ``blocks[group][i]``
        (a window group's from part ``parts[i]``), skipping the null blocks of windowed
        and state groups (see :meth:`CopyEngine.submit_load`). A page without the state a
        load asks for fails the transfer.

        Raises:
            ValueError: lengths that differ, an index out of range, or a kept block of a
                window group whose page has no part; nothing was copied.
        """
        plans = self._plans(blocks, pages, parts, saving=False)
        parts = self._state_parts(blocks, pages, saving=False)
        submits = [functools.partial(engine.submit_load, p, b) for engine, b, p in plans]
        return GroupTransfer(_submit_all(parts, submits))

    def copy_calls(self) -> int:
        """Copy calls every engine made so far (DMA calls on a GPU)."""
        return sum(engine.stats().copy_calls for _, engine in self.engines)

    def registration(self):
        """The page pool's registration with CUDA, by the first engine over it (see
        :meth:`CopyEngine.registration`); None on a CPU. (With window parts the first
        engine over the part pool registers that pool.)"""
        return next((engine.registration() for g, engine in self.engines
                     if g not in self.in_parts), None)

    def close(self) -> None:
        """Closes every engine, the first (which registered the pool with CUDA) last:
        the others' copies must be over before the pool is unregistered."""
        for _, engine in reversed(self.engines):
            engine.close()
