"""WorkerView: closing, forks, page tables, states, stats, token and id types, request
values and subclasses, and the compiled bookkeeping (ViewSequence, the compiled decode step).

Every failure is checked for an exact rollback: the segment's counters (all of them), the
radix tree's contents, the live sequence records, cache.check() (exact reference accounting:
these tests hold no raw references) and the view's own bookkeeping must be what they were,
and the ids of the failed batch must be usable at once. The only counter a failed mutation
may move is ``rollbacks`` (+1 when the failure came after a logged store); ``generation``
counts committed mutations, so it must not move either - snapshots are taken inside a
"quiet" window (a forced sweep just before), because a lock taken more than a second after
the last sweep sweeps the leases again and commits that as a mutation of its own.

Multiprocess behaviour (prefix reuse across processes, dead processes) is in
test_worker_view_multiprocess.py; the model-based test in test_worker_view_model.py."""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import os
import pickle
import weakref
from unittest import mock

import numpy as np
import pytest

import hostkv
from hostkv import HostKVCache, SequenceError, SequenceRequest as R, WorkerView
from hostkv import _sequences, _tokens, _viewstate

from conftest import fork_quietly
from lib.worker_view_lib import (
    P,
    POOL,
    PS,
    Q,
    Z,
    assert_unchanged,
    cache_prefix,
    config,
    make,  # noqa: F401 - a fixture
    snapshot,
)


# -- the rest of the view's surface ---------------------------------------------------------------


def test_close_releases_live_sequences_without_commit(make):
    cache, view = make()
    cache_prefix(view, P)
    view.allocate_pages_for_sequences_with_prefix([R(1, P + [1]), R(2, Z + [2])])
    view.append_tokens([1, 2], [3, 4])
    view.close()
    st = cache.stats()
    assert (st.active_sequences, st.cached_pages, st.free_pages) == (0, 3, POOL - 3)
    assert cache.match_prefix(Z).num_tokens == 0
    view.close()                            # idempotent
    for call in (lambda: view.allocate_pages_for_sequences_with_prefix([R(1, [1])]),
                 lambda: view.append_tokens([1], [1]), lambda: view.commit([1]),
                 lambda: view.release([1]), lambda: view.page_table(1)):
        with pytest.raises(ValueError):
            call()
    with WorkerView(cache) as other:
        other.allocate_pages_for_sequences_with_prefix([R(1, Z + [1])])
    assert cache.stats().active_sequences == 0
    assert cache.stats().cached_pages == 3
    cache.check()


def test_closing_the_cache_first_releases_the_views_sequences(segment_name):
    cache = HostKVCache.create(segment_name, config())
    view = WorkerView(cache)
    view.allocate_pages_for_sequences_with_prefix([R(1, P + [1])])
    cache.close()
    view.close()                            # nothing left to release, and no error
    with HostKVCache.attach(segment_name) as again:
        st = again.stats()
        assert (st.active_sequences, st.free_pages) == (0, POOL)
        again.check()


def test_worker_view_needs_an_open_cache(segment_name):
    with pytest.raises(TypeError):
        WorkerView(object())
    cache = HostKVCache.create(segment_name, config())
    cache.close()
    with pytest.raises(ValueError):
        WorkerView(cache)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_forked_child_cannot_use_the_parents_view(make):
    cache, view = make()
    view.allocate_pages_for_sequences_with_prefix([R(1, P + [1])])
    pid = fork_quietly()
    if pid == 0:                            # the child: never return into pytest
        status = 3
        try:
            failures = 0
            for call in (lambda: view.allocate_pages_for_sequences_with_prefix([R(2, [1])]),
                         lambda: view.append_tokens([1], [1]), lambda: view.commit([1]),
                         lambda: view.release([1]), lambda: view.page_table(1),
                         lambda: view.state(1)):
                try:
                    call()
                except SequenceError:
                    pass
                else:
                    failures += 1
            view.close()                    # must not release the parent's sequence
            with WorkerView(cache) as own:  # a view of its own works
                (a,) = own.allocate_pages_for_sequences_with_prefix([R(1, P + [2])])
                if a.reused_tokens != 0 or cache.stats().active_sequences != 2:
                    failures += 1
            status = 0 if failures == 0 else 1
        except BaseException:
            status = 2
        finally:
            os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(wait_status) == 0
    assert view.live_sequences == [1]
    assert cache.reap() == 1                # the child's lease
    st = cache.stats()
    assert st.active_sequences == 1
    assert len(view.page_table(1)) == 4
    view.append_tokens([1], [2])
    assert view.release([1]) == [3]
    cache.check()


