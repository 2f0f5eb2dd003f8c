"""hostkv._pages, the page pool on its own: allocation from the free stack, reference
drops, index checks, and the invariants check_pages walks (free stack vs refcounts)."""

from __future__ import annotations

import numpy as np
import pytest

import hostkv
from hostkv import _pages
from conftest import small_config


@pytest.fixture
def seg(segment_name):
    cache = hostkv.HostKVCache.create(segment_name, small_config(num_pages=16))
    yield cache._segment
    cache.close()


def test_alloc_takes_distinct_free_pages_and_free_returns_them(seg):
    pages = _pages.alloc_pages(seg, 5)
    assert pages.dtype == np.int32 and len(set(pages.tolist())) == 5
    counts = _pages.refcounts(seg)
    assert counts[pages].tolist() == [1] * 5 and int(counts.sum()) == 5
    assert seg.run_locked(_pages.check_pages, seg) is None
    _pages.free_pages(seg, pages)
    assert int(_pages.refcounts(seg).sum()) == 0
    seg.run_locked(_pages.check_pages, seg)
    assert len(_pages.alloc_pages(seg, 16)) == 16       # every page is free again


def test_a_short_pool_changes_nothing(seg):
    held = _pages.alloc_pages(seg, 10)
    before = _pages.refcounts(seg)
    with pytest.raises(hostkv.OutOfPagesError, match="7 pages needed, 6 free"):
        _pages.alloc_pages(seg, 7)
    assert np.array_equal(_pages.refcounts(seg), before)
    assert len(_pages.alloc_pages(seg, 0)) == 0
    with pytest.raises(ValueError, match="page count must be >= 0, got -1"):
        _pages.alloc_pages(seg, -1)
    _pages.free_pages(seg, held)


def test_bad_frees_are_all_or_nothing(seg):
    held = _pages.alloc_pages(seg, 3)
    before = _pages.refcounts(seg)
    with pytest.raises(ValueError, match=r"page indexes must be in \[0, 16\), got 0..16"):
        _pages.free_pages(seg, [int(held[0]), 16])
    with pytest.raises(ValueError, match="1-D sequence of integers"):
        _pages.free_pages(seg, [[1, 2]])
    free_page = next(p for p in range(16) if before[p] == 0)
    with pytest.raises(hostkv.CorruptionError):
        # A page that is already free: the first page's drop is undone with it.
        _pages.free_pages(seg, [int(held[0]), free_page])
    assert np.array_equal(_pages.refcounts(seg), before)
    seg.run_locked(_pages.check_pages, seg)
    _pages.free_pages(seg, held)
