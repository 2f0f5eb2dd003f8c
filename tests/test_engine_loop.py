"""The README's first command, small: examples/engine_loop.py on two processes must reuse
prefixes and generate exactly the tokens it generates without reuse."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_engine_loop_reuses_and_matches_the_no_reuse_run():
    pytest.importorskip("torch")
    name = f"hostkv-test-engine-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "engine_loop.py"), "--workers", "2",
         "--requests", "8", "--seed", "3", "--segment-name", name],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "generated tokens identical with and without reuse: yes" in result.stdout
    reuse_row = re.search(r"^with reuse\s+(\d+)\s+(\d+)\s+(\d+)", result.stdout, re.M)
    assert reuse_row, result.stdout
    requests, prompt_tokens, reused = map(int, reuse_row.groups())
    assert requests == 8 and 0 < reused < prompt_tokens
    # Captured, stderr is no terminal: one plain line per phase, no "\r" bar frames.
    assert "\r" not in result.stderr, result.stderr
    assert re.search(r"^reuse +8/8$", result.stderr, re.M), result.stderr
    assert re.search(r"^no reuse +8/8$", result.stderr, re.M), result.stderr
    # Both runs unlinked their segments.
    assert not os.path.exists(f"/dev/shm/{name}") and not os.path.exists(f"/dev/shm/{name}-base")
