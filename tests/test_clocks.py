"""Clocks (issue 10 item 11).

CLOCK_MONOTONIC differs between time namespaces (containers may offset it), so no stamp of
it is ever compared across processes: each handle paces its own once-a-second lease sweep.
"""

from __future__ import annotations

import struct
import time

from hostkv import _segment

from rawseg import RawSegment
from test_multiprocess import _attach_and_vanish, finished

LAYOUT = _segment.layout_info()

# Where layout version 4 kept the shared "last sweep" stamp (CLOCK_MONOTONIC of whichever
# process swept last), at the offset that holds the creator's progress now.
OLD_LAST_SWEEP_AT = 256


def test_the_periodic_sweep_ignores_another_namespaces_clock(cache, segment_name, procs):
    # A process whose CLOCK_MONOTONIC runs far ahead (another time namespace) swept last:
    # before the fix every other process saw "last sweep in the future" and never swept
    # again, so a dead process's lease stayed until an allocation ran short.
    assert OLD_LAST_SWEEP_AT in (LAYOUT["header"].get("hdr_reserved_bytes"),
                                 LAYOUT["header"].get("hdr_last_sweep_ns"))
    p = procs(_attach_and_vanish, segment_name)
    finished(p, 0)
    assert cache._segment.header_info()["active_leases"] == 2
    with RawSegment(segment_name) as raw:
        struct.pack_into("<q", raw.map, OLD_LAST_SWEEP_AT, 2**62)
    time.sleep(1.1)             # a sweep is due at the next lock (once a second)
    st = cache.stats()
    assert st.active_processes == 1
    assert st.leases_reaped == 1
    cache.check()
