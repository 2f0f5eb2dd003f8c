"""WorkerView: one engine worker's sequences over a shared HostKVCache.

The engine's loop, and what each step promises:

1. ``allocate_pages_for_sequences_with_prefix(requests)`` - one lock for the whole batch:
   each request borrows the longest cached prefix of its prompt (always leaving at least
   one token to compute), gets fresh pages for the rest, and is recorded in the segment.
   All or nothing: on any shortage nothing changes and the error says what ran out.
2. The engine writes the KV of every token from ``allocation.reused_tokens`` on into its own
   pages; the first ``num_shared_pages`` pages are shared with other sequences and read-only.
3. ``append_tokens(seq_ids, token_ids)`` - one decode step; a page is allocated only when a
   token does not fit. ``None`` marks a token whose id is unknown: that sequence stops being
   cacheable from there on, the others are unaffected.
4. ``commit(seq_ids)`` - publishes full pages to every process. Two-phase publish: write the
   KV first, then commit; a committed page is read by other processes at once. Pass
   ``num_tokens`` when only a leading part of a sequence's KV is written yet.
5. ``release(seq_ids, commit=True)`` - commits, then drops every reference the sequence holds.

This module is pure Python: it keeps policy (what to reuse and commit) and the view's
sequences by id; every step is one call into _sequences, which also fills and steps the
per-sequence state (tokens, page table: _viewstate.ViewSequence) without Python per sequence.
SequenceRequest and SequenceAllocation, its value types, are compiled (hostkv._requests) and
re-exported here: one of each per sequence, filled and read from C.

The view's bookkeeping changes with the shared state or not at all. A sequence is named to
the compiled layer by its record, its id and the record's generation, which the compiled
layer checks on every use, so a stale name is a SequenceError, never a change to a record
another view has since been given. And an exception that lands between a compiled call and
the bookkeeping after it (a KeyboardInterrupt, a MemoryError) leaves the view marked
"unsettled": its next call first reads back the records the segment holds for this view and
settles on them, so the view and the segment never disagree about what it holds:

- an interrupted allocation is undone whole: its sequences are released without commit
  (the caller, who got an exception, never learned their pages);
- an interrupted release drops the sequences the segment no longer holds;
- a decode step's bookkeeping is done by its compiled call, in C that runs no Python
  code once the step's pages are taken: interrupted, the step happened whole or not at all;
- an interrupted commit keeps what it cached (commit is idempotent).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

import numpy as np

from hostkv import _sequences, _viewstate
from hostkv._requests import SequenceAllocation, SequenceRequest
from hostkv._viewstate import ViewSequence
from hostkv._tokens import BYTES_LIKE
from hostkv._validate import is_bool, is_int
from hostkv.cache import HostKVCache
from hostkv.errors import HostKVError, SequenceError

__all__ = [
    "PrefixSequenceState",
    "SequenceAllocation",
    "SequenceRequest",
    "WorkerView",
    "WorkerViewStats",
]


@dataclasses.dataclass(frozen=True)
class PrefixSequenceState:
    """A snapshot of one live sequence.

    Attributes:
        seq_id: Its id.
        namespace: Its namespace.
        num_tokens: Tokens so far (prompt plus decoded).
        tokens: Their ids (np.int32; 0 where a token was appended as None).
        reused_tokens: Prompt tokens borrowed from the cache at allocation.
        committed_tokens: Leading tokens whose pages the cache holds for it.
        cacheable_tokens: Leading tokens with known ids (commit never goes past this).
        pages: Its page table (np.int32), ceil(num_tokens / page_size) pages.
    """

    seq_id: int
    namespace: int
    num_tokens: int
    tokens: np.ndarray
    reused_tokens: int
    committed_tokens: int
    cacheable_tokens: int
    pages: np.ndarray


@dataclasses.dataclass(frozen=True)
class WorkerViewStats:
    """Counters of one WorkerView (the segment-wide ones are in HostKVCache.stats()).

    Each call's compiled step counts what it did; a call interrupted after that step
    (then undone by the view's next call) stays counted.

    Attributes:
        requests: Sequences allocated.
        prompt_tokens: Their prompt tokens.
        reused_tokens: Prompt tokens served from the cache.
        committed_pages: Pages this view's commits put in (or found in) the cache.
        live_sequences: Sequences allocated and not yet released.
    """

    requests: int
    prompt_tokens: int
    reused_tokens: int
    committed_pages: int
    live_sequences: int


_fork_epoch = 0

# Each WorkerView of a process stamps its records with its own number, so that after an
# interrupt it can find them again (several views of one process share one lease). Numbers
# wrap within int32; only views alive at the same time need distinct ones.
_view_numbers = itertools.count(1)


def _next_view_number() -> int:
    return next(_view_numbers) % (2**31 - 1) + 1


# What a view's call was doing when it may have been interrupted (see the module docstring):
# the ids an allocation may have recorded, to undo; the other calls undo nothing.
_NOTHING_TO_UNDO: Sequence[int] = ()
_NO_TOKENS = np.empty(0, dtype=np.int32)


def _after_fork_in_child() -> None:
    global _fork_epoch
    _fork_epoch += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


class WorkerView:
    """One worker's sequences on a shared cache: batch allocation with prefix reuse,
    decode-token accumulation, commit and release (see the module docstring for the loop).

    Not thread-safe: one view per worker thread (several views may share one cache).
    Usable as a context manager; close() releases live sequences without committing.
    """

    def __init__(self, cache: HostKVCache) -> None:
        """Creates a view on an open cache that holds a lease."""
        if not isinstance(cache, HostKVCache):
            raise TypeError(f"WorkerView needs a HostKVCache, got {type(cache).__name__}")
        if cache.closed:
            raise ValueError("the cache is closed")
        self._cache = cache
        self._segment = cache._segment
        self._page_size = cache.config.page_size
        self._sequences: Dict[int, ViewSequence] = {}
        self._fork_epoch = _fork_epoch
        self._closed = False
        self._number = _next_view_number()
        # Not None while a call that changes shared state has not finished its bookkeeping:
        # the ids an interrupted allocation may have recorded.
        self._in_flight: Optional[Sequence[int]] = None
        # The compiled calls' one argument: segment, sequences, policy, and the counters.
        self._state = _viewstate.ViewState(
            self._segment, self._sequences, self._page_size, cache.config.num_pages,
            cache.config.enable_prefix_reuse, cache.config.prefix_min_reuse_pages,
            cache.config.prefix_min_store_pages, self._number)

    # -- validation ----------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise ValueError("the WorkerView is closed")
        if self._fork_epoch != _fork_epoch:
            raise SequenceError(
                "this WorkerView belongs to the process that created it; a forked child "
                "must create its own WorkerView (its sequences are the parent's)")
        if self._in_flight is not None:
            self._settle()

    def _settle(self) -> None:
        """Brings the bookkeeping in line with the segment after an interrupted call.

        Idempotent: interrupted itself, it runs again at the next call."""
        in_flight = self._in_flight
        if in_flight is None:
            return
        for seq_id in in_flight:
            self._sequences.pop(seq_id, None)
        held = {record: (generation, seq_id, pages) for record, generation, seq_id, pages
                in _sequences.view_sequences(self._segment, self._number)}
        for seq in list(self._sequences.values()):
            found = held.get(seq.record)
            if found is None or found[0] != seq.generation or found[1] != seq.seq_id:
                del self._sequences[seq.seq_id]          # its release went through
                continue
            del held[seq.record]
        # Records of this view that no bookkeeping names: an interrupted allocation's.
        # One per mutation, as close() does: the undo log always has room for one.
        for record, (generation, seq_id, _pages) in held.items():
            _sequences.release(self._segment, [record], [seq_id], [generation], [_NO_TOKENS],
                               [_NO_TOKENS], [0], [0])
        self._in_flight = None

    def _change(self, in_flight: Sequence[int], operation: Any, *args: Any) -> Any:
        """Runs a compiled call that changes shared state, the view marked unsettled until
        the caller's bookkeeping after it is done (the caller then clears _in_flight).

        If the call was short of pages while a dead process still held some (it then changed
        nothing), reaps the dead and runs it again. Processes that keep dying in between get
        it a few tries, then the shortage (an OutOfPagesError)."""
        self._in_flight = in_flight
        try:
            try:
                return operation(*args)
            except _sequences.SweepNeeded:
                for retry in range(2):
                    self._cache.reap()
                    try:
                        return operation(*args)
                    except _sequences.SweepNeeded:
                        if retry == 1:
                            raise
        except (HostKVError, ValueError):
            # The compiled calls raise these only having changed nothing (all or nothing):
            # no need to read the segment back.
            self._in_flight = None
            raise

    # -- the engine's loop -------------------------------------------------------------------------

    def allocate_pages_for_sequences_with_prefix(
            self, requests: Sequence[SequenceRequest]) -> List[SequenceAllocation]:
        """Allocates pages for a batch of new sequences, reusing cached prefixes.

        Args:
            requests: SequenceRequests; ids must be new to this view and distinct.

        Returns:
            One SequenceAllocation per request, in order.

        Raises:
            SequenceError: a bad, duplicate or live id, or an empty prompt.
            ValueError: bad token ids or namespace.
            OutOfPagesError: not enough pages even after evicting every unlocked cached page.
            CapacityError: sequence or page-list records ran out.
            Nothing changes when any of these is raised.
        """
        if self._in_flight is not None or self._closed or self._fork_epoch != _fork_epoch:
            self._check_usable()
        if type(requests) not in (list, tuple) and (
                isinstance(requests, SequenceRequest) or not isinstance(requests, Sequence)):
            raise SequenceError("allocate needs a list of SequenceRequest")
        if not requests:
            return []
        # The compiled call checks the requests (in the order the docstring lists the
        # errors), reads their tokens into arrays of the view's own, allocates, records the
        # sequences in self._sequences and counts them; `seq_ids` names the ids it has
        # checked to be new, in case it is interrupted.
        seq_ids: List[int] = []
        allocations = self._change(seq_ids, _sequences.allocate_requests, self._state,
                                   requests, seq_ids)
        self._in_flight = None
        return allocations

    def hold_cached_pages(
            self, requests: Sequence[SequenceRequest]) -> List[SequenceAllocation]:
        """Holds the cached pages of each request's tokens without using them: for a tier that
        copies cached pages out (hostkv.remote's write-on-evict), not for an engine.

        Each request becomes a live sequence holding the longest cached prefix of its full
        pages, so none of them can be evicted or rewritten until it is released (release
        it with commit=False). Unlike an allocation it takes no fresh page, evicts nothing,
        refreshes no recency and counts in no lookup stats: holding the coldest pages does
        not change which pages are evicted next. Its reused_tokens may cover all of the
        tokens; the page_table lists only the held pages, and the sequence is the held
        tokens alone (appending to it is the engine's business, not a holder's).

        Raises:
            SequenceError: a bad, duplicate or live id, or no tokens.
            ValueError: bad token ids or namespace.
            CapacityError: sequence records ran out. Nothing changes when any is raised.
        """
        self._check_usable()
        if type(requests) not in (list, tuple) and (
                isinstance(requests, SequenceRequest) or not isinstance(requests, Sequence)):
            raise SequenceError("hold_cached_pages needs a list of SequenceRequest")
        # The same checks, order and messages as an allocation's (no pool size: a hold takes
        # no page).
        seq_ids: List[int] = []
        token_arrays, namespaces = _sequences.check_requests(requests, self._sequences, seq_ids)
        if not requests:
            return []
        results = self._change(
            seq_ids, _sequences.hold, self._segment, token_arrays,
            np.array(seq_ids, dtype=np.int64), namespaces, self._number)
        page_size = self._page_size
        holds = []
        for seq_id, tokens, namespace, (record, held, table, generation) in zip(
                seq_ids, token_arrays, namespaces, results):
            table.flags.writeable = False
            self._sequences[seq_id] = ViewSequence(seq_id, record, generation, namespace,
                                                   tokens[:held * page_size].copy(),
                                                   held * page_size, held, table)
            holds.append(SequenceAllocation(seq_id, held * page_size, table, page_size))
        self._in_flight = None
        return holds

    def append_tokens(self, seq_ids: Sequence[Any], token_ids: Sequence[Optional[int]]) -> None:
        """Records one decode step: one token id (or None, if unknown) per sequence.

        A sequence gets a new page only when its token does not fit its last page; the step
        is all or nothing (OutOfPagesError leaves every sequence as it was).

        Raises:
            SequenceError: unknown or repeated ids, or the two lists differ in length.
            ValueError: a token id outside [0, 2**31) or not an integer.
        """
        self._check_usable()
        sequences = _sequences.live_of(self._sequences, seq_ids, "append_tokens")
        if type(token_ids) is not list and type(token_ids) is not tuple:
            # Read once, before the call: a step short of pages runs again after a reap.
            token_ids = _sequences.token_list(token_ids)
        self._change(_NOTHING_TO_UNDO, _sequences.append_tokens, self._segment, sequences,
                     token_ids, self._page_size)
        self._in_flight = None

    def _commit_plan(self, sequences: List[ViewSequence], num_tokens: Any) -> List[int]:
        """What commit would cache: per sequence, its full known pages (0: nothing new), by
        the commit rule (_viewstate.pages_to_commit, which release_sequences applies in C
        with every known token)."""
        limits: List[Optional[int]]
        if num_tokens is None:
            limits = [None] * len(sequences)
        elif is_int(num_tokens):
            limits = [int(num_tokens)] * len(sequences)
        else:
            if isinstance(num_tokens, BYTES_LIKE) or not isinstance(num_tokens, Iterable) or (
                    isinstance(num_tokens, np.ndarray) and num_tokens.ndim != 1):
                raise SequenceError("num_tokens must be None, an int, or one int per sequence, "
                                    f"got {num_tokens!r}")
            values = list(num_tokens)
            for n in values:
                if not is_int(n):
                    # No int() of a float or a str: 7.9 is not 7 tokens, "8" is not 8.
                    raise SequenceError(f"num_tokens must be integers, got {n!r}")
            limits = [int(n) for n in values]
            if len(limits) != len(sequences):
                raise SequenceError(f"{len(sequences)} sequence ids but {len(limits)} num_tokens")
        for seq, limit in zip(sequences, limits):
            if limit is not None and limit < 0:
                raise SequenceError(f"sequence {seq.seq_id}: num_tokens must be >= 0, got {limit}")
        if not self._state.reuse_enabled:
            return [0] * len(sequences)
        page_size = self._page_size
        state = self._state
        counts = []
        for seq, limit in zip(sequences, limits):
            known = seq.cacheable_tokens if limit is None else min(seq.cacheable_tokens, limit)
            counts.append(state.pages_to_commit(known // page_size, seq.committed_pages))
        return counts

    def commit(self, seq_ids: Sequence[Any], num_tokens: Union[None, int, Sequence[int]] = None
               ) -> List[int]:
        """Makes the sequences' full pages reusable by every process now. Idempotent.

        Call it only after the KV of those tokens is written (two-phase publish).

        Args:
            seq_ids: Live sequences.
            num_tokens: How many leading tokens have their KV written (one int for all, or
                one per sequence); default: all known tokens.

        Returns:
            Per sequence, how many of its leading pages the cache now holds (best effort:
            when node records run out even after eviction, a sequence's new pages stay
            uncached, and the call still succeeds).

        Raises:
            SequenceError: unknown or repeated ids, or bad num_tokens.
            CapacityError: the batch needs more undo log than the segment has (resource
                "undo log"; a configuration error, not best effort: nothing changed, commit
                fewer sequences at a time or raise undo_log_capacity).
        """
        self._check_usable()
        sequences = _sequences.live_of(self._sequences, seq_ids, "commit")
        counts = self._commit_plan(sequences, num_tokens)
        todo = [(seq, count) for seq, count in zip(sequences, counts) if count]
        if todo:
            # The compiled call also records (and counts) what each sequence now has cached.
            self._change(_NOTHING_TO_UNDO, _sequences.commit_view_sequences, self._state,
                         [seq for seq, _ in todo], [count for _, count in todo])
            self._in_flight = None
        return [seq.committed_pages for seq in sequences]

    def release(self, seq_ids: Sequence[Any], commit: bool = True) -> List[int]:
        """Ends sequences: commits their full known pages (unless commit=False), then drops
        every reference they hold. Their ids become free for reuse.

        Args:
            seq_ids: Live sequences.
            commit: True or False (anything else is a ValueError).

        Returns:
            Per sequence, how many of its leading pages the cache held for it at the end.

        Raises:
            SequenceError: unknown or repeated ids.
            CapacityError: the batch needs more undo log than the segment has (resource
                "undo log"): nothing changed, every sequence is still live; release fewer
                at a time (close() releases one per mutation).
        """
        if self._in_flight is not None or self._closed or self._fork_epoch != _fork_epoch:
            self._check_usable()
        if commit is not True and commit is not False and not is_bool(commit):
            # A truthy "no" must not commit.
            raise ValueError(f"commit must be True or False, got {commit!r}")
        sequences = _sequences.live_of(self._sequences, seq_ids, "release")
        # The compiled call works out what each sequence commits (as _commit_plan would),
        # drops the released sequences from self._sequences and counts what they committed.
        cached = self._change(_NOTHING_TO_UNDO, _sequences.release_sequences, self._state,
                              sequences, bool(commit))
        self._in_flight = None
        return cached

    # -- reading ---------------------------------------------------------------------------------

    def page_table(self, seq_id: int) -> np.ndarray:
        """The sequence's pages in token order (a read-only view, valid until its next step)."""
        self._check_usable()
        seq = _sequences.live_of(self._sequences, [seq_id], "page_table")[0]
        view = seq.pages[:seq.num_pages]
        view.flags.writeable = False
        return view

    def state(self, seq_id: int) -> PrefixSequenceState:
        """A snapshot of the sequence's prefix state."""
        self._check_usable()
        seq = _sequences.live_of(self._sequences, [seq_id], "state")[0]
        return PrefixSequenceState(
            seq_id=seq.seq_id, namespace=seq.namespace, num_tokens=seq.num_tokens,
            tokens=seq.tokens[:seq.num_tokens].copy(), reused_tokens=seq.reused_tokens,
            committed_tokens=seq.committed_pages * self._page_size,
            cacheable_tokens=seq.cacheable_tokens, pages=seq.pages[:seq.num_pages].copy())

    @property
    def live_sequences(self) -> List[int]:
        """Ids of the view's live sequences."""
        if (self._in_flight is not None and not self._closed and self._fork_epoch == _fork_epoch
                and not self._cache.closed):
            self._settle()
        return list(self._sequences)

    def stats(self) -> WorkerViewStats:
        """This view's counters."""
        state = self._state
        return WorkerViewStats(requests=state.requests, prompt_tokens=state.prompt_tokens,
                               reused_tokens=state.reused_tokens,
                               committed_pages=state.committed_pages,
                               live_sequences=len(self._sequences))

    # -- closing ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Releases every live sequence without committing (their pages may be partial)."""
        if self._closed:
            return
        if ((self._sequences or self._in_flight is not None) and self._fork_epoch == _fork_epoch
                and not self._cache.closed):
            if self._in_flight is not None:
                self._settle()
            # One at a time: a batch of everything might need more undo log than there is.
            for seq_id in list(self._sequences):
                self.release([seq_id], commit=False)
        self._sequences.clear()
        self._closed = True

    def __enter__(self) -> "WorkerView":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
