"""The worker of tests/test_soak.py: realistic WorkerView traffic on a shared segment until
it is killed (kept apart from the test module so that a spawned child imports no pytest).

Requests share prefixes across processes and namespaces; sequences decode (sometimes a
token is None), commit, and are released with or without commit; now and then the view, or
the whole cache handle, is closed and made anew. An armed worker also has a crash point:
at a random logged store of some later mutation it `_exit`s with status 77, inside the lock.
Exit status 1 (a traceback on stderr) is a failure: an operation raised something other
than running out of pages or records.
"""

from __future__ import annotations

import hashlib
import random
import sys
import traceback

import numpy as np

import hostkv
from hostkv import CapacityError, HostKVCache, OutOfPagesError, SequenceRequest, WorkerView

PAGE = 4
# Shared system prompts, 2 to 6 pages long: every process draws from the same few.
PREFIXES = [list(range(1000 * k, 1000 * k + PAGE * pages)) for k, pages in enumerate((2, 3, 4, 6), 1)]
NAMESPACES = (0, 0, 0, 1, 2**63 + 5)
MAX_LIVE = 6


def config() -> hostkv.HostKVConfig:
    # Window parts for a quarter of the pages: allocations take them from the part LRU or
    # go without, commits donate them, evictions and releases free them, under kill -9.
    return hostkv.HostKVConfig(num_pages=512, page_size=PAGE, page_bytes=64,
                               radix_node_capacity=128, max_sequences=128, max_processes=10,
                               num_parts=128, part_bytes=PART_BYTES)


PART_BYTES = 16


def part_pattern(namespace: int, tokens) -> bytes:
    """What a part must hold for the page that ends tokens: the bytes its writer puts in, a
    digest of the namespace and every token up to the page's end (the KV a part would hold
    depends on exactly these)."""
    digest = hashlib.blake2b(repr((namespace, list(tokens))).encode(), digest_size=PART_BYTES)
    return digest.digest()


def write_and_verify_parts(cache, parts, allocations, requests) -> None:
    """For each new sequence: every borrowed page that has a part must hold its pattern (a
    wrong part served to a hit fails the worker); every own full prompt page that has a part
    gets its pattern written, before anything can commit it. Prompts never reach decode
    tokens, so only prompt pages' parts are ever read back."""
    for alloc, request in zip(allocations, requests):
        tokens = list(request.tokens)
        table = alloc.page_table
        page_parts = cache.page_parts(table)
        reused = alloc.reused_tokens // PAGE
        for i in range(len(tokens) // PAGE):
            part = int(page_parts[i])
            if part == -1:
                continue
            want = part_pattern(request.namespace, tokens[:(i + 1) * PAGE])
            if i < reused:
                got = bytes(parts[part])
                assert got == want, (
                    f"page {table[i]} (prompt page {i}, namespace {request.namespace}) was "
                    f"served with part {part} holding {got.hex()}, not {want.hex()}")
            else:
                parts[part] = np.frombuffer(want, dtype=np.uint8)


def _prompt(rng: random.Random) -> list:
    prefix = rng.choice(PREFIXES)
    if rng.random() < 0.3:
        prefix = prefix[:rng.randint(1, len(prefix))]
    tail = [rng.randrange(50_000, 50_050) for _ in range(rng.randint(0 if prefix else 1, 9))]
    return prefix + tail


def run(name: str, seed: int, ops, armed: bool) -> None:
    rng = random.Random(seed)
    cache = HostKVCache.attach(name)
    parts = cache.parts_array()
    view = WorkerView(cache)
    next_id = 0
    while True:
        live = view.live_sequences
        action = rng.random()
        try:
            if armed and rng.random() < 0.02 and not cache._segment.crash_steps_left:
                cache._segment._arm_crash_point(rng.randint(1, 400))
            if action < 0.35 and len(live) < MAX_LIVE:
                batch = []
                for _ in range(rng.randint(1, 3)):
                    batch.append(SequenceRequest(next_id, _prompt(rng), rng.choice(NAMESPACES)))
                    next_id += 1
                allocations = view.allocate_pages_for_sequences_with_prefix(batch)
                write_and_verify_parts(cache, parts, allocations, batch)
            elif action < 0.65 and live:
                chosen = rng.sample(live, rng.randint(1, len(live)))
                for _ in range(rng.randint(1, 5)):
                    view.append_tokens(chosen, [None if rng.random() < 0.05
                                                else rng.randrange(60_000, 60_100)
                                                for _ in chosen])
            elif action < 0.75 and live:
                view.commit(rng.sample(live, rng.randint(1, len(live))))
            elif action < 0.92 and live:
                view.release(rng.sample(live, rng.randint(1, len(live))),
                             commit=rng.random() < 0.8)
            elif action < 0.94:
                view.close()
                view = WorkerView(cache)
            elif action < 0.95:
                view.close()
                del parts
                cache.close()
                cache = HostKVCache.attach(name)
                parts = cache.parts_array()
                view = WorkerView(cache)
            elif action < 0.96:
                cache.check()
            else:
                cache.match_prefix(_prompt(rng), rng.choice(NAMESPACES))
        except (OutOfPagesError, CapacityError):
            # Other processes (or dead ones not yet reaped) hold the pages: start over.
            view.release(view.live_sequences, commit=False)
        ops.value += 1


def main(name: str, seed: int, ops, armed: bool) -> None:
    """The spawn target: run() until killed; status 1 on any unexpected exception."""
    try:
        run(name, seed, ops, armed)
    except BaseException:  # noqa: BLE001 - reported through the exit status
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)
