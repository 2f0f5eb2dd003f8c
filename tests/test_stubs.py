"""The .pyi stubs of the compiled modules match what the modules export (mypy's stubtest):
unchecked stubs drift."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILED = ["hostkv._tokens", "hostkv._crash", "hostkv._leases", "hostkv._geometry",
            "hostkv._format", "hostkv._lock", "hostkv._segment", "hostkv._pages", "hostkv._slab",
            "hostkv._radix", "hostkv._introspect", "hostkv._requests", "hostkv._records",
            "hostkv._viewstate", "hostkv._sequences", "hostkv._blockcopy",
            "hostkv._cudacopy"]


def test_stubs_match_the_compiled_modules():
    pytest.importorskip("mypy")
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "--mypy-config-file", "pyproject.toml",
         "--allowlist", "tests/stubtest_allowlist.txt", *COMPILED],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
