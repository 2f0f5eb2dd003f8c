"""The window-parts section: what window parts cost an engine's allocation path.

The engine flow (allocate with prefix reuse, then release with commit) replayed on a segment
without window parts and on one with a part for every eighth page, so that most allocations
first take parts from the part LRU, taking turns; each keeps its fastest run. The ratio is
the parts' cost per request (the parts' bytes are not touched: only their bookkeeping)."""

from __future__ import annotations

from typing import Any, Dict, List

from hostkv.bench.engine import run_engine_compiled
from hostkv.bench.workloads import Workload

PART_FRACTION = 8           # one part for this many pages
PART_BYTES = 64             # stand-in parts, like the engine section's 64-byte pages
PARTS_WORKLOADS = ("shared-prompt", "multi-turn")
PARTS_ROUNDS = 11           # turns each side takes: a replay is tens of milliseconds, so the
                            # fastest of many is what a quiet moment of the machine gives


def window_parts(workloads: Dict[str, Workload], rounds: int) -> List[Dict[str, Any]]:
    """One row per workload: microseconds per request without and with parts, their ratio,
    and what the parts did (evicted by the part LRU, donated, pages that went without)."""
    rows = []
    for name in PARTS_WORKLOADS:
        workload = workloads[name]
        num_pages = workload.pool_pages()
        num_parts = max(1, num_pages // PART_FRACTION)
        plain: List[Dict[str, Any]] = []
        parted: List[Dict[str, Any]] = []
        for _ in range(rounds):
            plain.append(run_engine_compiled(workload, num_pages))
            parted.append(run_engine_compiled(workload, num_pages, num_parts=num_parts,
                                              part_bytes=PART_BYTES))
        best_plain = min(plain, key=lambda figures: figures["seconds"])
        best_parts = min(parted, key=lambda figures: figures["seconds"])
        rows.append({
            "workload": name,
            "num_pages": num_pages,
            "num_parts": num_parts,
            "us_per_request_without": best_plain["us_per_request"],
            "us_per_request_with": best_parts["us_per_request"],
            "ratio": best_parts["seconds"] / best_plain["seconds"],
            "hit_rate_without": best_plain["hit_rate"],
            "hit_rate_with": best_parts["hit_rate"],
            "parts": best_parts["parts"],
        })
    return rows
