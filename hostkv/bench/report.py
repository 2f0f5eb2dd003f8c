"""The report as plain-text tables."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from hostkv.bench.datapath import DATA_LAYOUT


def _ratio(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1f}x"


def _run_line(label: str, figures: Dict[str, Any], requests: Any, extra: str = "") -> str:
    return (f"{label:<15} {requests:>8} {figures['tokens_per_s'] / 1e6:>9.2f} "
            f"{figures['us_per_request']:>8.1f} {figures['hit_rate']:>8.1%} "
            f"{figures['evicted_pages']:>8}{extra}")


def _percent(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _format_runs(title: str, rows: List[Dict[str, Any]], engine: bool) -> List[str]:
    """A section of compiled rows, each followed by its reference row; the engine section
    adds the KV-copy ratio and the share of the time the segment's lock was held."""
    header = (f"{'workload':<15} {'requests':>8} {'M tok/s':>9} {'us/req':>8} {'hit rate':>8} "
              f"{'evicted':>8} {'x ref':>7} {'% cmp':>6}"
              + (f" {'x copy':>7} {'locked':>7} {'x chain':>7}" if engine else ""))
    lines = [title, header]
    for row in rows:
        extra = (f" {_ratio(row.get('speedup_vs_reference')):>7} "
                 f"{row['compare_ceiling_fraction']:>6.1%}")
        if engine:
            extra += (f" {_ratio(row.get('vs_kv_copy')):>7} "
                      f"{_percent(row['compiled'].get('lock_held_fraction')):>7} "
                      f"{_ratio(row.get('speedup_vs_hash_chain')):>7}")
        lines.append(_run_line(row["workload"], row["compiled"], row["requests"], extra))
        if "compiled_list" in row:
            chain = (f" {'':>6} {'':>7} {'':>7} {_ratio(row['list_speedup_vs_hash_chain']):>7}"
                     if "list_speedup_vs_hash_chain" in row else "")
            lines.append(_run_line("  list input", row["compiled_list"], "",
                                   f" {_ratio(row.get('list_speedup_vs_reference')):>7}" + chain))
        if "reference" in row:
            lines.append(_run_line("  reference", row["reference"], ""))
        if "hash_chain" in row:
            lines.append(_run_line("  hash chain", row["hash_chain"], ""))
    return lines


def _format_processes(rows: List[Dict[str, Any]]) -> List[str]:
    """The process-scaling section: aggregate throughput, call and lock latencies (µs)."""
    has_lock = any("lock" in row for row in rows)
    latencies = ["call p50", "call p99"] + (
        ["wait p50", "wait p99", "hold p50", "hold p99"] if has_lock else [])
    lines = [
        "processes: the requests split across N spawned processes sharing one segment, each "
        "with its own WorkerView (best of the repeats; latencies in us)",
        f"{'workload':<15} {'requests':>8} {'procs':>5} {'M tok/s':>8} {'x 1 proc':>8} "
        f"{'cpu x':>6} {'hit rate':>8}" + "".join(f" {name:>8}" for name in latencies)
        + (f" {'hold avg':>8} {'locked':>7}" if has_lock else ""),
    ]
    for row in rows:
        values = [row["call_latency"]["p50_us"], row["call_latency"]["p99_us"]]
        if has_lock:
            values += [row["lock"][f"{kind}_{q}_ns"] / 1e3
                       for kind in ("wait", "hold") for q in ("p50", "p99")]
        lines.append(
            f"{row['workload']:<15} {row['requests']:>8} {row['processes']:>5} "
            f"{row['tokens_per_s'] / 1e6:>8.2f} {row['vs_one_process']:>7.2f}x "
            f"{row['cpu_vs_one_process']:>5.2f}x {row['hit_rate']:>8.1%}"
            + "".join(f" {value:>8.1f}" for value in values)
            + (f" {row['lock']['hold_mean_ns'] / 1e3:>8.2f}"
               f" {_percent(row.get('lock_held_fraction')):>7}" if has_lock else ""))
    lines.append("cpu x: as many processes spinning in a Python loop over one, just before: the "
                 "parallelism the machine gave")
    lines.append("call: one WorkerView call timed by its caller (lock wait + hold + Python)")
    if has_lock:
        lines.append("wait/hold: the segment's lock histograms (upper bounds of log2 buckets); "
                     "hold avg: mean hold per acquisition (exact: does a hold get longer when "
                     "processes share the lock?); locked: share of the wall time the lock was "
                     "held")
    return lines


