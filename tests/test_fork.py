"""A forked child and the handles it inherits.

py-lmdb's rule: objects inherited by a child never tear down shared state. A child
inherits its parent's numpy/torch views of the pool as well as the handle, so close() must
refuse to unmap under them there as in the parent; and an observer's handle stays an observer.
"""

from __future__ import annotations


import pytest

from hostkv import HostKVCache

from conftest import run_in_fork


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("call_first", [False, True])
def test_forked_child_close_refuses_while_inherited_views_live(cache, kind, call_first):
    # Before the fix the child's export count was reset at fork: close() unmapped the pool
    # under the inherited arrays, and the next touch was a SIGSEGV.
    view = cache.pages_array() if kind == "numpy" else cache.pages_tensor()
    view[0, 0] = 7

    def child():
        if call_first:
            cache.stats()            # the first call in the child takes its own lease
        try:
            cache.close()
        except BufferError:
            pass
        else:
            return 1                 # unmapped under `view`
        if int(view[0, 0]) != 7:     # still mapped and readable
            return 2
        return 0

    assert run_in_fork(child) == 0
    assert int(view[0, 0]) == 7
    del view
    cache.reap()
    cache.check()
    assert cache.stats().active_processes == 1


def test_forked_child_closes_once_the_inherited_views_are_gone(cache):
    view = cache.pages_array()

    def child():
        nonlocal view
        cache.stats()
        del view
        cache.close()
        return 0 if cache.closed else 1

    assert run_in_fork(child) == 0
    del view
    assert cache.reap() == 0          # the child closed: its lease was given back
    cache.check()
    assert cache.stats().active_processes == 1


def test_observer_takes_no_lease_in_a_forked_child(cache):
    # An observer's child once registered a lease at its first call.
    observer = HostKVCache.attach(cache.name, lease=False)
    try:
        before = cache.stats()

        def child():
            st = observer.stats()
            if observer._segment.lease_slot_index != -1:
                return 1
            if st.active_processes != 1:
                return 2
            observer.check()
            observer.close()
            return 0

        assert run_in_fork(child) == 0
        after = cache.stats()
        assert after.active_processes == 1
        assert cache.reap() == 0
        assert after.leases_reaped == before.leases_reaped
    finally:
        observer.close()