def test_a_decode_step_never_writes_into_the_allocations_table(make):
    """The allocation's page table is the caller's to read: a step that takes a page grows
    the view's own table instead, whatever room the shared one has."""
    cache, view = make()
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(1, list(range(1, 9)))])
    before = alloc.page_table.tolist()
    assert len(before) == 2                          # both pages full: the next token needs one
    for token in range(20, 25):
        view.append_tokens([1], [token])
    assert alloc.page_table.tolist() == before and not alloc.page_table.flags.writeable
    table = view.page_table(1)
    assert len(table) == 4 and table[:2].tolist() == before
    assert len(set(table.tolist())) == 4
    assert view.state(1).tokens.tolist() == list(range(1, 9)) + list(range(20, 25))
    view.release([1])
    cache.check()


def test_page_table_is_a_read_only_view(make):
    cache, view = make()
    view.allocate_pages_for_sequences_with_prefix([R(1, [1, 2, 3, 4, 5])])
    table = view.page_table(1)
    assert table.dtype == np.int32
    assert not table.flags.writeable
    with pytest.raises(ValueError):
        table[0] = 3
    assert len(table) == 2


def test_state_is_a_snapshot(make):
    cache, view = make()
    cache_prefix(view, P)
    view.allocate_pages_for_sequences_with_prefix([R(1, np.array(P + [7, 8], np.int64), 5)])
    view.allocate_pages_for_sequences_with_prefix([R(2, P + [7, 8], 0)])
    s = view.state(2)
    assert isinstance(s, hostkv.PrefixSequenceState)
    assert (s.seq_id, s.namespace, s.num_tokens, s.reused_tokens, s.committed_tokens,
            s.cacheable_tokens) == (2, 0, 14, 12, 12, 14)
    assert s.tokens.dtype == np.int32 and s.tokens.tolist() == P + [7, 8]
    assert s.pages.dtype == np.int32 and s.pages.tolist() == view.page_table(2).tolist()
    assert view.state(1).namespace == 5 and view.state(1).reused_tokens == 0
    # A copy: later steps and scribbles do not reach it, nor it the view.
    s.tokens[:] = 0
    s.pages[:] = 0
    view.append_tokens([2], [None])
    view.append_tokens([2], [9])
    assert (s.num_tokens, s.cacheable_tokens) == (14, 14)
    t = view.state(2)
    assert (t.num_tokens, t.cacheable_tokens, t.committed_tokens) == (16, 14, 12)
    assert t.tokens.tolist() == P + [7, 8, 0, 9]
    assert len(t.pages) == 4 and t.pages[:3].tolist() == cache.match_prefix(P).pages.tolist()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.num_tokens = 3


def test_view_stats(make):
    cache, view = make()
    assert view.stats() == hostkv.WorkerViewStats(0, 0, 0, 0, 0)
    cache_prefix(view, P)
    assert view.stats() == hostkv.WorkerViewStats(1, 12, 0, 3, 0)
    view.allocate_pages_for_sequences_with_prefix([R(1, P + [1, 2, 3, 4, 5]), R(2, [1])])
    assert view.stats() == hostkv.WorkerViewStats(3, 12 + 17 + 1, 12, 3, 2)
    view.commit([1])                        # one more page beyond the 3 borrowed
    assert view.stats().committed_pages == 4
    view.release([1, 2])
    assert view.stats() == hostkv.WorkerViewStats(3, 30, 12, 4, 0)