def _format_decode(rows: List[Dict[str, Any]]) -> List[str]:
    lines = ["decode: append_tokens(seq_ids, tokens) through a WorkerView, one step of the "
             "batch per call (best of 3)",
             "batch   steps  ns/seq/step  list.append ns  x list.append"]
    for row in rows:
        lines.append(f"{row['batch']:5d} {row['steps']:7d} {row['ns_per_sequence_step']:12.0f} "
                     f"{row['list_append_ns']:15.1f} {row['vs_list_append']:14.1f}")
    lines.append("x list.append: the step's time over a Python loop that appends each token to "
                 "a list per sequence (the least an engine's own bookkeeping costs)")
    return lines


def _format_data_path(kv: Dict[str, Any]) -> List[str]:
    """The KV data path section: GB/s of each op and the pages_tensor / plain ratios."""
    layout = kv["layout"]
    rates = kv["gbytes_per_s"]
    lines = [
        f"KV data path: {kv['pages_per_op']} random pages of {kv['page_bytes'] // 1024} KiB "
        f"(KVLayout({layout['num_layers']}, {layout['num_kv_heads']}, {layout['head_dim']}, "
        f"{layout['dtype']}), pool {kv['pool_bytes'] / 2**30:.2f} GiB), GB/s, one thread",
        f"{'op':<8} {'pages_tensor':>12} {'plain':>8} {'ratio':>6} {'numpy':>8}",
    ]
    for kind in ("gather", "scatter"):
        if "pages_tensor_vs_plain" in kv:
            torch_part = (f"{rates[f'tensor_{kind}']:>12.1f} {rates[f'plain_{kind}']:>8.1f} "
                          f"{kv['pages_tensor_vs_plain'][kind]:>6.2f}")
        else:
            torch_part = f"{'n/a':>12} {'n/a':>8} {'n/a':>6}"
        lines.append(f"{kind:<8} {torch_part} {rates[f'numpy_{kind}']:>8.1f}")
    lines.append(f"{'copy':<8} {'':>12} {'':>8} {'':>6} {rates['copy_ceiling']:>8.1f}")
    lines.append("gather: index_select(out=) into a preallocated tensor (numpy: take(out=)); "
                 "scatter: index_copy_ (numpy: pool[idx] = ...); copy: as many contiguous "
                 "pages (the ceiling)")
    if "torch" in kv:
        lines.append(f"torch: {kv['torch']}")
    return lines


def _format_pool_faults(pf: Dict[str, Any]) -> List[str]:
    """The pool-faults section: GB/s of a copy into a fresh mapping, cold and pre-faulted."""
    rates = pf["gbytes_per_s"]
    return [
        f"pool faults: np.copyto of {pf['pool_bytes'] >> 20} MiB into a freshly attached pool, "
        f"GB/s, median of {pf['rounds']} interleaved rounds",
        f"cold {rates['cold']:.1f}; after start_prefault() {rates['prefaulted']:.1f}; plain "
        f"(between pre-faulted numpy buffers) {rates['plain']:.1f}; the prefault itself "
        f"{rates['prefault']:.1f} ({pf['method']}, {pf['prefault_state']})"
        + (f"; cold after the copy engine's populate_pages (a read per 64 KiB, timed with "
           f"the copy) {pf['populated_gbytes_per_s']:.1f}" if "populated_gbytes_per_s" in pf
           else ""),
        f"huge pages: {pf['huge_pages']} (tmpfs policy {pf['huge_policy'] or 'unknown'})"
        + _huge_mapped(pf),
    ]


def _huge_mapped(section: Dict[str, Any]) -> str:
    """How much of a pre-faulted mapping the kernel gave huge pages, where the report says."""
    mapped = section.get("huge_mapped_bytes")
    return "" if mapped is None else f"; {mapped >> 20} MiB of it mapped in 2 MiB pages"


