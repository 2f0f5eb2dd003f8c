# cython: language_level=3, embedsignature=True
"""A WorkerView's compiled bookkeeping, process-private: its sequences (ViewSequence) and
what it hands each compiled call (ViewState), stepped and filled in C without Python per
sequence. What to do with them (the view's policy) stays in worker_view.py; the one rule
both sides apply, which pages a commit caches, is pages_to_commit (_viewstate.pxd).
"""

from collections.abc import Iterable

cimport cython

import numpy as np
cimport numpy as cnp

from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.string cimport memcpy

from hostkv._segment cimport Segment

from hostkv._tokens import BYTES_LIKE as _BYTES_LIKE, as_seq_id
from hostkv.errors import SequenceError

cdef object INT64_MIN = -(2**63), INT64_MAX = 2**63 - 1

cnp.import_array()


@cython.final                     # no subclass can skip filling it
@cython.auto_pickle(False)        # names a record of this process's view: never pickled
cdef class ViewSequence:
    """A WorkerView's own bookkeeping of one live sequence (process-private).

    The segment's record is named by (record, seq_id, generation). Compiled so that the
    view's calls fill, step and release these without Python per sequence; what to do with
    them (the view's policy) stays in worker_view.py.

    Attributes:
        seq_id, record, generation, namespace: the sequence and its segment record (the
            record's generation at allocation names this use of it).
        tokens: its token ids (np.int32, the view's own, never the caller's); the first
            num_tokens are used, the rest is room (grown by doubling).
        num_tokens: tokens so far; cacheable_tokens: leading tokens with known ids.
        reused_tokens: prompt tokens borrowed at allocation.
        committed_pages: leading pages the cache holds for it.
        pages: its page table (np.int32); the first num_pages are used. The allocation's
            table is shared with the caller read-only, so a step never writes into it: it
            grows into an array of the view's own first.
    """

    def __init__(self, int64_t seq_id, int64_t record, int64_t generation, uint64_t namespace,
                 cnp.ndarray tokens, int64_t reused_tokens, int64_t reused_pages,
                 cnp.ndarray pages):
        if not (plain_int32(tokens) and plain_int32(pages)):
            raise ValueError("a ViewSequence needs contiguous, aligned, native-order 1-D "
                             "np.int32 tokens and pages")
        fill_view_sequence(self, seq_id, record, generation, namespace, tokens, reused_tokens,
                           reused_pages, pages)

    @property
    def namespace(self):
        return self._namespace


cdef bint plain_int32(cnp.ndarray arr) noexcept:
    """A contiguous, aligned, native-order 1-D np.int32 array (read raw by the C code)."""
    return (arr is not None and cnp.PyArray_TYPE(arr) == cnp.NPY_INT32
            and cnp.PyArray_NDIM(arr) == 1 and cnp.PyArray_IS_C_CONTIGUOUS(arr)
            and cnp.PyArray_ISNOTSWAPPED(arr) and cnp.PyArray_ISALIGNED(arr))


cdef int check_filled(ViewSequence seq) except -1:
    """Refuses a ViewSequence made without its __init__ (its arrays are None)."""
    if seq.tokens is None or seq.pages is None:
        raise ValueError("this ViewSequence was never filled (made without __init__)")
    return 0


cdef int fill_view_sequence(ViewSequence seq, int64_t seq_id, int64_t record, int64_t generation,
                            uint64_t namespace, cnp.ndarray tokens, int64_t reused_tokens,
                            int64_t reused_pages, cnp.ndarray pages) except -1:
    seq.seq_id = seq_id
    seq.record = record
    seq.generation = generation
    seq._namespace = namespace
    # Exact-size arrays: the first decode step grows them, so most sequences of a
    # prefill-heavy load never pay for room they do not use.
    seq.tokens = tokens
    seq.num_tokens = seq.cacheable_tokens = tokens.shape[0]
    seq.reused_tokens = reused_tokens
    seq.committed_pages = reused_pages
    seq.pages = pages
    seq.num_pages = pages.shape[0]
    return 0


cdef cnp.ndarray grown(cnp.ndarray arr, int64_t used, int64_t least):
    """A new writable int32 array of twice arr's length (at least `least`), holding arr's
    first `used` ids."""
    cdef int64_t size = max(2 * arr.shape[0], least)
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(1, [size], cnp.NPY_INT32, 0)
    memcpy(cnp.PyArray_DATA(out), cnp.PyArray_DATA(arr), used * sizeof(int32_t))
    return out


