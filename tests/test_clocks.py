"""Clocks: lock timeouts and lease sweeps that no clock jump or time namespace can skew.

CLOCK_MONOTONIC differs between time namespaces (containers may offset it), so no stamp of
it is ever compared across processes: each handle paces its own once-a-second lease sweep.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import sysconfig
import textwrap
import time

from hostkv import _segment

from lib.rawseg import RawSegment
from test_multiprocess import _attach_and_vanish, finished

LAYOUT = _segment.layout_info()

# Where layout version 4 kept the shared "last sweep" stamp (CLOCK_MONOTONIC of whichever
# process swept last): the field that holds the creator's progress now (256 until layout 9;
# layout 10's longer config moved it).
OLD_LAST_SWEEP_AT = LAYOUT["header"]["hdr_reserved_bytes"]


def test_the_periodic_sweep_ignores_another_namespaces_clock(cache, segment_name, procs):
    # A process whose CLOCK_MONOTONIC runs far ahead (another time namespace) swept last:
    # before the fix every other process saw "last sweep in the future" and never swept
    # again, so a dead process's lease stayed until an allocation ran short.
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


SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <time.h>

/* The wall clock reads an hour ahead of the one the kernel's futex timeouts use: as if it
   had jumped between a reading and the wait that reading's deadline was meant for. */
int clock_gettime(clockid_t clock, struct timespec* ts) {
    static int (*real)(clockid_t, struct timespec*);
    if (!real) real = (int (*)(clockid_t, struct timespec*))dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(clock, ts);
    if (rc == 0 && clock == CLOCK_REALTIME) ts->tv_sec += 3600;
    return rc;
}
"""


def test_the_lock_timeout_ignores_the_wall_clock(cache, tmp_path):
    # The lock timeout's deadline was on CLOCK_REALTIME (pthread_mutex_timedlock): a wall
    # clock an hour off made a 0.5 s timeout wait an hour. It is on CLOCK_MONOTONIC now
    # (pthread_mutex_clocklock). The child's wall clock is skewed through LD_PRELOAD.
    source = tmp_path / "skew.c"
    source.write_text(SHIM)
    shim = tmp_path / "skew.so"
    compiler = (sysconfig.get_config_var("CC") or "cc").split()
    subprocess.run([*compiler, "-shared", "-fPIC", "-o", str(shim), str(source), "-ldl"],
                   check=True, timeout=120)
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            import hostkv
            assert time.time() > {time.time() + 3000}, "the wall clock is not skewed"
            cache = hostkv.HostKVCache.attach({cache.name!r}, lock_timeout=0.5)
            print("ready", flush=True)
            sys.stdin.readline()
            try:
                cache.stats()
                print("locked")
            except hostkv.LockTimeoutError:
                print("timeout")
            """)],
        env=dict(os.environ, LD_PRELOAD=str(shim)), text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()

        def child_times_out_while_this_holds_the_lock():
            child.stdin.write("go\n")
            child.stdin.flush()
            # Far less than the hour a realtime deadline would wait.
            return child.communicate(timeout=60)

        out, err = cache._segment.run_locked(child_times_out_while_this_holds_the_lock)
    finally:
        child.kill()
        child.communicate()
    assert child.returncode == 0, err
    assert out.split() == ["timeout"]
    cache.reap()
    cache.check()