def _format_copy_engine(ce: Dict[str, Any]) -> List[str]:
    """The copy-engine section: best and median GB/s of a step's save and load, cold and
    warm, and of the plain copies; each median over the faster plain copy's."""
    if "skipped" in ce:
        return [f"copy engine: skipped: {ce['skipped']}"]
    layout = ce["layout"]
    rates = ce["gbytes_per_s"]
    full_page = ce["page_bytes"] * ce["full_layers"] // layout["num_layers"]
    lines = [
        f"copy engine: one engine step's {ce['step_pages']} pages "
        f"({ce['step_bytes'] >> 20} MiB) saved and loaded through CopyEngine between vLLM's "
        f"per-layer [blocks, kv_heads, block_size, 2*head_dim] tensors and the pool; "
        f"KVLayout({layout['num_layers']}, {layout['num_kv_heads']}, {layout['head_dim']}, "
        f"{layout['dtype']}): an 8B model's {ce['full_layers']} layers cut to "
        f"{layout['num_layers']}, {ce['page_bytes'] >> 10} KiB a page "
        f"({full_page >> 20} MiB uncut); GB/s, {ce['rounds']} interleaved rounds, one thread",
        f"{'op':<26} {'best':>6} {'median':>7} {'x limit':>8} {'faults':>7}",
    ]
    labels = {"cold_save": "save, cold pool", "cold_load": "load, cold pool",
              "warm_save": "save, warm pool", "warm_load": "load, warm pool",
              "torch_copy": "plain copy, torch copy_", "numpy_copy": "plain copy, np.copyto",
              "cold_save_faulting": "save, cold, no populate"}
    for name, label in labels.items():
        if name not in rates:                           # (a report from before they were)
            continue
        lines.append(f"{label:<26} {rates[name]['best']:>6.1f} {rates[name]['median']:>7.1f} "
                     f"{ce['vs_limit'][name]:>7.2f}x {ce['page_faults'][name]:>7}")
    lines.append(f"cold: each save or load through a mapping of the pool attached just before "
                 f"(the pages exist, its page tables are empty); a save maps its pages in "
                 f"first (populate_pages: a read per 64 KiB, timed) or, with no populate, "
                 f"faults them in by its stores; a load's reads fault them in; "
                 f"warm: one mapping start_prefault() populated ({ce.get('method', '?')}, "
                 f"{ce.get('prefault_state', '?')}; huge pages {ce.get('huge_pages', '?')}, "
                 f"tmpfs policy {ce.get('huge_policy') or 'unknown'}{_huge_mapped(ce)}); "
                 f"plain: as many bytes "
                 f"between two pre-faulted buffers; x limit: median over the faster plain "
                 f"copy's ({labels[ce['limit']].split(', ')[1]}); faults: the process's minor "
                 f"page faults during one op (median)"
                 + (f"; non-temporal stores {ce['stream_store_bytes']} bytes wide"
                    if ce.get("stream_store_bytes") else ""))
    if ce.get("layouts"):
        lines.append(f"{'other layouts, warm pool':<26} {'save':>6} {'x limit':>8} "
                     f"{'load':>6} {'x limit':>8}")
        for name, row in ce["layouts"].items():
            lines.append(f"{name:<26} {row['save_gbytes_per_s']:>6.1f} "
                         f"{row['save_vs_limit']:>7.2f}x {row['load_gbytes_per_s']:>6.1f} "
                         f"{row['load_vs_limit']:>7.2f}x")
        lines.append("other layouts: the same step and rounds, the engine's tensors in each "
                     "layout: " + "; ".join(f"{name} {row['block_layout']}"
                                            for name, row in ce["layouts"].items()))
    return lines


def _format_header(report: Dict[str, Any]) -> List[str]:
    """The machine, and the C-level ceilings where a section that compares with them ran
    (the page copy's where the data path ran too)."""
    m = report["machine"]
    lines = [
        f"{m['cpu']}, {m['cores']} cores; Python {m['python']}, numpy {m['numpy']}, "
        f"torch {m['torch'] or 'not installed'}; page size {report['page_size']}, "
        f"seed {report['seed']}{' (quick)' if report['quick'] else ''}; load average "
        f"{m['load_average_1m']:.2f} at the start",
    ]
    if "ceilings" in report:
        c = report["ceilings"]
        copy = (f"; page copy {c['copy_bytes_per_s'] / 1e9:.1f} GB/s (numpy copy of "
                f"{report['data_path']['pages_per_op']} contiguous pool pages) = "
                f"{c['copy_tokens_per_s'] / 1e6:.2f} M tokens/s of KV at "
                f"{DATA_LAYOUT.token_bytes // 1024} KiB/token" if "copy_bytes_per_s" in c else "")
        lines.append(f"C-level ceilings (one core): token compare "
                     f"{c['compare_tokens_per_s'] / 1e9:.2f} G tokens/s (memcmp){copy}")
    return lines


def _format_engine(report: Dict[str, Any]) -> List[str]:
    lines = _format_runs("engine: allocate -> release (commit) per request through a "
                         "WorkerView; reference: RadixModel + free list", report["engine"],
                         engine=True)
    lines.append("x ref: tokens/s over the reference's (us/req improves by the same factor); "
                 "the same flow and LRU should reuse and evict exactly as the reference does")
    lines.append("% cmp: of the token-compare ceiling; x copy: over copying those tokens' KV at "
                 "the page-copy ceiling; locked: share of the time the segment's lock was held")
    lines.append("x chain: tokens/s over the hash chain's (vLLM's algorithm: chained page "
                 "hashes in a dict, re-implemented without pages, refcounts or eviction; lists "
                 "in); not run where the pool is too small to cache everything")
    lines.append("rows: numpy int32 input; list input: the same prompts as Python lists (the "
                 "engines' own format), converted inside the timed calls; us/req: one request "
                 "per call (batch 1), allocate + release; hostkv and the hash chain take "
                 f"turns, {report['engine_rounds']} runs each, and keep their fastest")
    return lines


