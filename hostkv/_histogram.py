"""The log2 histograms hostkv keeps: one definition of their buckets, and one percentile.

Two kinds exist: the segment's lock wait and hold times, in ns, counted by the compiled
layer (_segment.pyx's record_duration), and a remote tier's fetch round trips, in µs
(hostkv/remote/stats.py). Both count whole units: entry b counts the values in
[2**(b-1), 2**b), entry 0 counts the value 0 alone, and the last entry also counts every
value beyond it.

Entry 0 is not "under one unit, somewhere": for lock waits it is every acquisition taken at
the first try, which is not timed and is recorded as a wait of exactly 0 (_segment.pyx's
_acquire), the common case of an uncontended lock. So a percentile that falls in entry 0 is
0, exactly; one in entry b >= 1 is 2**b, the top of its bucket (an upper bound: the values
there are below it).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["bucket_of", "percentile", "upper"]


def bucket_of(value: int, buckets: int) -> int:
    """The entry of a histogram of `buckets` entries that counts `value` (whole units)."""
    return 0 if value <= 0 else min(value.bit_length(), buckets - 1)


def upper(bucket: int) -> int:
    """The exclusive upper bound of entry `bucket`, in the histogram's unit."""
    return 1 << bucket


def percentile(histogram: Sequence[int], fraction: float) -> int:
    """An upper bound of the given percentile (0 < fraction <= 1) of what the histogram
    counted, in its unit: 0 if it falls in entry 0 (which holds only zeros) or the
    histogram is empty, else the top of the entry it falls in."""
    total = sum(histogram)
    if total == 0:
        return 0
    running = 0
    for bucket, count in enumerate(histogram):
        running += count
        if running >= fraction * total:
            return 0 if bucket == 0 else upper(bucket)
    return upper(len(histogram) - 1)
