"""Commit when the undo log is too small.

Commit is best effort for radix node records (docs/design.md: it evicts, and otherwise leaves the
pages uncached). The undo log is not such a resource: a log too small for the batch is a
configuration error, and swallowing it showed up only as "0 pages cached". Commit and
release raise CapacityError(resource="undo log") and change nothing, as every other
operation too big for the log does; a smaller batch still works, and close() releases one
sequence per mutation.
"""

from __future__ import annotations

import pytest

import hostkv
from hostkv import CapacityError, SequenceRequest as R, WorkerView, _introspect, _sequences

PS = 4
SEQS = list(range(5))   # five 40-page sequences: together too big for the log, each fits


def semantic_state(cache):
    seg = cache._segment

    def capture():
        info = seg.header_info()
        return (frozenset(_introspect.tree_contents(seg)), tuple(sorted(_sequences.live_sequences(seg))),
                info["free_pages"], info["stats"]["st_inserted_pages"])

    return seg.run_locked(capture)


@pytest.fixture
def small_log(segment_name):
    cache = hostkv.HostKVCache.create(segment_name, hostkv.HostKVConfig(
        num_pages=256, page_size=PS, page_bytes=64, max_processes=4, undo_log_capacity=256))
    view = WorkerView(cache)
    # Allocated one by one (each fits the log alone).
    for seq_id in SEQS:
        view.allocate_pages_for_sequences_with_prefix(
            [R(seq_id, [1000 * (seq_id + 1) + t for t in range(40 * PS)])])
    yield cache, view
    view.close()
    cache.close()


@pytest.mark.parametrize("how", ["commit", "release"])
def test_a_commit_too_big_for_the_undo_log_says_so_and_changes_nothing(small_log, how):
    cache, view = small_log
    before = semantic_state(cache)
    with pytest.raises(CapacityError, match="undo log") as info:
        if how == "commit":
            view.commit(SEQS)
        else:
            view.release(SEQS)
    assert info.value.resource == "undo log"
    assert semantic_state(cache) == before
    assert sorted(view.live_sequences) == SEQS
    assert all(view.state(s).committed_tokens == 0 for s in SEQS)
    cache.check()
    # One at a time fits: the same pages are cached then.
    if how == "commit":
        assert [view.commit([s])[0] for s in SEQS] == [40] * len(SEQS)
    else:
        assert [view.release([s])[0] for s in SEQS] == [40] * len(SEQS)
    assert cache.stats().cached_pages == 40 * len(SEQS)
    cache.check()


def test_close_releases_one_sequence_per_mutation_so_it_fits(small_log):
    cache, view = small_log
    before = semantic_state(cache)
    with pytest.raises(CapacityError, match="undo log"):
        view.release(SEQS, commit=False)               # 200 pages' worth: too big as well
    assert semantic_state(cache) == before
    view.close()
    assert cache.stats().active_sequences == 0
    cache.check()
