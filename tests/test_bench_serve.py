"""hostkv.bench.serve's cleanup of what a killed vLLM leaves in /dev/shm: only the names the
killed process group had mapped, and only vLLM's kinds, never a hostkv segment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

from hostkv.bench.serve import unlink_shared_memory, vllm_shared_memory

# A process group of its own that maps a SharedMemory as vLLM's message queues do (psm_*),
# and a file named like a hostkv segment, then says so and sleeps.
CHILD = """
import mmap, os, sys, time
from multiprocessing import resource_tracker, shared_memory
queue = shared_memory.SharedMemory(create=True, size=4096)
resource_tracker.unregister(queue._name, "shared_memory")   # as if its tracker died too
fd = os.open("/dev/shm/" + sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
segment = mmap.mmap(fd, 4096)
print(queue.name, flush=True)
time.sleep(60)
"""


def test_a_killed_groups_vllm_shared_memory_is_found_and_unlinked_and_nothing_else():
    segment = f"hostkv-test-bench-serve-{uuid.uuid4().hex[:12]}"
    queue = ""
    child = subprocess.Popen([sys.executable, "-c", CHILD, segment], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        queue = child.stdout.readline().strip()
        assert queue.startswith("psm_")
        found = vllm_shared_memory(child.pid)
        assert found == {queue}                     # the segment is not vLLM's
        assert queue not in vllm_shared_memory(os.getpgid(0))   # not another group's
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(30)
        assert os.path.exists(f"/dev/shm/{queue}")  # nobody unlinked it
        unlink_shared_memory(found)
        assert not os.path.exists(f"/dev/shm/{queue}")
        assert os.path.exists(f"/dev/shm/{segment}")
        unlink_shared_memory(found)                 # already gone: nothing happens
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(30)
        child.stdout.close()
        unlink_shared_memory({segment, queue} - {""})