def test_token_and_id_types_are_accepted(make):
    torch = pytest.importorskip("torch")
    cache, view = make(num_pages=64)
    cache_prefix(view, P)
    tokens = P + [7, 8, 9]
    inputs = [
        tokens,
        tuple(tokens),
        [np.int64(t) for t in tokens],
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.uint16),
        np.repeat(np.array(tokens, dtype=np.int32), 2)[::2],       # not contiguous
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(tokens, dtype=torch.int32),
    ]
    ids = [0, -1, 2**63 - 1, -2**63, np.int64(5), np.uint8(6), np.int32(-7), 8]
    allocs = view.allocate_pages_for_sequences_with_prefix(
        [R(i, t) for i, t in zip(ids, inputs)])
    for alloc, i in zip(allocs, ids):
        assert alloc.seq_id == int(i) and type(alloc.seq_id) is int
        assert alloc.reused_tokens == 12
        assert view.state(i).tokens.tolist() == tokens
    assert sorted(view.live_sequences) == sorted(int(i) for i in ids)
    # The view keeps its own copy of the prompt, whatever memory the caller's came in.
    arr = np.array(tokens, dtype=np.int32)
    wide = np.array([7] + tokens, dtype=np.int32)
    tensor = torch.tensor(tokens, dtype=torch.int32)
    view.allocate_pages_for_sequences_with_prefix(
        [R(100, arr), R(101, wide[1:]), R(102, tensor)])
    arr[:] = 0
    wide[:] = 0
    tensor[:] = 0
    for seq_id in (100, 101, 102):
        assert view.state(seq_id).tokens.tolist() == tokens
    view.release([int(i) for i in ids] + [100, 101, 102])
    assert cache.match_prefix(tokens).num_tokens == 12
    cache.check()


def test_list_input_reads_exactly_like_numpy(make):
    """Lists and tuples of ints are read in the compiled layer (the engines' own format):
    the same ids, reuse and page tables as the same tokens in an int32 array, across the
    digit boundaries of Python's int representation."""
    from array import array
    cache, view = make(num_pages=128)
    edge = [0, 1, 2**15 - 1, 2**15, 2**30 - 1, 2**30, 2**31 - 2, 2**31 - 1]
    prompt = P + edge * 4 + [5]
    cache_prefix(view, prompt[:-1])
    arr = np.array(prompt, dtype=np.int32)
    want = view.allocate_pages_for_sequences_with_prefix([R(1, arr)])[0]
    assert want.reused_tokens == len(prompt) - 1
    inputs = [prompt, tuple(prompt), array("i", prompt), array("q", prompt)]
    for seq_id, tokens in enumerate(inputs, start=2):
        got = view.allocate_pages_for_sequences_with_prefix([R(seq_id, tokens)])[0]
        assert got.reused_tokens == want.reused_tokens
        shared = want.reused_tokens // want.page_size
        assert (got.page_table[:shared] == want.page_table[:shared]).all()
        assert view.state(seq_id).tokens.tolist() == prompt
        assert cache.match_prefix(tokens).num_tokens == cache.match_prefix(arr).num_tokens
    assert _tokens.tokens_from_sequence(prompt, "t").tolist() == prompt
    assert _tokens.tokens_from_sequence([], "t").dtype == np.int32
    # Not all plain ints: the general path decides (numpy integers are accepted there).
    assert _tokens.tokens_from_sequence([1, np.int64(2)], "t") is None
    with pytest.raises(ValueError, match=r"^requests\[0\]\.tokens\[3\] = 2147483648 is outside"):
        view.allocate_pages_for_sequences_with_prefix([R(50, [1, 2, 3, 2**31])])
    # The request is named by its place in the batch, whatever its input type.
    for bad in ([7, -1], (7, -1), np.array([7, -1], dtype=np.int32), array("i", [7, -1])):
        with pytest.raises(ValueError, match=r"^requests\[1\]\.tokens\[1\] = -1 is outside"):
            view.allocate_pages_for_sequences_with_prefix([R(50, [1]), R(51, bad)])
    with pytest.raises(ValueError, match=r"tokens\[0\] = -1 is outside"):
        cache.match_prefix((-1, 2))
    view.release([1, 2, 3, 4, 5])
    cache.check()


