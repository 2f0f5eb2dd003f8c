"""Run by tests/test_pid_namespace.py inside a new PID namespace (`unshare --pid --fork`):

    python tests/workers/pidns_child.py SEGMENT_NAME PARENT_LEASE_SLOT

Attaches, allocates two sequences (one borrowing the prefix the parent committed), decodes a
step, and reports on stdout "READY <lease slot> <pid as seen here> <parent alive?>". Then it
waits for a line on stdin: "exit" makes it os._exit(0) without closing anything (a process
that dies holding sequences); the parent may instead kill it with SIGKILL meanwhile.
"""

from __future__ import annotations

import os
import sys

from hostkv import HostKVCache, SequenceRequest, WorkerView

PREFIX = list(range(100, 112))          # the parent's committed prefix: three pages of 4


def main() -> None:
    name, parent_slot = sys.argv[1], int(sys.argv[2])
    cache = HostKVCache.attach(name)
    view = WorkerView(cache)
    view.allocate_pages_for_sequences_with_prefix(
        [SequenceRequest(1, PREFIX + [7, 8, 9]), SequenceRequest(2, list(range(500, 510)))])
    view.append_tokens([1, 2], [10, 11])
    # Seen from inside the namespace, the parent (outside it) is alive too.
    parent_alive = cache._segment.lease_alive(parent_slot)
    print(f"READY {cache._segment.lease_slot_index} {os.getpid()} {parent_alive}", flush=True)
    line = sys.stdin.readline().strip()
    if line == "exit":
        os._exit(0)                     # no close, no release: the lease dies with us
    # EOF: the parent went away; leave quietly the same way.
    os._exit(3)


if __name__ == "__main__":
    main()
