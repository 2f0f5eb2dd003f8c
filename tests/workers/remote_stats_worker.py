"""Worker processes of tests/test_remote_metrics.py: engine processes of one host, each with
its own RemoteTier on the host's segment, whose counters `python -m hostkv stats` sums."""

from __future__ import annotations

import os
import time

import numpy as np

import hostkv
from hostkv.remote import RemoteConfig, RemoteTier


def fetch_and_wait(name: str, url: str, prompt: np.ndarray, results, stop_file: str) -> None:
    """Fetches the prompt's pages through a tier of its own, reports its tier's stats, and
    keeps the tier open until stop_file exists (or the test kills it; a file, not a
    multiprocessing.Event: killing a process that waits on one breaks the Event)."""
    cache = hostkv.HostKVCache.attach(name)
    try:
        with RemoteTier(cache, RemoteConfig(url, key_prefix="t")) as tier:
            inserted = tier.fetch(prompt, timeout=30)
            results.put((inserted, tier.stats()))
            deadline = time.monotonic() + 60
            while not os.path.exists(stop_file) and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        cache.close()
