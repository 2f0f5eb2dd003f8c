"""Pre-faulting the page pool: the compiled madvise helper it is built on."""

from __future__ import annotations

import numpy as np
import pytest

import hostkv

MADV = hostkv._segment.MADV


def pattern(nbytes: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


# -- the compiled helper ----------------------------------------------------------------------


def test_advise_pool_checks_its_range_and_widens_to_whole_pages(cache):
    seg = cache._segment
    total = cache.config.num_pages * cache.config.page_bytes
    pool = cache.pages_array().reshape(-1)
    pool[:] = pattern(total, seed=5)
    expected = pool.copy()
    write_advice = MADV["MADV_POPULATE_WRITE"]
    assert seg.advise_pool(0, 0, write_advice) == 0
    assert seg.advise_pool(1, 10, write_advice) == 0          # an unaligned start is widened
    assert seg.advise_pool(total - 1, 1, write_advice) == 0
    assert np.array_equal(pool, expected)
    for start, length in ((-1, 1), (0, total + 1), (total, 1), (1, total)):
        with pytest.raises(ValueError, match="not in the page pool"):
            seg.advise_pool(start, length, write_advice)
    del pool
    cache.close()
    with pytest.raises(ValueError, match="closed"):
        seg.advise_pool(0, 1, write_advice)
