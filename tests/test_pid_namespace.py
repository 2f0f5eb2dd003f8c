"""Leases across PID namespaces: a worker in its own PID namespace (as in a container) is
seen alive while it runs and dead once it is gone, by a process outside it.

pids mean nothing across namespaces (the worker is pid 1 in its own), which is why a lease
is a robust mutex that the worker's lease thread holds: the kernel marks it owner-dead when
the worker dies, whatever namespace either side is in. The worker is a small script,
tests/workers/pidns_child.py, run with this interpreter under `unshare --pid --fork
--mount-proc` (`unshare -Upf --map-root-user` when not root); the tests skip, saying why, on
a machine that forbids new namespaces.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hostkv import HostKVCache, SequenceRequest as R, WorkerView

from conftest import small_config

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "workers", "pidns_child.py")
TIMEOUT = 20.0
PREFIX = list(range(100, 112))


def _unshare_command():
    """The unshare prefix this machine allows, or pytest.skip with the reason."""
    exe = shutil.which("unshare")
    if exe is None:
        pytest.skip("no unshare(1) on this machine")
    base = [exe, "--pid", "--fork", "--kill-child", "--mount-proc"]
    tries = [base] if os.geteuid() == 0 else []
    tries.append([exe, "--user", "--map-root-user", "--pid", "--fork", "--kill-child",
                  "--mount-proc"])
    reasons = []
    for command in tries:
        try:
            probe = subprocess.run(command + [sys.executable, "-c", "import os; print(os.getpid())"],
                                   capture_output=True, text=True, timeout=TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as exc:
            reasons.append(f"{' '.join(command[1:])}: {exc}")
            continue
        if probe.returncode == 0 and probe.stdout.strip() == "1":
            return command
        reasons.append(f"{' '.join(command[1:])}: exit {probe.returncode}: {probe.stderr.strip()}")
    pytest.skip("this machine forbids a new PID namespace: " + "; ".join(reasons))


@pytest.fixture(scope="module")
def unshare():
    return _unshare_command()


class NamespacedWorker:
    """tests/workers/pidns_child.py in a new PID namespace; killed in close() if still there."""

    def __init__(self, unshare, name: str, parent_slot: int) -> None:
        self.proc = subprocess.Popen(unshare + [sys.executable, CHILD, name, str(parent_slot)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(HERE))
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "READY":
            self.close()
            raise AssertionError(f"the namespaced worker failed: {self.proc.stderr.read()}")
        self.slot, self.inner_pid, self.saw_parent_alive = int(line[1]), int(line[2]), line[3] == "True"

    def python_pid(self) -> int:
        """The worker's pid in our namespace: the child of the unshare process."""
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            children = f.read().split()
        assert len(children) == 1, children
        return int(children[0])

    def wait(self) -> int:
        return self.proc.wait(TIMEOUT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()            # --kill-child takes the worker with it
            self.proc.wait(TIMEOUT)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            stream.close()


@pytest.fixture
def namespaced(unshare):
    started = []

    def start(name: str, parent_slot: int) -> NamespacedWorker:
        worker = NamespacedWorker(unshare, name, parent_slot)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()


@pytest.mark.parametrize("death", ["exit", "sigkill"])
def test_a_worker_in_another_pid_namespace_is_alive_then_reaped(segment_name, namespaced, death):
    with HostKVCache.create(segment_name, small_config(num_pages=48)) as cache:
        num_pages = cache.config.num_pages
        with WorkerView(cache) as view:
            view.allocate_pages_for_sequences_with_prefix([R(1, PREFIX + [1])])
            view.release([1])
        committed = cache.match_prefix(PREFIX).pages.tolist()
        assert len(committed) == 3
        baseline = cache.stats()

        worker = namespaced(segment_name, cache._segment.lease_slot_index)
        assert worker.inner_pid == 1, "the worker is not in a PID namespace of its own"
        assert worker.saw_parent_alive, "from inside the namespace, the parent looked dead"

        # While it runs: alive, not reaped - by a forced sweep, nor by the periodic one.
        assert cache._segment.lease_alive(worker.slot)
        assert cache.reap() == 0
        during = cache.stats()
        assert during.active_sequences == 2 and during.active_processes == 2
        assert during.borrowed_pages == 3            # sequence 1 borrowed the prefix
        cache.check()
        time.sleep(1.2)                              # past the sweep interval
        assert cache.stats().active_sequences == 2   # that lock ran the periodic sweep
        assert cache.stats().leases_reaped == baseline.leases_reaped
        assert cache._segment.lease_alive(worker.slot)

        if death == "exit":
            worker.proc.stdin.write("exit\n")
            worker.proc.stdin.flush()
            assert worker.wait() == 0
        else:
            pid = worker.python_pid()
            os.kill(pid, signal.SIGKILL)
            worker.wait()                   # unshare's own status says little (1 here)
            assert not os.path.exists(f"/proc/{pid}"), "the killed worker is still there"

        # Gone: its lease is dead and one reap reclaims what it held.
        assert not cache._segment.lease_alive(worker.slot)
        assert cache.reap() == 1
        after = cache.stats()
        assert after.active_sequences == 0 and after.active_processes == 1
        assert after.borrowed_pages == 0
        assert after.leases_reaped == baseline.leases_reaped + 1
        cache.check()
        # Borrowed pages stay cached; its own pages are free again.
        assert cache.match_prefix(PREFIX).pages.tolist() == committed
        assert after.free_pages + after.cached_pages == num_pages
        assert after.free_pages == baseline.free_pages
