"""`python -m hostkv bench`: seeded engine workloads, several processes, the KV data path.

Sections of the report:

* engine: each workload replayed through a WorkerView as an engine would run it (allocate
  with prefix reuse, then release with commit), beside the same flow on the pure-Python
  reference model (tests/reference_model.py, when run from a source checkout) and the C-level
  ceilings (token comparison with memcmp, copying pages of the pool);
* eviction: the cost of `cache.evict` per evicted token on a filled tree;
* decode: `append_tokens` per sequence per step at batch 1 to 128, beside a Python
  list.append per sequence (the least an engine's own bookkeeping costs);
* processes: the shared-prompt and multi-turn workloads split across 1, 2 and 4 spawned
  processes sharing one segment (aggregate throughput, lock or call latency percentiles);
* data path: gathering and scattering KV pages through `cache.pages_tensor()` against a
  plain torch tensor and numpy;
* pool faults: copying into a freshly attached pool, cold and after `start_prefault()`,
  against a copy between two pre-faulted numpy buffers;
* tree: the workloads as match-then-insert straight on the compiled tree (no WorkerView).

Every figure is reported beside a baseline measured in the same process, because the machines
this runs on are shared and noisy: ratios hold where absolute numbers drift.

The package: workloads (the seeded request lists) and engines (the flows that replay them),
one module per section or group of sections (engine, eviction, decode, processes, datapath,
tree), common (fresh segments, lock and latency summaries), machine (the run's machine, the
compare ceiling, the reference model), report (the tables); this module runs them.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Optional

# The package's modules, one section (or group of sections) each; the names the single
# module had are re-exported so that `from hostkv.bench import X` keeps working.
from hostkv.bench.common import histogram_percentile, latency_summary, lock_metrics, lock_summary
from hostkv.bench.datapath import DATA_LAYOUT, GATHER_PAGES, data_path, pool_faults
from hostkv.bench.decode import DECODE_BATCHES, decode_steps
from hostkv.bench.engine import (ENGINE_ROUNDS, engine_row, run_engine_compiled,
                                 run_engine_hash_chain, run_engine_reference)
from hostkv.bench.engines import HashChainEngine, ReferenceEngine, ViewEngine, replay
from hostkv.bench.eviction import EVICT_CHUNK_PAGES, eviction_by_demand, eviction_cost
from hostkv.bench.machine import _load_reference_model, compare_ceiling, machine_info
from hostkv.bench.processes import (PROCESS_COUNTS, cpu_rate, process_scaling, process_specs,
                                    run_processes)
from hostkv.bench.report import format_table
from hostkv.bench.tree import run_tree_compiled, run_tree_reference, tree_row
from hostkv.bench.workloads import (GENERATORS, PAGE_SIZE, VOCAB, Requests, Workload,
                                    WorkloadSpec, multi_turn, no_sharing, shared_prompts,
                                    short_prompts, workload_specs)

__all__ = [
    "DATA_LAYOUT", "DECODE_BATCHES", "ENGINE_ROUNDS", "EVICT_CHUNK_PAGES", "GATHER_PAGES",
    "GENERATORS", "PAGE_SIZE", "PROCESS_COUNTS", "VOCAB",
    "HashChainEngine", "ReferenceEngine", "Requests", "ViewEngine", "Workload", "WorkloadSpec",
    "compare_ceiling", "cpu_rate", "data_path", "decode_steps", "engine_row",
    "eviction_by_demand", "eviction_cost", "format_table", "histogram_percentile",
    "latency_summary", "lock_metrics", "lock_summary", "machine_info", "main", "multi_turn",
    "no_sharing", "pool_faults", "process_scaling", "process_specs", "replay", "run",
    "run_engine_compiled", "run_engine_hash_chain", "run_engine_reference", "run_processes",
    "run_tree_compiled", "run_tree_reference", "shared_prompts", "short_prompts", "tree_row",
    "workload_specs",
]


def run(quick: bool = False, seed: int = 0) -> Dict[str, Any]:
    """Runs every section; returns the results as a JSON-ready dict."""
    model_module = _load_reference_model()
    specs = workload_specs(quick, seed)
    workloads = {spec.name: spec.build() for spec in specs}
    kv = data_path(quick, seed)
    ceilings = {
        "compare_tokens_per_s": compare_ceiling(0.1 if quick else 0.5),
        "copy_bytes_per_s": kv["gbytes_per_s"]["copy_ceiling"] * 1e9,
    }
    ceilings["copy_tokens_per_s"] = ceilings["copy_bytes_per_s"] / DATA_LAYOUT.token_bytes
    rounds = 1 if quick else ENGINE_ROUNDS
    engine = [engine_row(w, model_module, ceilings, rounds) for w in workloads.values()]
    return {
        "machine": machine_info(),
        "seed": seed,
        "quick": quick,
        "page_size": PAGE_SIZE,
        "reference_model": model_module is not None,
        "ceilings": ceilings,
        "engine": engine,
        "engine_rounds": rounds,
        "eviction": eviction_cost(workloads["eviction"], model_module),
        "eviction_by_demand": eviction_by_demand(workloads["shared-prompt"]),
        "decode": decode_steps(quick, seed),
        "processes": process_scaling(process_specs(quick, seed), quick),
        "data_path": kv,
        "pool_faults": pool_faults(quick),
        "tree": [tree_row(workloads[n], model_module, ceilings)
                 for n in ("shared-prompt", "multi-turn")],
    }


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
