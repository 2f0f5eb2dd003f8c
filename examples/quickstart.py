"""hostkv in one page: worker processes share prefix KV through one segment.

Each worker runs an engine-shaped loop over seeded requests (a few shared system prompts,
each with a unique question): allocate with prefix reuse -> check the reused KV pages hold
exactly what the process that computed them wrote -> "compute" and write KV only for the
tokens not reused -> decode a few tokens -> commit -> release. The "KV" of a token is a
deterministic function of its position and the tokens before it, so any page handed back
with the wrong contents is caught. Run it:

    python examples/quickstart.py [--workers 2] [--requests 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
import uuid

import numpy as np

import hostkv

PAGE_SIZE = 16
TOKEN_BYTES = 32            # bytes of "KV" per token in this demo (a real model's is larger)
VOCAB = 32_000


def fake_kv(tokens: np.ndarray, start: int, stop: int) -> np.ndarray:
    """The KV bytes of tokens[start:stop]: a function of each position's whole prefix."""
    prefix_hash = np.cumsum(tokens.astype(np.uint64) * np.uint64(2654435761), dtype=np.uint64)
    rows = np.arange(TOKEN_BYTES, dtype=np.uint64)
    values = (prefix_hash[start:stop, None] + rows[None, :] * np.uint64(40503)) >> np.uint64(7)
    return (values & np.uint64(0xFF)).astype(np.uint8)


def write_kv(pool: np.ndarray, pages: np.ndarray, tokens: np.ndarray, start: int, stop: int) -> None:
    kv = fake_kv(tokens, start, stop)
    for position in range(start, stop):
        page, slot = pages[position // PAGE_SIZE], position % PAGE_SIZE
        pool[page, slot * TOKEN_BYTES:(slot + 1) * TOKEN_BYTES] = kv[position - start]


def read_kv(pool: np.ndarray, pages: np.ndarray, stop: int) -> np.ndarray:
    rows = [pool[pages[p // PAGE_SIZE], (p % PAGE_SIZE) * TOKEN_BYTES:(p % PAGE_SIZE + 1) * TOKEN_BYTES]
            for p in range(stop)]
    return np.array(rows, dtype=np.uint8).reshape(stop, TOKEN_BYTES)


def make_requests(seed: int, count: int) -> list:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, int(rng.integers(300, 900)), dtype=np.int32) for _ in range(4)]
    return [np.concatenate([prompts[i % 4], rng.integers(0, VOCAB, int(rng.integers(20, 80)), dtype=np.int32)])
            for i in range(count)]


def worker(name: str, worker_id: int, num_workers: int, requests: list, seed: int, out) -> None:
    cache = hostkv.HostKVCache.attach(name)
    view = hostkv.WorkerView(cache)
    pool = cache.pages_array()
    rng = np.random.default_rng(seed + worker_id)
    prompt_tokens = reused = wrong = 0
    for seq_id in range(worker_id, len(requests), num_workers):
        tokens = requests[seq_id]
        (alloc,) = view.allocate_pages_for_sequences_with_prefix(
            [hostkv.SequenceRequest(seq_id, tokens)])
        pages = alloc.page_table
        if alloc.reused_tokens:
            if not np.array_equal(read_kv(pool, pages, alloc.reused_tokens),
                                  fake_kv(tokens, 0, alloc.reused_tokens)):
                wrong += 1
        write_kv(pool, pages, tokens, alloc.reused_tokens, len(tokens))
        prompt_tokens += len(tokens)
        reused += alloc.reused_tokens
        for _ in range(int(rng.integers(4, 24))):       # decode: one token per step
            token = int(rng.integers(0, VOCAB))
            view.append_tokens([seq_id], [token])
            state_tokens = view.state(seq_id).tokens
            write_kv(pool, view.page_table(seq_id), state_tokens, len(state_tokens) - 1, len(state_tokens))
        view.release([seq_id], commit=True)             # KV written: publish, then let go
    del pool
    view.close()
    cache.close()
    out.put((worker_id, prompt_tokens, reused, wrong))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--segment-name", default=f"hostkv-quickstart-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    args = parser.parse_args()

    requests = make_requests(args.seed, args.requests)
    pages_needed = sum(len(r) // PAGE_SIZE + 3 for r in requests)
    config = hostkv.HostKVConfig(num_pages=max(256, pages_needed // 8), page_size=PAGE_SIZE,
                                 page_bytes=PAGE_SIZE * TOKEN_BYTES)
    cache = hostkv.HostKVCache.create(args.segment_name, config)
    try:
        context = multiprocessing.get_context("spawn")
        out = context.Queue()
        start = time.perf_counter()
        processes = [context.Process(target=worker, args=(args.segment_name, w, args.workers,
                                                          requests, args.seed, out))
                     for w in range(args.workers)]
        for p in processes:
            p.start()
        results = sorted(out.get(timeout=600) for _ in processes)
        for p in processes:
            p.join(timeout=60)
        elapsed = time.perf_counter() - start
        stats = cache.stats()
        cache.check()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        cache.close()
        hostkv.HostKVCache.unlink_segment(args.segment_name)

    print(f"{'worker':>6} {'prompt tokens':>14} {'reused':>10} {'hit rate':>9} {'wrong KV':>9}")
    for worker_id, prompt_tokens, reused, wrong in results:
        print(f"{worker_id:>6} {prompt_tokens:>14} {reused:>10} {reused / prompt_tokens:>9.1%} {wrong:>9}")
    total_prompt = sum(r[1] for r in results)
    total_reused = sum(r[2] for r in results)
    print(f"{'all':>6} {total_prompt:>14} {total_reused:>10} {total_reused / total_prompt:>9.1%} "
          f"{sum(r[3] for r in results):>9}")
    print(f"\n{args.requests} requests on {args.workers} processes in {elapsed:.2f} s; pool of "
          f"{config.num_pages} pages, {stats.evicted_pages} evicted, {stats.cached_pages} cached "
          f"at the end")
    failed = any(p.exitcode != 0 for p in processes) or any(r[3] for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