def test_batch_borrows_every_prefix_before_evicting_for_any(make):
    """A request's eviction must not take the prefix another request of the same batch
    matched: every prefix is borrowed first, then the batch's fresh pages are freed by
    evicting only what nobody in the batch borrowed."""
    cache, view = make(num_pages=16)
    x = list(range(5000, 5000 + 4 * PS))          # 4 pages, cached first: the LRU victim
    y = list(range(6000, 6000 + 4 * PS))          # 4 pages, cached later
    cache_prefix(view, x, seq_id=900)
    cache_prefix(view, y, seq_id=901)
    assert cache.stats().free_pages == 8
    fresh_only = list(range(7000, 7000 + 10 * PS))    # 10 new pages: 2 must be evicted
    allocs = view.allocate_pages_for_sequences_with_prefix(
        [R(1, fresh_only), R(2, x + [1])])
    assert allocs[0].reused_tokens == 0
    assert allocs[1].reused_tokens == len(x)      # x stayed whole; y paid for the batch
    assert cache.match_prefix(y).num_tokens == 1 * PS
    view.release([1, 2], commit=False)
    cache.check()


def test_out_of_pages_says_where_the_pages_are(make):
    cache, view = make(num_pages=16)
    with pytest.raises(hostkv.OutOfPagesError, match="more than the pool's 16 pages in all"):
        view.allocate_pages_for_sequences_with_prefix([R(1, list(range(17 * PS)))])
    view.allocate_pages_for_sequences_with_prefix([R(2, list(range(10 * PS)))])
    with pytest.raises(hostkv.OutOfPagesError,
                       match=r"needs 7 new pages, the other 10 pages are held by live "
                             r"sequences \(their own pages, and the cached prefixes they "
                             r"borrow\); only 6 are free or evictable"):
        view.allocate_pages_for_sequences_with_prefix([R(3, list(range(9000, 9000 + 7 * PS)))])
    view.release([2])
    cache.check()


def test_requests_and_allocations_are_immutable_values(make):
    """Both are compiled (a Python __init__ per request cost more than the rest of
    the view's Python): they keep what they had as frozen dataclasses - keywords, a default
    namespace, value equality, hashing, repr, pattern matching, pickling, subclassing - and
    refuse every assignment."""
    cache, view = make(num_pages=16)
    request = R(1, P + [1])
    assert request == R(seq_id=1, tokens=P + [1], namespace=0) != R(1, P + [1], 2)
    assert request != (1, P + [1], 0) and R(1, [2]) != object()
    assert hash(R(1, (1, 2))) == hash(R(1, (1, 2))) != hash(R(2, (1, 2)))
    with pytest.raises(TypeError):
        hash(request)                            # its tokens are a list, as a dataclass's
    assert repr(R(1, [2])) == "SequenceRequest(seq_id=1, tokens=[2], namespace=0)"
    assert pickle.loads(pickle.dumps(request)) == request
    match request:
        case R(seq_id, tokens, namespace):
            assert (seq_id, tokens, namespace) == (1, P + [1], 0)
        case _:
            pytest.fail("a SequenceRequest matches its positional fields")
    for field in ("seq_id", "tokens", "namespace", "other"):
        with pytest.raises(AttributeError):
            setattr(request, field, 2)
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([request])
    assert type(alloc) is hostkv.SequenceAllocation
    assert alloc == hostkv.SequenceAllocation(1, 0, alloc.page_table, PS)
    assert alloc != hostkv.SequenceAllocation(1, PS, alloc.page_table, PS)
    assert (alloc.num_shared_pages, alloc.write_from_token) == (0, 0)
    assert repr(alloc).startswith("SequenceAllocation(seq_id=1, reused_tokens=0, ")
    copy = pickle.loads(pickle.dumps(alloc))
    assert copy.page_table.tolist() == alloc.page_table.tolist() and copy.page_size == PS
    for field in ("seq_id", "reused_tokens", "page_table", "page_size", "num_shared_pages"):
        with pytest.raises(AttributeError):
            setattr(alloc, field, 2)
    with pytest.raises(TypeError):
        R(1)                                     # tokens are required, as before
    view.release([1])

    class TaggedRequest(R):
        """An engine's own request type, with a field of its own."""

        def __init__(self, seq_id, tokens, tag):
            super().__init__(seq_id, tokens)
            self.tag = tag

    (alloc,) = view.allocate_pages_for_sequences_with_prefix([TaggedRequest(2, P + [1], "a")])
    assert alloc.seq_id == 2 and view.live_sequences == [2]
    assert repr(TaggedRequest(3, [4], "b")).endswith(
        ".TaggedRequest(seq_id=3, tokens=[4], namespace=0)")   # its __qualname__, as before
    view.release([2])
    weakref.ref(request)                         # as a dataclass instance could be