cdef int reserve_token(ViewSequence seq) except -1:
    """Makes room for one more token (may allocate; changes nothing the view can see)."""
    if seq.num_tokens == seq.tokens.shape[0]:
        seq.tokens = grown(seq.tokens, seq.num_tokens, 16)
    return 0


cdef int reserve_page(ViewSequence seq) except -1:
    """Makes room for one more page in an array of the view's own (the allocation's table is
    the caller's to read: never written)."""
    if (seq.num_pages == seq.pages.shape[0]
            or not cnp.PyArray_CHKFLAGS(seq.pages, cnp.NPY_ARRAY_WRITEABLE)):
        seq.pages = grown(seq.pages, seq.num_pages, 4)
    return 0


@cython.final
@cython.auto_pickle(False)        # names this process's segment handle: never pickled
cdef class ViewState:
    """What a WorkerView hands each of its compiled calls as one argument: its segment, its
    sequences by id, its policy numbers, and its counters, which the calls update in C with
    the bookkeeping they count.

    Attributes:
        segment: the view's open segment.
        live: seq id -> ViewSequence, the view's sequences.
        page_size, pool_pages: the segment's page size and its pool's size in pages.
        reuse_enabled, min_reuse_pages, min_store_pages: the view's prefix policy.
        view: the view's number, stamped on its records.
        requests, prompt_tokens, reused_tokens, committed_pages: the view's counters.
    """

    def __init__(self, Segment segment not None, dict live not None, int32_t page_size,
                 int64_t pool_pages, bint reuse_enabled, int32_t min_reuse_pages,
                 int32_t min_store_pages, int32_t view):
        if page_size <= 0:
            raise ValueError(f"page size must be positive, got {page_size}")
        self.segment = segment
        self.live = live
        self.page_size = page_size
        self.pool_pages = pool_pages
        self.reuse_enabled = reuse_enabled
        self.min_reuse_pages = min_reuse_pages
        self.min_store_pages = min_store_pages
        self.view = view

    def pages_to_commit(self, int64_t full_pages, int64_t committed_pages):
        """The pages a commit caches for a sequence with full_pages full known pages that
        has committed_pages cached already (0: nothing new), by this view's min_store_pages:
        the commit rule (_viewstate.pxd), for WorkerView's commit plan."""
        return pages_to_commit(full_pages, self.min_store_pages, committed_pages)


cdef int check_state(ViewState state) except -1:
    """Refuses a ViewState made without its __init__ (its segment and dict are None)."""
    if state.segment is None or state.live is None:
        raise ValueError("this ViewState was never filled (made without __init__)")
    return 0


cdef int note_cached(ViewState state, ViewSequence seq, int64_t pages) except -1:
    """Records that the cache now holds a sequence's first `pages` pages (0: nothing new),
    counting the newly committed ones in the view's counter."""
    if pages:
        state.committed_pages += pages - seq.committed_pages
        seq.committed_pages = pages
    return 0


def live_of(dict live, seq_ids, str what):
    """The ViewSequences of seq_ids in live (seq id -> ViewSequence), each once, in order.

    Raises:
        SequenceError: not a sequence of ids, an id listed twice, or not live (naming the
            first bad id; `what` names the caller's call).
    """
    cdef Py_ssize_t index, n
    cdef list out = []
    cdef set seen
    if type(seq_ids) is list or type(seq_ids) is tuple:
        n = len(seq_ids)
        if n == 1 and type(seq_ids[0]) is int:
            # One request per call, the engines' common case: one dict lookup.
            seq = live.get(seq_ids[0])
            if seq is not None:
                return [seq]
    elif isinstance(seq_ids, _BYTES_LIKE) or not isinstance(seq_ids, Iterable) or (
            isinstance(seq_ids, np.ndarray) and seq_ids.ndim != 1):
        raise SequenceError(f"{what} needs a sequence of ids, got {type(seq_ids).__name__}"
                            + (f" of {seq_ids.ndim} dimensions" if isinstance(seq_ids, np.ndarray)
                               else ""))
    else:
        seq_ids = list(seq_ids)
    seen = set()
    for raw in seq_ids:
        seq_id = raw if type(raw) is int and INT64_MIN <= raw <= INT64_MAX else as_seq_id(raw)
        if seq_id in seen:
            raise SequenceError(f"{what}: sequence {seq_id} is listed twice")
        seen.add(seq_id)
        seq = live.get(seq_id)
        if seq is None:
            raise SequenceError(f"{what}: sequence {seq_id} is not live in this view "
                                "(never allocated, or released already)")
        out.append(seq)
    return out
