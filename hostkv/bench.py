"""`python -m hostkv bench`: seeded workloads through the compiled tree, with ratios.

Every figure is reported beside a baseline measured in the same process (the pure-Python
reference model of tests/reference_model.py when run from a source checkout, and the C-level
token-comparison ceiling), because the machines this runs on are shared and noisy: ratios
hold where absolute numbers drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import sys
import time
import uuid
from typing import Callable, Dict, Iterator, List, Optional

import numpy as np

from hostkv import _pages, _radix
from hostkv.cache import HostKVCache
from hostkv.config import HostKVConfig

PAGE_SIZE = 16
VOCAB = 32_000


@dataclasses.dataclass
class Workload:
    """A named list of requests (token arrays), replayed as match-then-insert."""

    name: str
    requests: List[np.ndarray]

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.requests)

    @property
    def max_pages(self) -> int:
        return sum(len(r) // PAGE_SIZE for r in self.requests)


def shared_prompts(rng: np.random.Generator, num_requests: int) -> Workload:
    """8 system prompts of 2,048 tokens; each request adds a unique 256-token suffix."""
    prompts = [rng.integers(0, VOCAB, 2048, dtype=np.int32) for _ in range(8)]
    requests = [
        np.concatenate([prompts[i % 8], rng.integers(0, VOCAB, 256, dtype=np.int32)])
        for i in range(num_requests)
    ]
    return Workload("shared-prompt", requests)


def multi_turn(rng: np.random.Generator, num_chats: int, turns: int = 10) -> Workload:
    """Chats whose every turn resends the whole context plus ~200 new tokens; interleaved."""
    contexts = [np.empty(0, dtype=np.int32) for _ in range(num_chats)]
    requests = []
    for _ in range(turns):
        for c in range(num_chats):
            grow = int(rng.integers(150, 251))
            contexts[c] = np.concatenate([contexts[c], rng.integers(0, VOCAB, grow, dtype=np.int32)])
            requests.append(contexts[c])
    return Workload("multi-turn", requests)


def _load_reference_model():
    """The pure-Python reference model from a source checkout's tests/, or None."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tests", "reference_model.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("hostkv_reference_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_compiled(workload: Workload, num_pages: int) -> Dict[str, float]:
    """Replays the workload against a fresh segment: match, allocate, insert, release."""
    name = f"hostkv-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    config = HostKVConfig(num_pages=num_pages, page_size=PAGE_SIZE, page_bytes=64,
                          radix_node_capacity=max(4096, 2 * len(workload.requests)))
    cache = HostKVCache.create(name, config)
    seg = cache._segment
    hit_tokens = 0
    evicted = 0
    try:
        start = time.perf_counter()
        for tokens in workload.requests:
            matched = _radix.match(seg, tokens, 0)
            full = len(tokens) // PAGE_SIZE
            missing = full - len(matched)
            hit_tokens += len(matched) * PAGE_SIZE
            if missing:
                short = missing - seg.free_pages
                if short > 0:
                    evicted += _radix.evict(seg, short)
                page_table = np.empty(full, dtype=np.int32)
                page_table[:len(matched)] = matched
                page_table[len(matched):] = own = _pages.alloc_pages(seg, missing)
                _radix.insert(seg, tokens, page_table, 0)
                _pages.free_pages(seg, own)
        elapsed = time.perf_counter() - start
        cache.check()
    finally:
        cache.close()
        HostKVCache.unlink_segment(name)
    return _figures(workload, elapsed, hit_tokens, evicted)


def run_reference(model_module, workload: Workload, num_pages: int) -> Dict[str, float]:
    """The same replay against the pure-Python reference model (the baseline)."""
    model = model_module.RadixModel(PAGE_SIZE, max(4096, 2 * len(workload.requests)))
    free = list(range(num_pages - 1, -1, -1))
    hit_tokens = 0
    evicted = 0
    start = time.perf_counter()
    for tokens in workload.requests:
        token_list = tokens.tolist()
        matched = model.match(token_list, 0)
        full = len(token_list) // PAGE_SIZE
        missing = full - len(matched)
        hit_tokens += len(matched) * PAGE_SIZE
        if missing:
            if missing > len(free):
                released = model.evict_pages(missing - len(free))
                evicted += len(released)
                free.extend(released)
            own = [free.pop() for _ in range(missing)]
            model.insert(token_list, list(matched) + own, 0)
    elapsed = time.perf_counter() - start
    return _figures(workload, elapsed, hit_tokens, evicted)


def _figures(workload: Workload, elapsed: float, hit_tokens: int, evicted: int) -> Dict[str, float]:
    return {
        "tokens_per_s": workload.tokens / elapsed,
        "us_per_request": elapsed / len(workload.requests) * 1e6,
        "hit_rate": hit_tokens / workload.tokens,
        "evicted_pages": evicted,
        "seconds": elapsed,
    }


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


def run(quick: bool = False, seed: int = 0) -> Dict[str, object]:
    """Runs every workload; returns the results as a JSON-ready dict."""
    rng = np.random.default_rng(seed)
    workloads = [
        shared_prompts(rng, 300 if quick else 2000),
        multi_turn(rng, 10 if quick else 60),
    ]
    model_module = _load_reference_model()
    ceiling = compare_ceiling(0.1 if quick else 0.5)
    results = []
    for workload in workloads:
        num_pages = workload.max_pages + 64
        compiled = run_compiled(workload, num_pages)
        row = {"workload": workload.name, "requests": len(workload.requests),
               "tokens": workload.tokens, "compiled": compiled,
               "ceiling_fraction": compiled["tokens_per_s"] / ceiling}
        if model_module is not None:
            reference = run_reference(model_module, workload, num_pages)
            row["reference"] = reference
            row["speedup_vs_reference"] = compiled["tokens_per_s"] / reference["tokens_per_s"]
        results.append(row)
    return {
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
        "page_size": PAGE_SIZE,
        "compare_ceiling_tokens_per_s": ceiling,
        "workloads": results,
    }


def format_table(report: Dict[str, object]) -> str:
    """The report as a plain-text table."""
    lines = [
        f"page size {report['page_size']}; token-compare ceiling "
        f"{report['compare_ceiling_tokens_per_s'] / 1e9:.2f} G tokens/s (memcmp, one core)",
        "",
        f"{'workload':<14} {'requests':>8} {'M tok/s':>9} {'us/req':>8} {'hit rate':>8} "
        f"{'evicted':>8} {'x ref':>7} {'% ceil':>7}",
    ]
    for row in report["workloads"]:
        c = row["compiled"]
        speedup = row.get("speedup_vs_reference")
        lines.append(
            f"{row['workload']:<14} {row['requests']:>8} {c['tokens_per_s'] / 1e6:>9.1f} "
            f"{c['us_per_request']:>8.1f} {c['hit_rate']:>8.1%} {c['evicted_pages']:>8} "
            f"{(f'{speedup:.1f}x' if speedup else 'n/a'):>7} {row['ceiling_fraction']:>7.1%}")
        if "reference" in row:
            r = row["reference"]
            lines.append(
                f"{'  reference':<14} {'':>8} {r['tokens_per_s'] / 1e6:>9.1f} "
                f"{r['us_per_request']:>8.1f} {r['hit_rate']:>8.1%} {r['evicted_pages']:>8}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of `python -m hostkv bench`."""
    parser = argparse.ArgumentParser(prog="python -m hostkv bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small workloads (CI smoke test)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    report = run(quick=args.quick, seed=args.seed)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