class TenantRequest(hostkv.SequenceRequest):
    """An engine's request type: its namespace is a property of its own field, and its
    __init__ takes other arguments than SequenceRequest's."""

    def __init__(self, seq_id, tokens, *, tenant):
        super().__init__(seq_id, tokens)
        self.tenant = tenant

    @property
    def namespace(self):
        return {"a": 1, "b": 2}[self.tenant]


def _namespace_in_child(request):
    return type(request).__name__, request.namespace, request.tenant


def test_a_subclass_of_sequence_request_is_read_as_python_reads_it(make):
    """A subclass's fields are what its attributes say (a property over a field included),
    and a copy, a pickle or a spawned process keeps its own state without running its
    __init__: a request never silently falls back to another namespace (found in review of
    the compiled types)."""
    cache, view = make(num_pages=16)
    a, b = TenantRequest(1, P + [1], tenant="a"), TenantRequest(2, P + [1], tenant="b")
    assert repr(b).endswith("TenantRequest(seq_id=2, tokens=%r, namespace=2)" % (P + [1]))
    assert a != b and a == TenantRequest(1, P + [1], tenant="a")
    view.allocate_pages_for_sequences_with_prefix([a])
    view.release([1])
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([b])
    assert alloc.reused_tokens == 0              # tenant b never reuses tenant a's prefix
    assert view.state(2).namespace == 2
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([TenantRequest(3, P + [1],
                                                                            tenant="a")])
    assert alloc.reused_tokens == len(P)
    view.release([2, 3])
    for clone in (pickle.loads(pickle.dumps(b)), copy.copy(b), copy.deepcopy(b)):
        assert type(clone) is TenantRequest and clone == b
        assert (clone.namespace, clone.tenant, clone.seq_id) == (2, "b", 2)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_namespace_in_child, (b,)) == ("TenantRequest", 2, "b")


def test_a_look_alike_of_sequence_request_is_read_through_its_attributes(make):
    """What isinstance calls a SequenceRequest (a test's Mock with its spec) is read through
    its attributes, never as the compiled struct it is not."""
    cache, view = make(num_pages=16)
    fake = mock.Mock(spec=hostkv.SequenceRequest)
    fake.seq_id, fake.tokens, fake.namespace = 4, P + [1], 0
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([fake])
    assert alloc.seq_id == 4 and alloc.page_table.shape == (4,)
    view.release([4])
    with pytest.raises(SequenceError, match="requests.0. is a Mock, not a SequenceRequest"):
        view.allocate_pages_for_sequences_with_prefix([mock.Mock()])
    blank = hostkv.SequenceRequest.__new__(hostkv.SequenceRequest)
    with pytest.raises(SequenceError, match="sequence ids must be integers, got None"):
        view.allocate_pages_for_sequences_with_prefix([blank])
    assert view.live_sequences == []
    cache.check()


