"""WorkerView: a bad request or batch container is refused whole, before anything touches
the segment (the exact-rollback snapshots of worker_view_lib)."""

from __future__ import annotations

import numpy as np
import pytest

from hostkv import SequenceError, SequenceRequest as R

# make: the fixture busy is built on.
from lib.worker_view_lib import LIVE, P, _torch, assert_unchanged, busy, make, snapshot  # noqa: F401


# -- input validation --------------------------------------------------------------------------





# Each case: a function giving the bad batch (after a valid first request where it is a list),
# and the error expected. Ids and tokens are judged before anything touches the segment.
BAD_BATCHES = {
    "id-bool": (lambda: [R(True, [1, 2])], SequenceError),
    "id-numpy-bool": (lambda: [R(np.bool_(True), [1, 2])], SequenceError),
    "id-float": (lambda: [R(1.0, [1, 2])], SequenceError),
    "id-str": (lambda: [R("1", [1, 2])], SequenceError),
    "id-none": (lambda: [R(None, [1, 2])], SequenceError),
    "id-above-int64": (lambda: [R(2**63, [1, 2])], SequenceError),
    "id-below-int64": (lambda: [R(-2**63 - 1, [1, 2])], SequenceError),
    "id-twice": (lambda: [R(5, [1, 2]), R(np.int64(5), [3, 4])], SequenceError),
    "id-live": (lambda: [R(LIVE, [1, 2])], SequenceError),
    "prompt-empty-list": (lambda: [R(5, [])], SequenceError),
    "prompt-empty-array": (lambda: [R(5, np.empty(0, dtype=np.int32))], SequenceError),
    "prompt-empty-tensor": (lambda: [R(5, _torch().empty(0, dtype=_torch().int64))],
                            SequenceError),
    "token-negative": (lambda: [R(5, [1, -1])], ValueError),
    "token-2**31": (lambda: [R(5, [1, 2**31])], ValueError),
    "token-2**63": (lambda: [R(5, [1, 2**63])], ValueError),
    "token-2**64": (lambda: [R(5, [1, 2**64])], ValueError),
    "token-float": (lambda: [R(5, [1, 2.0])], ValueError),
    "token-bool": (lambda: [R(5, [True, False])], ValueError),
    "token-str": (lambda: [R(5, "12")], ValueError),
    "token-none": (lambda: [R(5, None)], ValueError),
    "token-none-inside": (lambda: [R(5, [1, None])], ValueError),
    "token-float-array": (lambda: [R(5, np.ones(3, dtype=np.float32))], ValueError),
    "token-2d-array": (lambda: [R(5, np.ones((2, 2), dtype=np.int32))], ValueError),
    "token-int32-array-negative": (lambda: [R(5, np.array([3, -4], dtype=np.int32))],
                                   ValueError),
    "token-int64-array-big": (lambda: [R(5, np.array([3, 2**31], dtype=np.int64))], ValueError),
    "token-uint32-array-big": (lambda: [R(5, np.array([3, 2**31], dtype=np.uint32))],
                               ValueError),
    "token-tensor-negative": (lambda: [R(5, _torch().tensor([1, -1]))], ValueError),
    "token-tensor-float": (lambda: [R(5, _torch().tensor([1.0, 2.0]))], ValueError),
    "namespace-negative": (lambda: [R(5, [1, 2], -1)], ValueError),
    "namespace-2**64": (lambda: [R(5, [1, 2], 2**64)], ValueError),
    "namespace-float": (lambda: [R(5, [1, 2], 1.0)], ValueError),
    "namespace-bool": (lambda: [R(5, [1, 2], True)], ValueError),
    "namespace-str": (lambda: [R(5, [1, 2], "0")], ValueError),
    "request-not-a-request": (lambda: [(5, [1, 2])], SequenceError),
}

# Not a list of requests at all.
BAD_CONTAINERS = {
    "single-request": (lambda: R(5, [1, 2]), SequenceError),
    "generator": (lambda: (r for r in [R(5, [1, 2])]), SequenceError),
    "none": (lambda: None, SequenceError),
    "dict": (lambda: {5: [1, 2]}, SequenceError),
}


def _assert_rejected_untouched(cache, view, batch, error):
    seg = cache._segment
    before = snapshot(cache, view, quiet=True)
    # Any logged store (the first step of any mutation) would raise MemoryError here instead.
    seg._arm_crash_point(1, "memory_error")
    try:
        with pytest.raises(error):
            view.allocate_pages_for_sequences_with_prefix(batch)
        assert seg.crash_steps_left == 1, "validation touched the segment"
    finally:
        seg._arm_crash_point(0)
    assert_unchanged(before, snapshot(cache, view), rolled_back=False)


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
def test_bad_request_rejects_the_whole_batch_before_touching_the_segment(busy, case):
    cache, view = busy
    make_bad, error = BAD_BATCHES[case]
    # The valid first request would borrow P: it must not have.
    batch = [R(10, P + [5])] + make_bad()
    _assert_rejected_untouched(cache, view, batch, error)
    # The same ids are usable at once.
    allocs = view.allocate_pages_for_sequences_with_prefix([R(10, P + [5]), R(5, [1, 2])])
    assert [a.reused_tokens for a in allocs] == [12, 0]
    view.release([10, 5], commit=False)
    cache.check()


@pytest.mark.parametrize("case", sorted(BAD_CONTAINERS))
def test_bad_batch_container_is_rejected(busy, case):
    cache, view = busy
    make_bad, error = BAD_CONTAINERS[case]
    _assert_rejected_untouched(cache, view, make_bad(), error)


def test_empty_batch_allocates_nothing(busy):
    cache, view = busy
    before = snapshot(cache, view, quiet=True)
    assert view.allocate_pages_for_sequences_with_prefix([]) == []
    assert view.allocate_pages_for_sequences_with_prefix(()) == []
    assert_unchanged(before, snapshot(cache, view), rolled_back=False)
