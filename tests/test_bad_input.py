"""The bad input table: every public entry point, fed what it must refuse.

Each case must raise exactly its exception class AND leave the segment's metadata byte for
byte as it was: every byte before the page pool is read through a raw mmap before and after
the call (tests/lib/rawseg.py), except the fields that change on any lock (the mutexes, the
lock timing metrics, the sweep clock and the generation; cache.reap() just before the
snapshot makes sure no periodic sweep is due). Refusing bad input must happen before anything shared
is touched, so even a mutation that is rolled back (its undo log entries, st_rollbacks)
counts as a change.

Non-contiguous token arrays are accepted (copied), and tested as such below.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest

from hostkv import (
    ConfigError,
    HostKVCache,
    IncompatibleSegmentError,
    OutOfPagesError,
    SegmentExistsError,
    SegmentNotFoundError,
    SequenceError,
    SequenceRequest as R,
    WorkerView,
)

from conftest import report_counts, small_config
from lib.rawseg import MetadataSnapshot

try:
    import torch
except ImportError:  # pragma: no cover - torch is optional
    torch = None

PAGE = 4
SYS = list(range(100, 112))                 # three full pages, cached by the fixture


class Env:
    """A segment with a tree and live sequences: 1 and 2 live, 9 released."""

    def __init__(self, name: str, new_name: Callable[[str], str]) -> None:
        self.name = name
        self.new_name = new_name
        self.cache = HostKVCache.create(name, small_config(page_size=PAGE, radix_node_capacity=16))
        self.view = WorkerView(self.cache)
        self.view.allocate_pages_for_sequences_with_prefix([R(9, SYS + [1, 2])])
        self.view.release([9])
        self.view.allocate_pages_for_sequences_with_prefix(
            [R(1, SYS + [3, 4, 5]), R(2, SYS[:8] + [6, 7, 8, 9], 3)])
        self.view.append_tokens([1, 2], [10, None])
        self.view.commit([1, 2])
        self.others = []

    def attach(self) -> HostKVCache:
        other = HostKVCache.attach(self.name)
        self.others.append(other)
        return other

    def close(self) -> None:
        for other in self.others:
            other.close()
        self.view.close()
        self.cache.close()


@dataclass(frozen=True)
class Case:
    id: str
    exc: type
    call: Callable[[Env], Any] = None          # called under pytest.raises
    prepare: Callable[[Env], Callable[[], Any]] = None   # setup, returns the call
    match: str = None                          # a regex the message must contain


CASES = []


def case(id: str, exc: type, call=None, prepare=None, match=None) -> None:
    CASES.append(Case(id, exc, call, prepare, match))


# -- token ids ------------------------------------------------------------------------------

BAD_TOKENS = {
    "negative": [1, 2, -1, 4],
    "2**31": [1, 2**31, 3, 4],
    "tuple-negative": (1, 2, -1, 4),
    "2**63": [1, 2, 3, 2**63],
    "-2**63": [-2**63, 1, 2, 3],
    "2**80": [1, 2**80, 3, 4],
    "2**64": [1, 2**64, 3, 4],
    "python-floats": [1.0, 2.0, 3.0, 4.0],
    "numpy-floats": np.array([1.5, 2.5, 3.5, 4.5]),
    "numpy-bools": np.array([True, False, True, True]),
    "int32-negative": np.array([5, -5, 1, 2], dtype=np.int32),
    "int64-2**31": np.array([5, 2**31, 1, 2], dtype=np.int64),
    "uint32-max": np.array([2**32 - 1, 1, 2, 3], dtype=np.uint32),
    "2-D-numpy": np.zeros((2, 4), dtype=np.int32),
    "2-D-list": [[1, 2], [3, 4]],
    "0-D-numpy": np.array(7, dtype=np.int32),
    "numpy-scalar": np.int64(7),
    "str": "abcd",
    "bytes": b"abcd",
    "int": 5,
    "None": None,
    "mixed-str": [1, "a", 3, 4],
    "mixed-None": [1, None, 3, 4],
    "dict": {1: 2},
    # Each of these was once accepted, or refused with a misleading message.
    "bool-among-ints": [1, True, 2, 3],
    "numpy-bool-among-ints": [1, 2, np.False_, 3],
    "bytearray": bytearray(b"abcd"),
    "memoryview": memoryview(b"abcd"),
    "memoryview-of-int32": memoryview(np.array([1, 2, 3, 4], dtype=np.int32)),
    "set": {1, 2, 3, 4},
    "dict-of-four": {1: 2, 3: 4, 5: 6, 7: 8},
    "frozenset": frozenset({1, 2}),
    "nested-ragged": [[1, 2], [3]],
}
TOKEN_MESSAGES = {"bool-among-ints": "not bools", "numpy-bool-among-ints": "not bools",
                  "set": "sequence of integer ids.*got set", "dict": "got dict",
                  "dict-of-four": "got dict", "bytearray": "got bytearray",
                  "memoryview": "got memoryview"}
if torch is not None:
    BAD_TOKENS["torch-negative"] = torch.tensor([1, -1, 2, 3])
    BAD_TOKENS["torch-floats"] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    BAD_TOKENS["torch-2-D"] = torch.zeros((2, 4), dtype=torch.int32)

for key, tokens in BAD_TOKENS.items():
    case(f"match_prefix-tokens-{key}", ValueError,
         lambda env, t=tokens: env.cache.match_prefix(t), match=TOKEN_MESSAGES.get(key))

for key in ("negative", "2**31", "tuple-negative", "2**80", "python-floats", "numpy-floats",
            "2-D-numpy", "str", "None", "bool-among-ints", "numpy-bool-among-ints", "bytearray",
            "memoryview", "memoryview-of-int32", "set", "dict", "nested-ragged"):
    case(f"allocate-tokens-{key}", ValueError,
         lambda env, t=BAD_TOKENS[key]: env.view.allocate_pages_for_sequences_with_prefix(
             [R(50, SYS + [1]), R(51, t)]), match=TOKEN_MESSAGES.get(key))

# -- namespaces -----------------------------------------------------------------------------

BAD_NAMESPACES = {"-1": -1, "2**64": 2**64, "1.5": 1.5, "str": "a", "None": None, "True": True,
                  "numpy-bool": np.bool_(False), "numpy-float": np.float64(1.0)}

for key, ns in BAD_NAMESPACES.items():
    case(f"match_prefix-namespace-{key}", ValueError,
         lambda env, ns=ns: env.cache.match_prefix(SYS, ns))
    case(f"allocate-namespace-{key}", ValueError,
         lambda env, ns=ns: env.view.allocate_pages_for_sequences_with_prefix(
             [R(50, SYS + [1]), R(51, SYS + [2], ns)]))

# -- allocation requests --------------------------------------------------------------------

case("allocate-not-a-list", SequenceError,
     lambda env: env.view.allocate_pages_for_sequences_with_prefix(R(50, SYS + [1])))
case("allocate-not-a-request", SequenceError,
     lambda env: env.view.allocate_pages_for_sequences_with_prefix([R(50, SYS), (51, SYS)]))
case("allocate-empty-prompt", SequenceError,
     lambda env: env.view.allocate_pages_for_sequences_with_prefix([R(50, SYS), R(51, [])]))
case("allocate-empty-numpy-prompt", SequenceError,
     lambda env: env.view.allocate_pages_for_sequences_with_prefix(
         [R(50, np.empty(0, dtype=np.int32))]))
case("allocate-duplicate-ids", SequenceError,
     lambda env: env.view.allocate_pages_for_sequences_with_prefix(
         [R(50, SYS + [1]), R(51, [1, 2]), R(50, SYS + [2])]))
case("allocate-live-id", SequenceError,
     lambda env: env.view.allocate_pages_for_sequences_with_prefix([R(50, SYS), R(1, SYS)]))
# A request that can never fit says so (and is refused before the lock): the pool has 32
# pages, none held by live sequences but the fixture's few.
case("allocate-more-pages-than-the-pool", OutOfPagesError,
     lambda env: env.view.allocate_pages_for_sequences_with_prefix(
         [R(50, SYS + [1]), R(51, list(range(33 * PAGE)))]),
     match=r"needs 33 pages, more than the pool's 32 pages in all")
for key, seq_id in {"str": "50", "float": 50.0, "bool": True, "2**63": 2**63,
                    "-2**63-1": -2**63 - 1, "None": None}.items():
    case(f"allocate-seq-id-{key}", SequenceError,
         lambda env, s=seq_id: env.view.allocate_pages_for_sequences_with_prefix(
             [R(50, SYS), R(s, SYS + [1])]))

# -- decode steps, commit, release, reads ------------------------------------------------------

case("append-released-id", SequenceError, lambda env: env.view.append_tokens([1, 9], [5, 6]))
case("append-unknown-id", SequenceError, lambda env: env.view.append_tokens([1, 77], [5, 6]))
case("append-duplicate-id", SequenceError, lambda env: env.view.append_tokens([1, 1], [5, 6]))
case("append-too-few-tokens", SequenceError, lambda env: env.view.append_tokens([1, 2], [5]))
case("append-too-many-tokens", SequenceError,
     lambda env: env.view.append_tokens([1], [5, 6]))
case("append-ids-not-a-list", SequenceError, lambda env: env.view.append_tokens(1, [5]))
case("append-ids-a-str", SequenceError, lambda env: env.view.append_tokens("12", [5, 6]))
for key, token in {"negative": -1, "2**31": 2**31, "float": 1.5, "bool": True, "str": "a",
                   "2**64": 2**64}.items():
    # Sequence 2 is at a page boundary (16 tokens): sequence 1's token would need no page,
    # sequence 2's would, so a half-done step would show.
    case(f"append-token-{key}", ValueError,
         lambda env, t=token: env.view.append_tokens([2, 1], [5, t]))
for key, token_ids in {"None": None, "int": 5, "bytes": b"\x05\x06",
                       "bytearray": bytearray(b"\x05\x06"), "memoryview": memoryview(b"\x05\x06"),
                       "str": "56"}.items():
    case(f"append-token-ids-{key}", ValueError,
         lambda env, t=token_ids: env.view.append_tokens([2, 1], t))
case("append-ids-bytearray", SequenceError,
     lambda env: env.view.append_tokens(bytearray(b"\x01\x02"), [5, 6]))
case("append-ids-memoryview", SequenceError,
     lambda env: env.view.append_tokens(memoryview(b"\x01\x02"), [5, 6]))
case("commit-unknown-id", SequenceError, lambda env: env.view.commit([1, 77]))
for key, num_tokens in {"float": 1.5, "True": True, "numpy-bool": np.True_, "[None]": [None],
                        "[7.9]": [7.9], "[8.0]": [8.0], '["8"]': ["8"], "str": "8",
                        "[True]": [True], "numpy-floats": np.array([7.9]),
                        "2-D-numpy": np.array([[8]]), "bytes": b"\x08"}.items():
    case(f"commit-num-tokens-{key}", SequenceError,
         lambda env, n=num_tokens: env.view.commit([1], num_tokens=n))
case("commit-released-id", SequenceError, lambda env: env.view.commit([9]))
case("commit-negative-num-tokens", SequenceError,
     lambda env: env.view.commit([1, 2], num_tokens=-1))
case("commit-num-tokens-length", SequenceError,
     lambda env: env.view.commit([1, 2], num_tokens=[4]))
case("release-unknown-id", SequenceError, lambda env: env.view.release([1, 77]))
case("release-released-id", SequenceError, lambda env: env.view.release([9]))
case("release-twice-in-one-call", SequenceError, lambda env: env.view.release([2, 2]))
for key, commit in {"str-no": "no", "None": None, "int-1": 1, "int-0": 0,
                    "list": [True]}.items():
    case(f"release-commit-{key}", ValueError,
         lambda env, c=commit: env.view.release([1, 2], commit=c), match="True or False")
case("release-then-release-again", SequenceError,
     prepare=lambda env: (env.view.release([2]), lambda: env.view.release([2]))[1])
case("append-after-release", SequenceError,
     prepare=lambda env: (env.view.release([2], commit=False),
                          lambda: env.view.append_tokens([2], [5]))[1])
case("page-table-unknown-id", SequenceError, lambda env: env.view.page_table(77))
case("state-released-id", SequenceError, lambda env: env.view.state(9))

# -- names, configs, timeouts -----------------------------------------------------------------

BAD_NAMES = {"empty": "", "slash": "a/b", "leading-slash": "/abc", "too-long": "x" * 201,
             "nul": "ab\0c", "space": "a b", "dots": "..", "bytes": b"abc", "int": 5,
             "None": None, "unicode": "caf\u00e9"}

for key, bad in BAD_NAMES.items():
    case(f"create-name-{key}", ValueError, lambda env, n=bad: HostKVCache.create(n, small_config()))
for key in ("empty", "slash", "too-long", "nul", "bytes", "None"):
    case(f"attach-name-{key}", ValueError, lambda env, n=BAD_NAMES[key]: HostKVCache.attach(n))
    case(f"unlink-name-{key}", ValueError,
         lambda env, n=BAD_NAMES[key]: HostKVCache.unlink_segment(n))

case("create-existing-name", SegmentExistsError,
     lambda env: HostKVCache.create(env.name, small_config()))
case("create-not-a-config", ConfigError, lambda env: HostKVCache.create(env.new_name(), {}))
case("attach-missing", SegmentNotFoundError, lambda env: HostKVCache.attach(env.new_name()))
case("unlink-missing", SegmentNotFoundError,
     lambda env: HostKVCache.unlink_segment(env.new_name()))
case("attach-other-expected-config", IncompatibleSegmentError,
     lambda env: HostKVCache.attach(env.name, expected_config=small_config(num_pages=64)))
case("attach-other-expected-page-size", IncompatibleSegmentError,
     lambda env: HostKVCache.attach(env.name, expected_config=small_config(page_size=8)))

BAD_TIMEOUTS = {"negative": -1.0, "zero": 0, "nan": math.nan, "inf": math.inf, "str": "a",
                "None": None, "numeric-str": "1", "True": True, "bytes": b"1",
                "list": [1.0]}
for key, timeout in BAD_TIMEOUTS.items():
    case(f"create-lock-timeout-{key}", ValueError,
         lambda env, t=timeout: HostKVCache.create(env.new_name(), small_config(), lock_timeout=t))
    case(f"attach-lock-timeout-{key}", ValueError,
         lambda env, t=timeout: HostKVCache.attach(env.name, lock_timeout=t))
for key in ("negative", "zero", "nan", "numeric-str", "True"):
    case(f"attach-ready-timeout-{key}", ValueError,
         lambda env, t=BAD_TIMEOUTS[key]: HostKVCache.attach(env.name, ready_timeout=t))

# -- use after close --------------------------------------------------------------------------


def _closed_cache(env: Env) -> HostKVCache:
    other = env.attach()
    other.close()
    return other


for key, use in {
    "stats": lambda c: c.stats(),
    "check": lambda c: c.check(),
    "match_prefix": lambda c: c.match_prefix(SYS),
    "evict": lambda c: c.evict(1),
    "reap": lambda c: c.reap(),
    "pages_array": lambda c: c.pages_array(),
    "WorkerView": lambda c: WorkerView(c),
}.items():
    case(f"closed-cache-{key}", ValueError,
         prepare=lambda env, use=use: (lambda c: lambda: use(c))(_closed_cache(env)))


def _closed_view(env: Env) -> WorkerView:
    other = env.attach()
    view = WorkerView(other)
    view.allocate_pages_for_sequences_with_prefix([R(1, SYS + [1])])
    view.close()
    return view


for key, use in {
    "allocate": lambda v: v.allocate_pages_for_sequences_with_prefix([R(5, SYS + [1])]),
    "append": lambda v: v.append_tokens([1], [5]),
    "commit": lambda v: v.commit([1]),
    "release": lambda v: v.release([1]),
    "page_table": lambda v: v.page_table(1),
}.items():
    case(f"closed-view-{key}", ValueError,
         prepare=lambda env, use=use: (lambda v: lambda: use(v))(_closed_view(env)))


def _view_of_closed_cache(env: Env):
    other = env.attach()
    view = WorkerView(other)
    other.close()
    return lambda: view.allocate_pages_for_sequences_with_prefix([R(5, SYS + [1])])


case("view-of-closed-cache-allocate", ValueError, prepare=_view_of_closed_cache)
case("WorkerView-not-a-cache", TypeError, lambda env: WorkerView(env.name))

# -- evict, pages_tensor ----------------------------------------------------------------------

case("evict-negative", ValueError, lambda env: env.cache.evict(-1))
case("evict-str", ValueError, lambda env: env.cache.evict("a"))
# Each of these was once accepted (int() of it) or raised TypeError / OverflowError.
for key, count in {"None": None, "2**70": 2**70, "2**63": 2**63, "0.9": 0.9, "2.9": 2.9,
                   "numeric-str": "3", "True": True, "numpy-bool": np.True_,
                   "numpy-float": np.float64(2.0), "list": [1]}.items():
    case(f"evict-{key}", ValueError, lambda env, c=count: env.cache.evict(c))

if torch is not None:
    for key, kwargs in {
        "numpy-dtype": dict(dtype=np.float32),
        "str-dtype": dict(dtype="float16"),
        "too-many-pages": dict(shape=(33, 64)),
        "too-few-bytes": dict(shape=(32, 63)),
        "empty-shape": dict(shape=()),
        "zero-dimension": dict(shape=(32, 0, 64)),
        "negative-dimension": dict(shape=(32, -2, -32)),
        "untiled-dtype": dict(dtype=torch.float32, shape=(32, 3)),
        "str-dimension": dict(shape=(32, "a")),
    }.items():
        case(f"pages_tensor-{key}", ValueError, lambda env, kw=kwargs: env.cache.pages_tensor(**kw))


# -- the test ---------------------------------------------------------------------------------


@pytest.fixture
def env(segment_name, new_name):
    e = Env(segment_name, new_name)
    yield e
    e.close()


@pytest.mark.parametrize("bad", CASES, ids=[c.id for c in CASES])
def test_bad_input_raises_and_changes_nothing(env, bad):
    call = bad.prepare(env) if bad.prepare is not None else (lambda: bad.call(env))
    live = {s: env.view.state(s) for s in env.view.live_sequences}
    env.cache.reap()                       # no periodic sweep is due during the call
    snap = MetadataSnapshot(env.cache)
    before = snap.take()
    with pytest.raises(Exception) as info:
        call()
    assert type(info.value) is bad.exc, f"{bad.id}: {type(info.value).__name__}: {info.value}"
    if bad.match is not None:
        assert re.search(bad.match, str(info.value)), f"{bad.id}: {info.value}"
    after = snap.take()
    assert not snap.diff(before, after), f"{bad.id}: {snap.diff(before, after)}"
    # The view's own bookkeeping did not move either.
    assert set(env.view.live_sequences) == set(live)
    for seq_id, state in live.items():
        now = env.view.state(seq_id)
        assert now.num_tokens == state.num_tokens and (now.pages == state.pages).all()
    env.cache.check()


def test_the_table_is_large():
    assert len(CASES) >= 30
    classes = sorted({c.exc.__name__ for c in CASES})
    report_counts(f"bad input: {len(CASES)} refused inputs ({', '.join(classes)}) "
                  "+ non-contiguous arrays accepted")


# -- accepted: non-contiguous arrays are copied ------------------------------------------------


def test_non_contiguous_tokens_are_accepted_by_copying(env):
    long = np.array([x for t in SYS + [3, 4, 5, 10] for x in (t, 0)], dtype=np.int64)
    strided64 = long[::2]
    strided32 = long.astype(np.int32)[::2]
    assert not strided64.flags.c_contiguous and not strided32.flags.c_contiguous
    expected = env.cache.match_prefix(list(strided64))
    assert expected.num_tokens == 16            # sequence 1 committed all four pages
    env.cache.reap()
    snap = MetadataSnapshot(env.cache)
    before = snap.take()
    for tokens in (strided64, strided32, np.asfortranarray(strided32), strided32[::-1][::-1]):
        got = env.cache.match_prefix(tokens)
        assert got.num_tokens == expected.num_tokens
        assert got.pages.tolist() == expected.pages.tolist()
    if torch is not None:
        got = env.cache.match_prefix(torch.from_numpy(long)[::2])
        assert got.pages.tolist() == expected.pages.tolist()
    assert not snap.diff(before, snap.take()), "a pure lookup changed the segment"
    # And through an allocation: the same reuse as the contiguous copy.
    allocs = env.view.allocate_pages_for_sequences_with_prefix(
        [R(60, strided32), R(61, np.ascontiguousarray(strided32))])
    assert allocs[0].reused_tokens == allocs[1].reused_tokens == 12   # the last token computed
    assert allocs[0].page_table[:3].tolist() == allocs[1].page_table[:3].tolist()
    assert env.view.state(60).tokens.tolist() == strided32.tolist()
    env.view.release([60, 61])
    env.cache.check()


def test_out_of_pages_messages_say_what_holds_the_pages(env):
    """An empty pool short for a batch once said "every other page is held by live
    sequences" though none were. These batches take the lock (they evict before they know),
    so they are not in the byte-for-byte table; they still change nothing."""
    before = {s: env.view.state(s).pages.tolist() for s in env.view.live_sequences}
    with pytest.raises(OutOfPagesError, match=r"more than the pool's 32 pages in all"):
        env.view.allocate_pages_for_sequences_with_prefix(
            [R(50, list(range(20 * PAGE))), R(51, list(range(5000, 5000 + 20 * PAGE)))])
    held = 32 - env.cache.stats().free_pages - env.cache.stats().evictable_pages
    with pytest.raises(OutOfPagesError, match=rf"the other {held} pages are held by live "
                                              r"sequences \(their own pages, and the cached"):
        env.view.allocate_pages_for_sequences_with_prefix([R(50, list(range((32 - held + 1) * PAGE)))])
    assert {s: env.view.state(s).pages.tolist() for s in env.view.live_sequences} == before
    env.cache.check()


def test_65_pages_on_an_empty_64_page_pool(segment_name):
    """65 pages asked of an empty 64-page pool: nothing is held, so the message must not
    blame live sequences; and the request is refused before the lock (the segment is unchanged)."""
    with HostKVCache.create(segment_name, small_config(num_pages=64, page_size=PAGE)) as cache:
        view = WorkerView(cache)
        cache.reap()
        snap = MetadataSnapshot(cache)
        before = snap.take()
        with pytest.raises(OutOfPagesError) as info:
            view.allocate_pages_for_sequences_with_prefix([R(1, list(range(65 * PAGE)))])
        assert "needs 65 pages, more than the pool's 64 pages in all" in str(info.value)
        assert "live sequences" not in str(info.value)
        assert (info.value.needed, info.value.available) == (65, 64)
        assert not snap.diff(before, snap.take())
        # Two requests that fit alone but not together: the batch says the same.
        with pytest.raises(OutOfPagesError, match="more than the pool's 64 pages in all") as info:
            view.allocate_pages_for_sequences_with_prefix(
                [R(1, list(range(40 * PAGE))), R(2, list(range(9000, 9000 + 30 * PAGE)))])
        assert "live sequences" not in str(info.value)
        view.close()
        cache.check()
