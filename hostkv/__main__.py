"""`python -m hostkv`: inspect, stats, check and unlink a segment, or run the benchmark.

    python -m hostkv inspect NAME [--json]    config, header, leases, tree; changes nothing
    python -m hostkv stats NAME [--json | --prometheus]   counters and metrics
    python -m hostkv check NAME               walks every invariant; exit status 1 if broken
    python -m hostkv unlink NAME              removes the segment's name
    python -m hostkv bench [--quick] [--json PATH]
    python -m hostkv bench --remote URL [--quick]   the remote tier against plain redis-py

inspect, stats and check attach without a lease (observers): they take no lease slot and
reap nobody, so they can be pointed at a production segment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import List, Optional

from hostkv import _radix
from hostkv.cache import HostKVCache
from hostkv.errors import CorruptionError, HostKVError


def _observe(name: str) -> HostKVCache:
    return HostKVCache.attach(name, lease=False)


def _metrics_dict(metrics) -> dict:
    out = dataclasses.asdict(metrics)
    out["namespaces"] = {str(k): {"lookup_tokens": v[0], "hit_tokens": v[1]}
                         for k, v in metrics.namespaces.items()}
    return out


def _metrics_summary(metrics) -> dict:
    return {
        "lock acquisitions": metrics.lock_acquisitions,
        "lock wait p50 / p99 (ns, <=)": f"{metrics.percentile_ns('wait', 0.5)} / "
                                        f"{metrics.percentile_ns('wait', 0.99)}",
        "lock hold p50 / p99 (ns, <=)": f"{metrics.percentile_ns('hold', 0.5)} / "
                                        f"{metrics.percentile_ns('hold', 0.99)}",
        "full hits": metrics.full_hits,
        **{f"misses: {reason}": count for reason, count in metrics.misses.items()},
        **{f"namespace {ns} hit/lookup tokens": f"{hit}/{lookup}"
           for ns, (lookup, hit) in metrics.namespaces.items()},
    }


def inspect_segment(name: str) -> dict:
    """A readable snapshot of a live segment, taken without changing it."""
    cache = _observe(name)
    try:
        seg = cache._segment

        def snapshot():
            info = seg.header_info()
            leases = [
                {"slot": slot, "pid": pid, "generation": gen, "registered_ns": registered,
                 "alive": seg.lease_alive(slot)}
                for slot, _state, pid, gen, registered in seg.leases()
            ]
            contents = _radix.tree_contents(seg)
            return info, leases, contents

        info, leases, contents = seg.run_locked(snapshot)
        page_size = cache.config.page_size
        depth_pages = max((len(pages) for _, _, pages, _ in contents), default=0)
        largest = sorted(contents, key=lambda c: len(c[2]), reverse=True)[:5]
        config = dataclasses.asdict(cache.config)
        return {
            "name": name,
            "config": config,
            "format": info["format"],
            "state": {1: "initialising", 2: "ready", 3: "corrupt"}.get(info["state"], info["state"]),
            "generation": info["generation"],
            "creator_pid": info["creator_pid"],
            "leases": leases,
            "stats": dataclasses.asdict(cache.stats()),
            "metrics": _metrics_dict(cache.metrics()),
            "tree": {
                "nodes": len(contents),
                "depth_pages": depth_pages,
                "largest_prefixes": [
                    {"namespace": ns, "tokens": len(pages) * page_size, "locks": locks,
                     "first_tokens": list(tokens[:8])}
                    for ns, tokens, pages, locks in largest
                ],
            },
        }
    finally:
        cache.close()


_STAT_HELP = {
    "free_pages": ("gauge", "Pages no one references."),
    "cached_pages": ("gauge", "Pages held by the radix tree."),
    "borrowed_pages": ("gauge", "Tree pages a live sequence holds (not evictable)."),
    "evictable_pages": ("gauge", "Cached pages no sequence protects."),
    "active_sequences": ("gauge", "Live sequences across all processes."),
    "active_processes": ("gauge", "Attached processes (live leases)."),
    "tree_nodes": ("gauge", "Radix-tree node records in use."),
}


def prometheus_text(name: str, stats: dict, metrics) -> str:
    """The stats and metrics in Prometheus' text exposition format (version 0.0.4)."""
    label = f'segment="{name}"'
    lines = []

    def metric(metric_name: str, kind: str, text: str, samples) -> None:
        lines.append(f"# HELP hostkv_{metric_name} {text}")
        lines.append(f"# TYPE hostkv_{metric_name} {kind}")
        for labels, value in samples:
            extra = "".join(f',{k}="{v}"' for k, v in labels)
            lines.append(f"hostkv_{metric_name}{{{label}{extra}}} {value}")

    for key, value in stats.items():
        kind, text = _STAT_HELP.get(key, ("counter", f"{key.replace('_', ' ')} so far."))
        metric(key if kind == "gauge" else f"{key}_total", kind, text, [((), value)])
    for which in ("wait", "hold"):
        histogram = getattr(metrics, f"lock_{which}_histogram")
        total_ns = getattr(metrics, f"lock_{which}_ns")
        name_ = f"lock_{which}_seconds"
        lines.append(f"# HELP hostkv_{name_} Time spent {'waiting for' if which == 'wait' else 'holding'} the segment lock.")
        lines.append(f"# TYPE hostkv_{name_} histogram")
        running = 0
        for bucket, count in enumerate(histogram):
            running += count
            upper = metrics.bucket_upper_ns(bucket) / 1e9
            lines.append(f'hostkv_{name_}_bucket{{{label},le="{upper:.9g}"}} {running}')
        lines.append(f'hostkv_{name_}_bucket{{{label},le="+Inf"}} {running}')
        lines.append(f"hostkv_{name_}_sum{{{label}}} {total_ns / 1e9:.9f}")
        lines.append(f"hostkv_{name_}_count{{{label}}} {running}")
    metric("full_hits_total", "counter", "Requests that reused every page they could.",
           [((), metrics.full_hits)])
    metric("misses_total", "counter", "Requests that reused less than they could, by reason.",
           [((("reason", reason),), count) for reason, count in metrics.misses.items()])
    metric("namespace_lookup_tokens_total", "counter", "Prompt tokens looked up, by namespace.",
           [((("namespace", ns),), lookup) for ns, (lookup, _) in metrics.namespaces.items()])
    metric("namespace_hit_tokens_total", "counter", "Prompt tokens reused, by namespace.",
           [((("namespace", ns),), hit) for ns, (_, hit) in metrics.namespaces.items()])
    return "\n".join(lines) + "\n"


