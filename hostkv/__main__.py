"""`python -m hostkv`: inspect, stats, check and unlink a segment, or run the benchmark.

    python -m hostkv inspect NAME [--json]    config, header, leases, tree; changes nothing
    python -m hostkv stats NAME [--json]      the shared counters
    python -m hostkv check NAME               walks every invariant; exit status 1 if broken
    python -m hostkv unlink NAME              removes the segment's name
    python -m hostkv bench [--quick] [--json PATH]

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
    bench = sub.add_parser("bench", help="run the benchmark", add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    args, unknown = parser.parse_known_args(argv)
    if args.command == "bench":
        from hostkv import bench as bench_module
        return bench_module.main(unknown + args.rest)
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
            finally:
                cache.close()
            if args.json:
                print(json.dumps(stats, indent=2))
            else:
                _print_mapping(f"{args.name}:", stats)
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