def test_a_commit_continues_below_the_prefix_the_sequence_holds(make):
    """Commit and release insert a sequence's pages from the end of the prefix it holds
    (the prefix is not compared again). That node may have been split by another
    sequence meanwhile (it keeps its identity as the tail) or have gained children: the
    pages still land right after the prefix, and every prompt matches as it should."""
    cache, view = make(num_pages=64)
    cache_prefix(view, P)                                        # one 3-page node
    x = [7000 + i for i in range(2 * PS + 1)]
    (held,) = view.allocate_pages_for_sequences_with_prefix([R(1, P + x)])
    assert held.reused_tokens == 12
    # Another sequence ends inside P's node (a split: its first page becomes the head) and
    # another puts a sibling of x under P.
    y = [8000 + i for i in range(PS + 1)]
    cache_prefix(view, P[:PS] + y, seq_id=2)
    cache_prefix(view, P + [9000 + i for i in range(PS + 1)], seq_id=3)
    assert view.commit([1]) == [5]
    assert view.release([1]) == [5]
    assert cache.match_prefix(P + x).num_tokens == 20
    assert cache.match_prefix(P + x).pages[:3].tolist() == held.page_table[:3].tolist()
    assert cache.match_prefix(P[:PS] + y).num_tokens == 8
    assert cache.match_prefix(P + [9000 + i for i in range(PS)]).num_tokens == 16
    # Namespaces stay apart: the same tokens in another namespace match nothing.
    assert cache.match_prefix(P + x, namespace=5).num_tokens == 0
    cache.check(exact_references=True)


def test_a_release_hands_its_references_to_the_tree_and_refuses_pages_it_never_held(make):
    """A release that commits lets the tree take over the sequence's own references
    instead of adding one and dropping one: the refcounts come out exact. Handed
    pages the sequence's list does not hold (another sequence's), the compiled release
    refuses the whole mutation and changes nothing."""
    cache, view = make(num_pages=64)
    view.allocate_pages_for_sequences_with_prefix([R(1, Q + [1]), R(2, Z + [2])])
    assert view.release([1]) == [2]
    cache.check(exact_references=True)
    seq = view._sequences[2]
    other = view.allocate_pages_for_sequences_with_prefix([R(3, Z + [3])])[0].page_table
    wrong = seq.pages.copy()
    wrong[:3] = other[:3]                      # held pages, not in the tree, not sequence 2's
    before = snapshot(cache, view, quiet=True)
    with pytest.raises(hostkv.CorruptionError, match="adopted"):
        _sequences.release(cache._segment, [seq.record], [2], [seq.generation], [seq.tokens],
                           [wrong], [3], [0])
    assert_unchanged(before, snapshot(cache, view), rolled_back=True)
    assert view.release([2, 3]) == [3, 3]
    cache.check(exact_references=True)


def test_page_lists_fill_twelve_pages_a_record_across_decode_steps(make):
    """A sequence's page list holds twelve pages a record: a prompt fills whole records
    and part of one, decode steps fill its room before taking a record, and the segment's
    list always equals the view's page table; a release gives every record back."""
    cache, view = make(num_pages=128)
    seg = cache._segment
    (alloc,) = view.allocate_pages_for_sequences_with_prefix(
        [R(1, list(range(4000, 4000 + 25 * PS)))])               # 25 pages: 12 + 12 + 1

    def listed():
        (record, _, _, pages), = _sequences.view_sequences(seg, view._number)
        return pages

    assert listed() == alloc.page_table.tolist()
    for step in range(12 * PS):                                  # 12 more pages, one by one
        view.append_tokens([1], [step])
        assert listed() == view.page_table(1).tolist()
    assert len(listed()) == 37
    cache.check(exact_references=True)
    view.release([1])
    assert _sequences.view_sequences(seg, view._number) == []
    cache.check(exact_references=True)          # every page-list record is free again


