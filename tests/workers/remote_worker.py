"""Worker processes of the remote tier's tests: each is one engine process on one "host"
(its own segment), with its own RemoteTier on a shared server."""

from __future__ import annotations

import os
import signal

import numpy as np

import hostkv
from hostkv.remote import RemoteConfig, RemoteTier


def compute_and_publish(name: str, url: str, prompt: np.ndarray, seed: int, results) -> None:
    """Host A: allocates the prompt, writes seeded KV bytes into its pages (as prefill
    would), releases it through the tier (commit + write-behind), waits for the writes, and
    reports the bytes of the prompt's full pages."""
    cache = hostkv.HostKVCache.attach(name)
    try:
        view = hostkv.WorkerView(cache)
        with RemoteTier(cache, RemoteConfig(url, key_prefix="t")) as tier:
            alloc = view.allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(1, prompt)])[0]
            pool = cache.pages_array()
            rng = np.random.default_rng(seed)
            for page in alloc.page_table:
                pool[page] = rng.integers(0, 256, cache.config.page_bytes, dtype=np.uint8)
            full = len(prompt) // cache.config.page_size
            written = [pool[p].tobytes() for p in alloc.page_table[:full]]
            del pool
            tier.release(view, [1])
            assert tier.flush(30)
            stats = tier.stats()
        view.close()
        results.put(("a", written, stats.written_pages))
    finally:
        cache.close()


def fetch_and_reuse(name: str, url: str, prompt: np.ndarray, results) -> None:
    """Host B: fetches the prompt's pages from the store (blocking form), then allocates it
    and reports how many tokens it reused and the bytes of the reused pages."""
    cache = hostkv.HostKVCache.attach(name)
    try:
        view = hostkv.WorkerView(cache)
        with RemoteTier(cache, RemoteConfig(url, key_prefix="t")) as tier:
            inserted = tier.fetch(prompt, timeout=30)
            alloc = view.allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(7, prompt)])[0]
            pool = cache.pages_array()
            reused = [pool[p].tobytes() for p in alloc.page_table[:alloc.num_shared_pages]]
            del pool
            view.release([7])
            stats = tier.stats()
        view.close()
        results.put(("b", inserted, alloc.reused_tokens, reused, stats.hit_pages))
    finally:
        cache.close()


def die_mid_fetch(name: str, url: str, prompt: np.ndarray, marker: str) -> None:
    """Fetches the prompt and is SIGKILLed after the fetched bytes are in its fresh pages,
    before their commit: the core must reclaim them like any dead process's. Writes the
    fresh pages' indices to `marker` first (synchronously: a queue's feeder thread would
    not get to run)."""
    cache = hostkv.HostKVCache.attach(name)
    tier = RemoteTier(cache, RemoteConfig(url, key_prefix="t"))

    def die(pages) -> None:
        with open(marker, "w") as f:
            f.write(" ".join(str(int(p)) for p in pages))
        os.kill(os.getpid(), signal.SIGKILL)

    tier._hook = die
    tier.fetch(prompt, timeout=30)
    os._exit(3)          # the hook never ran