def _format_eviction(report: Dict[str, Any]) -> List[str]:
    ev = report["eviction"]
    demand = report["eviction_by_demand"]
    ref = (f"; reference {ev['reference_ns_per_token']:.0f} ns/token "
           f"({ev['speedup_vs_reference']:.1f}x)" if "reference_ns_per_token" in ev else "")
    return [f"eviction: cache.evict({ev['chunk_pages']}) until empty on the "
            f"{ev['workload']} workload's tree: {ev['ns_per_token']:.1f} ns per evicted token"
            f"{ref}",
            f"eviction by demand: one allocation of {demand['allocated_pages']} "
            f"pages that evicts {demand['evicted_pages']} on the "
            f"{demand['workload']} workload's cache: "
            f"{demand['ns_per_token']:.1f} ns per evicted token"]


def _format_gpu_copy(gc: Dict[str, Any]) -> List[str]:
    """The gpu-copy section: a step's save and load on the device against pinned copies, and
    the matmul beside saves."""
    if "skipped" in gc:
        return [f"gpu copy: skipped: {gc['skipped']}"]
    rates = gc["gbytes_per_s"]
    labels = {"save": "save (device -> pool)", "load": "load (pool -> device)",
              "pinned_d2h": "pinned copy_, device -> host",
              "pinned_h2d": "pinned copy_, host -> device"}
    lines = [f"gpu copy on {gc['device']}: one step's {gc['step_pages']} pages "
             f"({gc['step_bytes'] >> 20} MiB) through CopyEngine, vLLM's layout, the pool "
             f"registered for DMA ({gc['registered_bytes'] >> 20} MiB"
             + (f"; failed: {gc['register_failed']}" if gc.get("register_failed") else "")
             + f"); page bytes as the CPU path writes them: {'yes' if gc['bytes_exact'] else 'NO'}"
             f"; GB/s, {gc['rounds']} interleaved rounds",
             f"{'op':<30} {'best':>6} {'median':>7}"]
    for name, label in labels.items():
        lines.append(f"{label:<30} {rates[name]['best']:>6.1f} {rates[name]['median']:>7.1f}")
    lines.append(f"save / pinned d2h {gc['vs_pinned']['save']:.2f}x, load / pinned h2d "
                 f"{gc['vs_pinned']['load']:.2f}x (medians)")
    mm = gc["matmul"]
    lines.append(f"matmul bf16 8192^3: {mm['ms_alone']:.2f} ms a call alone, "
                 f"{mm['ms_beside_saves']:.2f} ms with a save submitted before each of "
                 f"{mm['calls']} calls: {mm['slowdown']:.3f}x")
    return lines


def _format_window_parts(rows: List[Dict[str, Any]]) -> List[str]:
    lines = ["window parts: the engine flow with a part for every eighth page (the part LRU "
             "at work) against none, taking turns",
             f"  {'workload':<14} {'pages':>6} {'parts':>6} {'us/req without':>15} "
             f"{'us/req with':>12} {'ratio':>6} {'evicted':>8} {'donated':>8} {'without':>8}"]
    for row in rows:
        parts = row["parts"]
        lines.append(
            f"  {row['workload']:<14} {row['num_pages']:>6} {row['num_parts']:>6} "
            f"{row['us_per_request_without']:>15.1f} {row['us_per_request_with']:>12.1f} "
            f"{row['ratio']:>6.2f} {parts['evicted']:>8} {parts['donated']:>8} "
            f"{parts['pages_without']:>8}")
    return lines


def format_table(report: Dict[str, Any]) -> str:
    """The report as plain-text tables: the sections it holds, in the order they run, one
    blank line between them."""
    formatters: List[Tuple[str, Callable[[Dict[str, Any]], List[str]]]] = [
        ("engine", _format_engine),
        ("eviction", _format_eviction),
        ("decode", lambda r: _format_decode(r["decode"])),
        ("processes", lambda r: _format_processes(r["processes"])),
        ("data_path", lambda r: _format_data_path(r["data_path"])),
        ("pool_faults", lambda r: _format_pool_faults(r["pool_faults"])),
        ("copy_engine", lambda r: _format_copy_engine(r["copy_engine"])),
        ("gpu_copy", lambda r: _format_gpu_copy(r["gpu_copy"])),
        ("tree", lambda r: _format_runs("tree: match then insert straight on _radix (no "
                                        "WorkerView)", r["tree"], engine=False)),
        ("window_parts", lambda r: _format_window_parts(r["window_parts"])),
    ]
    blocks = [_format_header(report)]
    blocks += [formatter(report) for key, formatter in formatters if key in report]
    return "\n\n".join("\n".join(block) for block in blocks)
