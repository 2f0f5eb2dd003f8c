"""What the report says about its run: the machine, the C-level compare ceiling, and the
pure-Python reference model the sections compare with."""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
import time
from typing import Any, Dict

import numpy as np

from hostkv import _radix
from hostkv.bench.workloads import PAGE_SIZE


def _load_reference_model() -> Any:
    """The pure-Python reference model from a source checkout's tests/, or None."""
    # This file is hostkv/bench/machine.py: the checkout's root is three levels up.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "tests", "lib", "reference_model.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("hostkv_reference_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def compare_ceiling(seconds: float = 0.3) -> float:
    """Tokens per second that a C loop compares page by page with memcmp (one core)."""
    a = np.arange(1 << 16, dtype=np.int32)
    b = a.copy()
    repeats = 1
    while True:
        start = time.perf_counter()
        _radix._compare_ceiling(a, b, PAGE_SIZE, repeats)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return len(a) * repeats / elapsed
        repeats *= 2


def machine_info() -> Dict[str, Any]:
    """Cores, CPU model, python, numpy and torch versions."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "cpus": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0],
            "platform": platform.platform(), "python": platform.python_version(),
            "numpy": np.__version__, "torch": torch_version}