def test_a_commit_never_locks_past_what_it_matched(make):
    """Found in review: a commit whose pages were all cached, ending inside a
    node it could not split (no node record free), locked that whole node; the next commit
    then continued below its end without comparing, and hung this sequence's KV under
    another prompt's pages. The lock must stay where the sequence's tokens were matched."""
    cache, view = make(num_pages=64, radix_node_capacity=2)
    page = lambda x: [x] * PS
    a = page(1) + page(2) + page(3) + page(4)                      # X: a0 a1 a2 a3
    s = page(1) + page(2) + page(7) + page(8) + page(9) + page(10)  # S: a0 a1 b2 b3 b4 b5
    view.allocate_pages_for_sequences_with_prefix([R(1, s + [0])])  # nothing cached yet
    cache_prefix(view, a + [0], seq_id=2)
    view.allocate_pages_for_sequences_with_prefix([R(3, page(20) + page(21) + [0])])
    view.commit([3])                                     # the second (last) node record
    view.commit([1], num_tokens=2 * PS)                  # all cached, inside X, no split
    view.release([3], commit=False)
    view.commit([1])
    cache.check(exact_references=True)
    # Pages 4 and 5 of S hold KV computed after b2 b3: never an answer for a2 a3.
    assert cache.match_prefix(a + page(9) + page(10)).num_tokens == 4 * PS
    assert cache.match_prefix(a).num_tokens == 4 * PS
    view.release([1])
    cache.check(exact_references=True)


def test_big_endian_int32_prompts_are_read_as_their_ids(make):
    """Found in review: a '>i4' array is NPY_INT32 too, and the compiled fast
    path copied its bytes raw, caching ids 1 << 24, 2 << 24, ... for 1, 2, ... It is
    converted like any other dtype; the raw compiled calls refuse it."""
    cache, view = make(num_pages=32)
    ids = list(range(1, 10))
    big = np.array(ids, dtype=">i4")
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(1, big)])
    assert view.state(1).tokens.tolist() == ids
    view.release([1])
    assert cache.match_prefix(ids).num_tokens == 8
    assert cache.match_prefix(big).num_tokens == 8
    assert cache.match_prefix([i << 24 for i in ids]).num_tokens == 0
    (again,) = view.allocate_pages_for_sequences_with_prefix([R(2, big)])
    assert again.reused_tokens == 8
    view.release([2])
    with pytest.raises(ValueError, match="contiguous 1-D np.int32"):
        _tokens.checked_copy(big)
    with pytest.raises(ValueError, match="native-order"):
        _sequences.hold(cache._segment, [big], np.array([3], dtype=np.int64), [0], view._number)
    cache.check(exact_references=True)


def test_a_closed_cache_still_names_the_bad_request_first(segment_name):
    """The view's documented errors come before "closed", as they did when the view checked
    requests in Python: a caller that passes a bad request learns what is wrong with it."""
    cache = hostkv.HostKVCache.create(segment_name, hostkv.HostKVConfig(
        num_pages=32, page_size=PS, page_bytes=64))
    view = WorkerView(cache)
    cache.close()
    with pytest.raises(SequenceError, match="empty prompt"):
        view.allocate_pages_for_sequences_with_prefix([R(1, [])])
    with pytest.raises(ValueError, match=r"tokens\[0\] = -1 is outside"):
        view.allocate_pages_for_sequences_with_prefix([R(1, [-1])])
    with pytest.raises(SequenceError, match="not a SequenceRequest"):
        view.allocate_pages_for_sequences_with_prefix(["x"])
    with pytest.raises(ValueError, match="closed"):
        view.allocate_pages_for_sequences_with_prefix([R(1, [1, 2])])


# -- the view's compiled bookkeeping (ViewSequence, the compiled decode step) -------------------


def _hold_pages_and_die(name: str) -> None:
    view = WorkerView(HostKVCache.attach(name))
    view.allocate_pages_for_sequences_with_prefix([R(1, list(range(1000, 1060)))])  # 15 pages
    os._exit(0)                                            # dies holding them


def test_a_generator_of_tokens_survives_the_retry_after_a_reap(segment_name, procs):
    """A step short of pages while a dead process holds some reaps and tries again: the
    token ids must still be there, whatever iterable they came in."""
    cache = HostKVCache.create(segment_name, config(num_pages=16))
    try:
        view = WorkerView(cache)
        view.allocate_pages_for_sequences_with_prefix([R(7, [1, 2, 3, 4])])   # the 16th page
        child = procs(_hold_pages_and_die, segment_name)
        child.join(60)
        assert child.exitcode == 0
        view.append_tokens([7], (token for token in [42]))   # needs a page: reap, retry
        assert view.state(7).tokens.tolist() == [1, 2, 3, 4, 42]
        assert len(view.page_table(7)) == 2
        view.close()
        cache.check()
    finally:
        cache.close()


