"""A process's start and end around a segment: no environment variable can make it _exit, a
failed create leaves no thread behind, and exiting with a handle open never waits out the
lock timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hostkv import HostKVCache, SegmentNotFoundError, _segment

from conftest import small_config

CHILD_TIMEOUT = 120


def _python(script: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kwargs)


@pytest.mark.parametrize("value", ["1", "2:keyboard_interrupt", "5:memory_error"])
def test_a_stray_crash_variable_does_not_kill_a_process(segment_name, value):
    # Before: every build honoured HOSTKV_CRASH_AT and _exited (status 77) at that step.
    child = _python(f"""
        import hostkv
        cfg = hostkv.HostKVConfig(num_pages=32, page_size=4, page_bytes=64, max_processes=8)
        with hostkv.HostKVCache.create({segment_name!r}, cfg) as cache:
            with hostkv.WorkerView(cache) as view:
                view.allocate_pages_for_sequences_with_prefix(
                    [hostkv.SequenceRequest(1, list(range(10)))])
                view.release([1])
            cache.check()
            print("ok", cache.stats().rollbacks)
        """, env=dict(os.environ, HOSTKV_CRASH_AT=value))
    try:
        out, err = child.communicate(timeout=CHILD_TIMEOUT)
    finally:
        child.kill()
    assert child.returncode == 0, err
    assert out.split() == ["ok", "0"]


def _task_ids() -> set:
    return set(os.listdir("/proc/self/task"))


def test_a_failed_create_stops_its_lease_thread(segment_name):
    # Step 1 is the first logged store of create: the lease registration, after the lease
    # thread started. Before the fix the thread stayed behind.
    before = _task_ids()
    _segment._arm_new_segments(1, "keyboard_interrupt")
    try:
        with pytest.raises(KeyboardInterrupt):
            HostKVCache.create(segment_name, small_config())
    finally:
        _segment._arm_new_segments(0)
    assert _task_ids() - before == set()
    with pytest.raises(SegmentNotFoundError):
        HostKVCache.attach(segment_name)


def test_exit_does_not_wait_out_the_lock_timeout(segment_name):
    # A process exits with a handle and a live sequence still open while another process
    # holds the lock. Before the fix its interpreter exit waited the whole lock timeout
    # (60 s here) to give its lease back; now it waits EXIT_LOCK_TIMEOUT at most and leaves
    # the lease (and the sequence) to the next sweep, as a death would.
    with HostKVCache.create(segment_name, small_config()) as cache:
        child = _python(f"""
            import sys
            import hostkv
            cache = hostkv.HostKVCache.attach({segment_name!r}, lock_timeout=60)
            view = hostkv.WorkerView(cache)
            view.allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(1, list(range(10)))])
            print("ready", flush=True)
            sys.stdin.readline()
            """)
        try:
            assert child.stdout.readline().strip() == "ready"

            def exit_child_while_holding_the_lock():
                child.stdin.write("go\n")
                child.stdin.flush()
                # Well under the child's 60 s lock timeout: a stalled exit fails here.
                return child.wait(timeout=30)

            assert cache._segment.run_locked(exit_child_while_holding_the_lock) == 0
        finally:
            child.kill()
            child.communicate()
        assert cache.reap() == 1
        st = cache.stats()
        assert st.active_processes == 1 and st.active_sequences == 0
        cache.check()
