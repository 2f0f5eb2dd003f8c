"""`python -m hostkv bench`: seeded engine workloads, several processes, the KV data path.

Sections of the report:

* engine: each workload replayed through a WorkerView as an engine would run it (allocate
  with prefix reuse, then release with commit), beside the same flow on the pure-Python
  reference model (tests/lib/reference_model.py, when run from a source checkout) and the C-level
  ceilings (token comparison with memcmp, copying pages of the pool);
* eviction: the cost of `cache.evict` per evicted token on a filled tree;
* decode: `append_tokens` per sequence per step at batch 1 to 128, beside a Python
  list.append per sequence (the least an engine's own bookkeeping costs);
* processes: the shared-prompt and multi-turn workloads split across 1, 2 and 4 spawned
  processes sharing one segment (aggregate throughput, lock or call latency percentiles);
* data path: gathering and scattering KV pages through `cache.pages_tensor()` against a
  plain torch tensor and numpy;
* pool faults: copying into a freshly attached pool, cold, after `start_prefault()` and
  after the copy engine's `populate_pages`, against a copy between two pre-faulted numpy
  buffers;
* copy engine: one engine step's pages saved and loaded through `CopyEngine` (vLLM's
  layout, an 8B model's KV cut to 8 layers), into a cold pool (with and without the
  engine's populate) and a pre-faulted one, and warm in the other block layouts, against
  plain copies of as many bytes;
* gpu copy: on a CUDA device only, a step's save and load through `CopyEngine` with the pool
  registered for DMA, against a pinned `cudaMemcpyAsync` of as many bytes, and a large
  matmul timed alone and with saves beside it;
* tree: the workloads as match-then-insert straight on the compiled tree (no WorkerView);
* window parts: the engine flow on a segment with a window part for every eighth page (the
  part LRU at work) against one without, taking turns: what parts cost per request.

`--section NAME` (repeatable) runs only the sections named: see SECTIONS.

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
from typing import Any, Dict, List, Optional, Sequence

# The package's modules, one section (or group of sections) each; the names the single
# module had are re-exported so that `from hostkv.bench import X` keeps working.
from hostkv.bench.common import histogram_percentile, latency_summary, lock_metrics, lock_summary
from hostkv.bench.datapath import (DATA_LAYOUT, GATHER_PAGES, STEP_LAYOUT, STEP_LAYOUTS,
                                   STEP_OPS, copy_engine_step, data_path, pool_faults)
from hostkv.bench.decode import DECODE_BATCHES, decode_steps
from hostkv.bench.engine import (ENGINE_ROUNDS, engine_row, run_engine_compiled,
                                 run_engine_hash_chain, run_engine_reference)
from hostkv.bench.engines import HashChainEngine, ReferenceEngine, ViewEngine, replay
from hostkv.bench.eviction import EVICT_CHUNK_PAGES, eviction_by_demand, eviction_cost
from hostkv.bench.gpu import GPU_OPS, gpu_copy_step
from hostkv.bench.machine import _load_reference_model, compare_ceiling, machine_info
from hostkv.bench.parts import PARTS_ROUNDS, window_parts
from hostkv.bench.processes import (PROCESS_COUNTS, cpu_rate, process_scaling, process_specs,
                                    run_processes)
from hostkv.bench.report import format_table
from hostkv.bench.tree import run_tree_compiled, run_tree_reference, tree_row
from hostkv.bench.workloads import (GENERATORS, PAGE_SIZE, VOCAB, Requests, Workload,
                                    WorkloadSpec, multi_turn, no_sharing, shared_prompts,
                                    short_prompts, workload_specs)

__all__ = [
    "DATA_LAYOUT", "DECODE_BATCHES", "ENGINE_ROUNDS", "EVICT_CHUNK_PAGES", "GATHER_PAGES",
    "GENERATORS", "GPU_OPS", "PAGE_SIZE", "PROCESS_COUNTS", "SECTIONS", "STEP_LAYOUT",
    "STEP_LAYOUTS", "STEP_OPS", "VOCAB",
    "HashChainEngine", "ReferenceEngine", "Requests", "ViewEngine", "Workload", "WorkloadSpec",
    "compare_ceiling", "copy_engine_step", "cpu_rate", "data_path", "decode_steps", "engine_row",
    "eviction_by_demand", "eviction_cost", "format_table", "gpu_copy_step", "histogram_percentile",
    "latency_summary", "lock_metrics", "lock_summary", "machine_info", "main", "multi_turn",
    "no_sharing", "pool_faults", "process_scaling", "process_specs", "replay", "run",
    "run_engine_compiled", "run_engine_hash_chain", "run_engine_reference", "run_processes",
    "run_tree_compiled", "run_tree_reference", "shared_prompts", "short_prompts", "tree_row",
    "window_parts", "workload_specs",
]


# The sections `--section` names, in the order they run and print.
SECTIONS = ("engine", "eviction", "decode", "processes", "data-path", "pool-faults",
            "copy-engine", "gpu-copy", "tree", "window-parts")


def run(quick: bool = False, seed: int = 0, sections: Optional[Sequence[str]] = None
        ) -> Dict[str, Any]:
    """Runs the sections (every one by default); returns the results as a JSON-ready dict,
    which holds only the sections that ran.

    The engine and tree sections compare with the C-level ceilings: the token compare runs
    with either, the page copy is the data path's, where that section runs too.

    Raises:
        ValueError: a name not in SECTIONS.
    """
    chosen = set(SECTIONS if sections is None else sections)
    unknown = sorted(chosen - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown bench sections {unknown}; known: {', '.join(SECTIONS)}")
    model_module = _load_reference_model()
    # Each workload is seeded by its own name: building only those needed builds the same ones.
    workloads = ({spec.name: spec.build() for spec in workload_specs(quick, seed)}
                 if chosen & {"engine", "eviction", "tree", "window-parts"} else {})
    kv = data_path(quick, seed) if "data-path" in chosen else None
    ceilings: Dict[str, float] = {}
    if chosen & {"engine", "tree"}:
        ceilings["compare_tokens_per_s"] = compare_ceiling(0.1 if quick else 0.5)
        if kv is not None:
            ceilings["copy_bytes_per_s"] = kv["gbytes_per_s"]["copy_ceiling"] * 1e9
            ceilings["copy_tokens_per_s"] = ceilings["copy_bytes_per_s"] / DATA_LAYOUT.token_bytes
    rounds = 1 if quick else ENGINE_ROUNDS
    engine = ([engine_row(w, model_module, ceilings, rounds) for w in workloads.values()]
              if "engine" in chosen else None)
    # The machine is read here, after the engine section, as it always was.
    report: Dict[str, Any] = {
        "machine": machine_info(),
        "seed": seed,
        "quick": quick,
        "page_size": PAGE_SIZE,
        "reference_model": model_module is not None,
    }
    if ceilings:
        report["ceilings"] = ceilings
    if engine is not None:
        report.update(engine=engine, engine_rounds=rounds)
    if "eviction" in chosen:
        report["eviction"] = eviction_cost(workloads["eviction"], model_module)
        report["eviction_by_demand"] = eviction_by_demand(workloads["shared-prompt"])
    if "decode" in chosen:
        report["decode"] = decode_steps(quick, seed)
    if "processes" in chosen:
        report["processes"] = process_scaling(process_specs(quick, seed), quick)
    if kv is not None:
        report["data_path"] = kv
    if "pool-faults" in chosen:
        report["pool_faults"] = pool_faults(quick)
    if "copy-engine" in chosen:
        report["copy_engine"] = copy_engine_step(quick, seed)
    if "gpu-copy" in chosen:
        report["gpu_copy"] = gpu_copy_step(quick, seed)
    if "tree" in chosen:
        report["tree"] = [tree_row(workloads[n], model_module, ceilings)
                          for n in ("shared-prompt", "multi-turn")]
    if "window-parts" in chosen:
        report["window_parts"] = window_parts(workloads, 1 if quick else PARTS_ROUNDS)
    return report


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of `python -m hostkv bench`."""
    parser = argparse.ArgumentParser(prog="python -m hostkv bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small workloads (CI smoke test)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--section", action="append", choices=SECTIONS, metavar="NAME",
                        help="run only this section (repeat for more); default: all of "
                             + ", ".join(SECTIONS))
    args = parser.parse_args(argv)
    report = run(quick=args.quick, seed=args.seed, sections=args.section)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
