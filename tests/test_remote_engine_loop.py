"""examples/engine_loop.py on two hosts (two segments, two worker processes each) sharing a
real redis-server: host B fetches the system prompt host A computed, and the generated tokens
are exactly those of the run without any reuse."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid

import pytest

from lib.redislib import redis_server  # noqa: F401  (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_engine_loop_on_two_hosts_through_the_remote_tier(redis_server):
    pytest.importorskip("torch")
    name = f"hostkv-test-engine-remote-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    # Seed 4: four chats, two per host; chat 3 on host 1 shares chat 0's system prompt,
    # which only host 0 computed.
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "engine_loop.py"), "--workers", "2",
         "--requests", "8", "--seed", "4", "--segment-name", name, "--remote", redis_server.url],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "generated tokens identical with and without reuse: yes" in result.stdout
    fetched = re.search(r"^remote tier: (\d+) pages fetched \((\d+) tokens\), (\d+) pages written",
                        result.stdout, re.M)
    assert fetched, result.stdout
    pages, tokens, written = map(int, fetched.groups())
    assert pages > 0 and written > 0
    # Host 1's second worker prefilled almost nothing: its prompt came from host 0.
    host1 = re.search(r"^with r h1\.1\s+(\d+)\s+(\d+)\s+(\d+)", result.stdout, re.M)
    assert host1 and int(host1.group(3)) > 0
    for suffix in ("-h0", "-h1", "-base"):
        assert not os.path.exists(f"/dev/shm/{name}{suffix}")


def test_engine_loop_refuses_a_bad_remote_url():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "engine_loop.py"), "--remote",
         "redis://:hunter2@h:99999"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "port must be in 1..65535" in result.stderr
    assert "hunter2" not in result.stderr