def _observe_metrics(report: dict):
    from hostkv.cache import CacheMetrics

    m = dict(report["metrics"])
    m["namespaces"] = {k: (v["lookup_tokens"], v["hit_tokens"]) for k, v in m["namespaces"].items()}
    m["lock_wait_histogram"] = tuple(m["lock_wait_histogram"])
    m["lock_hold_histogram"] = tuple(m["lock_hold_histogram"])
    return CacheMetrics(**m)


def _print_mapping(title: str, mapping: dict) -> None:
    print(title)
    for key, value in mapping.items():
        print(f"  {key:<28} {value}")


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of `python -m hostkv` (and the `hostkv` console script)."""
    parser = argparse.ArgumentParser(prog="python -m hostkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command, text in (("inspect", "a readable view of a live segment"),
                          ("stats", "the shared counters"),
                          ("check", "walk every invariant"),
                          ("unlink", "remove the segment's name")):
        p = sub.add_parser(command, help=text)
        p.add_argument("name")
        if command in ("inspect", "stats"):
            p.add_argument("--json", action="store_true", help="print JSON")
        if command == "stats":
            p.add_argument("--prometheus", action="store_true",
                           help="print Prometheus text exposition format")
    bench = sub.add_parser("bench", help="run the benchmark", add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    args, unknown = parser.parse_known_args(argv)
    if args.command == "bench":
        rest = unknown + args.rest
        if any(arg == "--remote" or arg.startswith("--remote=") for arg in rest):
            from hostkv.remote import bench as remote_bench
            return remote_bench.main(rest)
        from hostkv import bench as bench_module
        return bench_module.main(rest)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if args.command == "unlink":
            HostKVCache.unlink_segment(args.name)
            print(f"unlinked {args.name}")
        elif args.command == "check":
            cache = _observe(args.name)
            try:
                cache.check()
            finally:
                cache.close()
            print(f"{args.name}: ok")
        elif args.command == "stats":
            cache = _observe(args.name)
            try:
                stats = dataclasses.asdict(cache.stats())
                metrics = cache.metrics()
            finally:
                cache.close()
            if args.prometheus:
                sys.stdout.write(prometheus_text(args.name, stats, metrics))
            elif args.json:
                print(json.dumps({**stats, "metrics": _metrics_dict(metrics)}, indent=2))
            else:
                _print_mapping(f"{args.name}:", stats)
                _print_mapping("metrics:", _metrics_summary(metrics))
        elif args.command == "inspect":
            report = inspect_segment(args.name)
            if args.json:
                print(json.dumps(report, indent=2, default=str))
            else:
                _print_mapping("config:", report["config"])
                print(f"state: {report['state']}, generation {report['generation']}, "
                      f"created by pid {report['creator_pid']}")
                print("leases:")
                for lease in report["leases"]:
                    print(f"  slot {lease['slot']:<4} pid {lease['pid']:<8} "
                          f"{'alive' if lease['alive'] else 'DEAD'}")
                _print_mapping("stats:", report["stats"])
                _print_mapping("metrics:", _metrics_summary(_observe_metrics(report)))
                _print_mapping("tree:", {k: v for k, v in report["tree"].items()
                                         if k != "largest_prefixes"})
                for prefix in report["tree"]["largest_prefixes"]:
                    print(f"  namespace {prefix['namespace']}: {prefix['tokens']} tokens, "
                          f"{prefix['locks']} locks, starts {prefix['first_tokens']}")
    except CorruptionError as exc:
        print(f"{args.name}: CORRUPT: {exc}", file=sys.stderr)
        return 1
    except (HostKVError, ValueError) as exc:
        print(f"{args.name}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
