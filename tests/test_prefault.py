"""Pre-faulting the page pool (HostKVCache.start_prefault) and the huge-page advice.

The prefault thread must never change a byte of the pool (other processes' KV is there),
must let saves run beside it, must be stopped by close() before the mapping goes, and must
not survive into a forked child. Where a test needs the thread at a known point, it wraps
the segment the thread is given in a proxy whose advise_pool waits at a chosen chunk: the
thread is then "running" for certain, whatever the machine's speed, and nothing is timed.
"""

from __future__ import annotations

import errno
import logging
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import hostkv
from hostkv import HostKVCache, PrefaultStatus, SequenceRequest, WorkerView
from hostkv import cache as cache_module

from conftest import run_in_fork, small_config

CHILD_TIMEOUT = 60
WAIT = 30.0               # the most any wait here takes before the test fails


def big_config(**overrides) -> hostkv.HostKVConfig:
    """A 1 MiB pool: 16 chunks of the 64 KiB the tests set PREFAULT_CHUNK to."""
    values = dict(num_pages=256, page_size=4, page_bytes=4096, max_processes=8)
    values.update(overrides)
    return hostkv.HostKVConfig(**values)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(cache_module, "PREFAULT_CHUNK", 64 << 10)


@pytest.fixture
def big(segment_name, small_chunks):
    c = HostKVCache.create(segment_name, big_config())
    try:
        yield c
    finally:
        c.close()


def wait_finished(cache: HostKVCache) -> PrefaultStatus:
    """Waits for the prefault to leave "running"; joins its thread."""
    deadline = time.monotonic() + WAIT
    while cache.prefault_status().state == "running":
        assert time.monotonic() < deadline, "the prefault did not finish"
        time.sleep(0.001)
    run = cache._prefault_run
    if run is not None and run.thread is not None:
        run.thread.join(WAIT)
        assert not run.thread.is_alive()
    return cache.prefault_status()


def prefault_threads():
    return [t for t in threading.enumerate() if t.name.startswith("hostkv-prefault-")]


class GatedSegment:
    """A Segment as the prefault thread sees it. Its advise_pool waits before call `gate_at`
    (1-based) until released (or, with until_closing, until close() begins); answers
    `answers[advice]` instead of calling for those advice values; and answers `script[n]`
    for call n."""

    def __init__(self, segment, gate_at=0, until_closing=False, answers=None, script=None):
        self._segment = segment
        self.gate_at = gate_at
        self.until_closing = until_closing
        self.answers = answers or {}
        self.script = script or {}
        self.calls = 0
        self.reached = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name):
        return getattr(self._segment, name)

    def advise_pool(self, start, length, advice):
        self.calls += 1
        if self.calls == self.gate_at:
            self.reached.set()
            deadline = time.monotonic() + WAIT
            while time.monotonic() < deadline and not self.release.wait(0.001):
                if self.until_closing and (self._segment.closing or self._segment.closed):
                    break
        if self.calls in self.script:
            return self.script[self.calls]
        if advice in self.answers:
            return self.answers[advice]
        return self._segment.advise_pool(start, length, advice)


class Gates:
    """What the gate fixture hands a test: gates(**kwargs) sets how the next prefault
    threads' segments behave (GatedSegment's arguments); gates[i] is the i-th thread's."""

    def __init__(self):
        self.kwargs = {}
        self.segments = []
        self.started = 0

    def __call__(self, **kwargs):
        self.kwargs = kwargs

    def __getitem__(self, i):
        return self.segments[i]

    def reached(self, i=0):
        """Waits until thread i reaches its gate; returns its GatedSegment."""
        deadline = time.monotonic() + WAIT
        while len(self.segments) <= i:
            assert time.monotonic() < deadline, "no prefault thread started"
            time.sleep(0.001)
        assert self.segments[i].reached.wait(WAIT), "the thread never reached its gate"
        return self.segments[i]


@pytest.fixture
def gate(monkeypatch):
    original = cache_module._prefault
    gates = Gates()

    def gated(segment, run):
        gates.started += 1
        proxy = GatedSegment(segment, **gates.kwargs)
        gates.segments.append(proxy)
        original(proxy, run)

    monkeypatch.setattr(cache_module, "_prefault", gated)
    yield gates
    for proxy in gates.segments:
        proxy.release.set()


# -- the thread runs to the end ----------------------------------------------------------------


def test_idle_before_start(cache):
    st = cache.prefault_status()
    assert st.state == "idle"
    assert (st.done_bytes, st.method, st.seconds, st.error) == (0, "", 0.0, "")
    assert st.total_bytes == cache.config.num_pages * cache.config.page_bytes
    assert isinstance(st, hostkv.PrefaultStatus) and "PrefaultStatus" in hostkv.__all__