def test_the_commit_rule_is_one_for_the_view_and_its_release(make):
    # What WorkerView's commit plans (in Python) and what release_sequences commits (in C)
    # come from one definition: at least min_store_pages full pages, more than committed.
    cache, view = make()
    state = _viewstate.ViewState(cache._segment, {}, PS, 64, True, 1, 3, 1)
    assert [state.pages_to_commit(full, 0) for full in range(5)] == [0, 0, 0, 3, 4]
    assert [state.pages_to_commit(full, 3) for full in range(6)] == [0, 0, 0, 0, 4, 5]
    assert state.pages_to_commit(7, 9) == 0


def test_a_view_sequence_is_whole_or_refused(make):
    cache, view = make()
    view.allocate_pages_for_sequences_with_prefix([R(1, [1, 2, 3, 4, 5])])
    seq = view._sequences[1]
    # Made without __init__: refused, never a crash.
    empty = _viewstate.ViewSequence.__new__(_viewstate.ViewSequence)
    with pytest.raises(ValueError, match="never filled"):
        _sequences.append_tokens(cache._segment, [empty], [1], PS)
    with pytest.raises(ValueError, match="never filled"):
        _sequences.commit_view_sequences(view._state, [empty], [1])
    with pytest.raises(TypeError):
        type("Sub", (_viewstate.ViewSequence,), {})       # nothing can skip filling it
    # A view's state made without __init__, or without a segment: refused, never a crash.
    blank = _viewstate.ViewState.__new__(_viewstate.ViewState)
    with pytest.raises(ValueError, match="never filled"):
        _sequences.release_sequences(blank, [], True)
    with pytest.raises(ValueError, match="never filled"):
        _sequences.allocate_requests(blank, [R(9, [1, 2])], [])
    with pytest.raises(ValueError, match="never filled"):
        _sequences.commit_view_sequences(blank, [], [])
    with pytest.raises(TypeError):
        _viewstate.ViewState(None, {}, PS, 64, True, 1, 1, 1)
    # Arrays the C code could not read raw are refused.
    for bad in (np.arange(4, dtype=">i4"), np.arange(4, dtype=np.int64),
                np.arange(8, dtype=np.int32)[::2]):
        with pytest.raises(ValueError, match="native-order"):
            _viewstate.ViewSequence(1, seq.record, seq.generation, 0, bad, 0, 0, seq.pages)
    # A sequence listed twice in one step is refused before anything changes.
    before = (seq.num_tokens, seq.num_pages, cache.stats().free_pages)
    with pytest.raises(SequenceError, match="listed twice"):
        _sequences.append_tokens(cache._segment, [seq, seq], [6, 7], PS)
    assert (seq.num_tokens, seq.num_pages, cache.stats().free_pages) == before
    # The raw commit and release name a bad record or namespace clearly.
    tokens, pages = seq.tokens[:seq.num_tokens], seq.pages[:seq.num_pages]
    for record in (2**31, -2**40):
        with pytest.raises(SequenceError, match="outside"):
            _sequences.release(cache._segment, [record], [1], [seq.generation], [tokens],
                               [pages], [0], [0])
    for namespace in (-1, 2**64):
        with pytest.raises(ValueError, match="namespaces"):
            _sequences.release(cache._segment, [seq.record], [1], [seq.generation], [tokens],
                               [pages], [0], [namespace])
    # Arrays of more or fewer than one dimension are not sequences of ids or tokens.
    with pytest.raises(SequenceError, match="sequence of ids"):
        view.append_tokens(np.array(1), [5])
    with pytest.raises(ValueError, match="sequence of token ids"):
        view.append_tokens([1], np.array(5))
    assert view.state(1).num_tokens == 5
    view.release([1])
    cache.check()