def test_prefault_completes(big):
    big.start_prefault()
    st = wait_finished(big)
    assert st.state == "done", st
    assert st.done_bytes == st.total_bytes == 256 * 4096
    # Linux 5.14+ knows MADV_POPULATE_READ; an older kernel falls back.
    assert st.method in ("MADV_POPULATE_WRITE", "MADV_POPULATE_READ", "MADV_WILLNEED")
    assert st.error == "" and st.seconds >= 0
    assert not prefault_threads()


def test_a_one_chunk_pool_completes(cache):
    cache.start_prefault()
    st = wait_finished(cache)
    assert st.state == "done" and st.done_bytes == st.total_bytes == 32 * 64


def test_progress_shows_while_running(big, gate):
    gate(gate_at=5)
    big.start_prefault()
    gate.reached()
    st = big.prefault_status()
    assert st.state == "running"
    assert st.done_bytes == 4 * (64 << 10)           # four chunks before the gate
    gate[0].release.set()
    assert wait_finished(big).state == "done"


# -- the pool's bytes -------------------------------------------------------------------------


def pattern(nbytes: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def test_prefault_in_another_handle_keeps_every_byte(segment_name, small_chunks):
    with HostKVCache.create(segment_name, big_config()) as writer:
        pool = writer.pages_array().reshape(-1)
        expected = pattern(pool.size)
        pool[:] = expected
        with HostKVCache.attach(segment_name) as other:     # its own, cold mapping
            other.start_prefault()
            assert wait_finished(other).state == "done"
            seen = other.pages_array().reshape(-1)
            assert np.array_equal(seen, expected)
            del seen
        assert np.array_equal(pool, expected)
        del pool


def _prefault_in_child(name: str) -> None:
    cache = HostKVCache.attach(name)
    cache.start_prefault()
    deadline = time.monotonic() + WAIT
    while cache.prefault_status().state == "running" and time.monotonic() < deadline:
        time.sleep(0.001)
    state = cache.prefault_status().state
    cache.close()
    sys.exit(0 if state == "done" else 3)


def test_prefault_in_another_process_keeps_every_byte(segment_name, procs):
    with HostKVCache.create(segment_name, big_config()) as writer:
        pool = writer.pages_array().reshape(-1)
        expected = pattern(pool.size, seed=2)
        pool[:] = expected
        p = procs(_prefault_in_child, segment_name)
        p.join(CHILD_TIMEOUT)
        assert p.exitcode == 0
        assert np.array_equal(pool, expected)
        del pool
        writer.check()


def test_saves_before_and_during_the_prefault(big, gate):
    page_size, page_bytes = big.config.page_size, big.config.page_bytes
    view = WorkerView(big)
    pool = big.pages_array()

    def save(seq_id, seed):
        tokens = np.arange(seed * 1000, seed * 1000 + 4 * page_size, dtype=np.int32)
        (alloc,) = view.allocate_pages_for_sequences_with_prefix([SequenceRequest(seq_id, tokens)])
        kv = pattern(len(alloc.page_table) * page_bytes, seed).reshape(-1, page_bytes)
        pool[alloc.page_table] = kv
        view.release([seq_id])                       # commits the full pages
        return tokens, kv

    before = save(1, 1)
    gate(gate_at=3)
    big.start_prefault()
    gate.reached()
    assert big.prefault_status().state == "running"
    during = save(2, 2)                              # the thread is between chunks 2 and 3
    gate[0].release.set()
    assert wait_finished(big).state == "done"
    after = save(3, 3)
    for tokens, kv in (before, during, after):
        match = big.match_prefix(np.append(tokens, 0))
        assert match.num_tokens == len(tokens)
        assert np.array_equal(pool[match.pages], kv)
    del pool
    view.close()
    big.check()


def test_writes_racing_a_real_prefault_are_kept(big):
    # No gate: the writes and the real madvise calls race; every write must stick.
    pool = big.pages_array()
    big.start_prefault()
    for page in range(pool.shape[0]):
        pool[page] = page % 251
    wait_finished(big)
    assert all(int(pool[page, -1]) == page % 251 for page in range(pool.shape[0]))
    del pool


# -- close, idempotence, threads --------------------------------------------------------------


def test_close_during_a_running_prefault_stops_it(big, gate):
    gate(gate_at=3, until_closing=True)              # holds chunk 3 until close() begins
    big.start_prefault()
    gate.reached()
    assert big.prefault_status().state == "running"
    big.close()
    assert big.closed
    assert not prefault_threads()
    st = big.prefault_status()                       # still answers after close()
    assert st.state == "stopped"
    assert 0 < st.done_bytes < st.total_bytes
    with pytest.raises(ValueError):
        big.start_prefault()


def test_close_right_after_start_never_leaves_a_thread(new_name):
    # Real calls, one 16 MiB chunk: close() lands before, inside or after it.
    for _ in range(10):
        c = HostKVCache.create(new_name(), big_config(num_pages=4096))
        c.start_prefault()
        c.close()
        assert not prefault_threads()
        assert c.prefault_status().state in ("stopped", "done")


def test_close_that_fails_leaves_the_prefault_running(big, gate):
    gate(gate_at=2)
    big.start_prefault()
    gate.reached()
    view = big.pages_array()
    with pytest.raises(BufferError):
        big.close()                                  # a view is alive: nothing closes
    assert big.prefault_status().state == "running"
    gate[0].release.set()
    assert wait_finished(big).state == "done"
    del view


def test_start_is_idempotent(big, gate):
    gate(gate_at=2)
    big.start_prefault()
    gate.reached()
    run = big._prefault_run
    for _ in range(3):
        assert big.start_prefault() is None
    assert big._prefault_run is run and gate.started == 1
    assert len(prefault_threads()) == 1
    gate[0].release.set()
    assert wait_finished(big).state == "done"
    big.start_prefault()                             # done: nothing more to do
    assert big._prefault_run is run and gate.started == 1
    assert not prefault_threads()


def test_two_threads_starting_at_once_start_one_prefault(big, gate):
    gate(gate_at=1)
    barrier = threading.Barrier(8)
    errors = []

    def start():
        try:
            barrier.wait(WAIT)
            big.start_prefault()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not errors
    gate.reached()
    assert gate.started == 1 and len(prefault_threads()) == 1
    gate[0].release.set()
    assert wait_finished(big).state == "done"


def test_start_on_a_closed_cache_raises(segment_name):
    c = HostKVCache.create(segment_name, small_config())
    c.close()
    with pytest.raises(ValueError, match="closed"):
        c.start_prefault()
    assert c.prefault_status().state == "idle"


# -- fallbacks and failures -------------------------------------------------------------------

MADV = hostkv._segment.MADV


@pytest.mark.parametrize("refused, method", [
    (("MADV_POPULATE_READ",), "MADV_POPULATE_WRITE"),
    (("MADV_POPULATE_READ", "MADV_POPULATE_WRITE"), "MADV_WILLNEED"),
])
def test_an_older_kernel_falls_back(big, gate, refused, method):
    gate(answers={MADV[name]: errno.EINVAL for name in refused})
    big.start_prefault()
    st = wait_finished(big)
    assert st.state == "done" and st.method == method
    assert st.done_bytes == st.total_bytes


def test_a_failure_is_logged_once_and_recorded_never_raised(big, gate, caplog):
    answers = {MADV[name]: errno.EINVAL for name in
               ("MADV_POPULATE_WRITE", "MADV_POPULATE_READ", "MADV_WILLNEED")}
    gate(answers=answers)
    with caplog.at_level(logging.WARNING, logger="hostkv"):
        big.start_prefault()
        st = wait_finished(big)
    assert st.state == "failed" and st.done_bytes == 0
    assert "MADV_WILLNEED" in st.error and "Invalid argument" in st.error
    records = [r for r in caplog.records if r.name == "hostkv"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    big.start_prefault()                             # failed stays failed: not logged again
    assert big.prefault_status().state == "failed"
    assert len([r for r in caplog.records if r.name == "hostkv"]) == 1


def test_a_failure_after_some_chunks(big, gate):
    gate(script={4: errno.EFAULT})
    big.start_prefault()
    st = wait_finished(big)
    assert st.state == "failed" and st.done_bytes == 3 * (64 << 10)
    assert st.method == "MADV_POPULATE_READ" and "Bad address" in st.error


def test_a_transient_error_is_retried(big, gate):
    gate(script={2: errno.EAGAIN, 3: errno.EINTR})   # chunk 2 goes through at its third try
    big.start_prefault()
    st = wait_finished(big)
    assert st.state == "done" and st.done_bytes == st.total_bytes
    assert gate[0].calls == 16 + 2


def test_a_transient_error_that_persists_fails(big, gate):
    gate(script={n: errno.EAGAIN for n in range(2, 10)})
    big.start_prefault()
    st = wait_finished(big)
    assert st.state == "failed" and st.done_bytes == 64 << 10
    assert "Resource temporarily unavailable" in st.error


# -- fork -------------------------------------------------------------------------------------


def test_a_forked_child_does_not_inherit_the_thread(big, gate):
    gate(gate_at=2)
    big.start_prefault()
    gate.reached()                                   # the parent's thread is running

    def child():
        st = big.prefault_status()
        if st.state != "idle" or st.done_bytes != 0:
            return 3                                 # the parent's run leaked in
        if prefault_threads():
            return 4
        gate()                                       # the child's own run: no gate
        big.start_prefault()
        st = wait_finished(big)
        if st.state != "done" or st.done_bytes != st.total_bytes:
            return 5
        big.close()
        return 0 if not prefault_threads() else 6

    assert run_in_fork(child) == 0
    assert big.prefault_status().state == "running"  # the child changed nothing here
    gate[0].release.set()
    assert wait_finished(big).state == "done"
    assert big.reap() == 0                           # the child closed: its lease is back
    big.check()


def test_a_child_forked_during_a_real_prefault_can_close(segment_name, small_chunks):
    # No gate: the fork may land inside a madvise call the parent's thread has in flight
    # (256 of them here). The child must not wait for that call: its thread is not there.
    big = HostKVCache.create(segment_name, big_config(num_pages=4096))
    big.start_prefault()

    def child():
        big.start_prefault()
        deadline = time.monotonic() + WAIT
        while big.prefault_status().state == "running" and time.monotonic() < deadline:
            time.sleep(0.001)
        ok = big.prefault_status().state == "done"
        big.close()
        return 0 if ok else 3

    assert run_in_fork(child) == 0
    assert wait_finished(big).state == "done"
    big.close()


# -- interpreter exit -------------------------------------------------------------------------


def test_the_interpreter_exits_with_a_prefault_running(segment_name):
    # The thread is a daemon: exit does not wait for it; the handle is never closed.
    script = (
        "import sys, hostkv\n"
        "from hostkv import cache as m\n"
        "m.PREFAULT_CHUNK = 4096\n"
        f"c = hostkv.HostKVCache.create({segment_name!r}, hostkv.HostKVConfig("
        "num_pages=4096, page_size=4, page_bytes=4096, max_processes=8))\n"
        "c.start_prefault()\n"
        "print(c.prefault_status().state)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=CHILD_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("running", "done")
    assert result.stderr == ""


# -- huge pages -------------------------------------------------------------------------------


def test_huge_pages_are_reported(cache):
    st = cache.prefault_status()
    assert st.huge_policy in ("", "never", "advise", "within_size", "always", "deny", "force")
    if st.huge_policy in ("", "never", "deny"):
        assert st.huge_pages == "off"
    else:
        assert st.huge_pages in ("advised", "refused")


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


MOUNTS = """\
22 1 0:21 / / rw,relatime - overlay overlay rw,lowerdir=/x
25 24 0:23 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
30 25 0:27 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24683652k{extra}
"""


@pytest.mark.parametrize("sysfs, extra, expected", [
    ("always within_size advise [never] deny force", "", "never"),
    ("always within_size advise [never] deny force", ",huge=advise", "advise"),
    ("always within_size advise [never] deny force", ",huge=within_size", "within_size"),
    # shmem_enabled is the internal mount's: its "advise" does nothing for /dev/shm ...
    ("always within_size [advise] never deny force", "", "never"),
    # ... but deny and force override every tmpfs.
    ("always within_size advise never [deny] force", ",huge=always", "deny"),
    ("always within_size advise never deny [force]", "", "force"),
])
def test_huge_policy_is_the_mounts_option(tmp_path, sysfs, extra, expected):
    policy = cache_module._shmem_huge_policy(
        "/dev/shm", write(tmp_path, "shmem_enabled", sysfs),
        write(tmp_path, "mountinfo", MOUNTS.format(extra=extra)))
    assert policy == expected


def test_huge_policy_of_a_stacked_or_missing_mount(tmp_path):
    sysfs = write(tmp_path, "shmem_enabled", "always within_size advise [never] deny force")
    stacked = MOUNTS.format(extra="") + \
        "31 30 0:28 / /dev/shm rw - tmpfs tmpfs rw,size=4G,huge=within_size\n"
    assert cache_module._shmem_huge_policy(
        "/dev/shm", sysfs, write(tmp_path, "stacked", stacked)) == "within_size"
    # No mount of its own: /dev's tmpfs holds it.
    no_shm = "".join(MOUNTS.format(extra="").splitlines(True)[:2]).replace(
        "mode=755", "mode=755,huge=always")
    assert cache_module._shmem_huge_policy(
        "/dev/shm", sysfs, write(tmp_path, "no_shm", no_shm)) == "always"
    # Not a tmpfs at all.
    assert cache_module._shmem_huge_policy(
        "/dev/shm", sysfs, write(tmp_path, "overlay", MOUNTS.splitlines(True)[0])) == "never"
    # No transparent huge pages in this kernel.
    assert cache_module._shmem_huge_policy(
        "/dev/shm", str(tmp_path / "absent"), write(tmp_path, "m", MOUNTS.format(extra=""))) == ""


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
