"""Two-"host" helpers of the remote tier's tests: a Host is a segment of its own with an
engine's WorkerView and a RemoteTier, as one machine of a fleet would have."""

from __future__ import annotations

import time
from typing import Optional

import numpy as np
import pytest

import hostkv
from hostkv.remote import RemoteConfig, RemoteTier
from hostkv.remote.backend import RemoteBackend

PAGE_SIZE = 4
PAGE_BYTES = 256
WAIT = 30.0          # generous bounds: a hang fails the test instead of stalling the run


def host_config(**overrides) -> hostkv.HostKVConfig:
    values = dict(num_pages=64, page_size=PAGE_SIZE, page_bytes=PAGE_BYTES, max_processes=8)
    values.update(overrides)
    return hostkv.HostKVConfig(**values)


def fast_config(url: str, **overrides) -> RemoteConfig:
    """Short timeouts and backoff, so the fault tests run in a second or two."""
    values = dict(key_prefix="t", socket_timeout=0.3, connect_timeout=0.3, failure_threshold=2,
                  backoff_initial=0.05, backoff_max=0.2)
    values.update(overrides)
    return RemoteConfig(url, **values)


class Host:
    """One "host": its own segment, an engine's WorkerView and a RemoteTier."""

    def __init__(self, name: str, remote: RemoteConfig, config: hostkv.HostKVConfig,
                 backend: Optional[RemoteBackend] = None) -> None:
        """backend: a store other than the one the URL names (RemoteTier's)."""
        self.cache = hostkv.HostKVCache.create(name, config)
        self.view = hostkv.WorkerView(self.cache)
        self.tier = RemoteTier(self.cache, remote, backend=backend)
        self._ids = iter(range(1, 1 << 30))

    def compute(self, tokens: np.ndarray, seed: int, namespace: int = 0) -> list:
        """Allocates the prompt, writes seeded KV into its fresh pages, releases through the
        tier and waits for the writes. Returns the bytes of its full pages."""
        seq_id = next(self._ids)
        alloc = self.view.allocate_pages_for_sequences_with_prefix(
            [hostkv.SequenceRequest(seq_id, tokens, namespace)])[0]
        pool = self.cache.pages_array()
        rng = np.random.default_rng(seed)
        for page in alloc.page_table[alloc.num_shared_pages:]:
            pool[page] = rng.integers(0, 256, PAGE_BYTES, dtype=np.uint8)
        full = len(tokens) // PAGE_SIZE
        written = [pool[p].tobytes() for p in alloc.page_table[:full]]
        del pool
        self.tier.release(self.view, [seq_id])
        assert self.tier.flush(WAIT)
        return written

    def reuse(self, tokens: np.ndarray, namespace: int = 0) -> tuple:
        """Allocates the prompt as an engine would; returns (reused tokens, their bytes)."""
        seq_id = next(self._ids)
        alloc = self.view.allocate_pages_for_sequences_with_prefix(
            [hostkv.SequenceRequest(seq_id, tokens, namespace)])[0]
        pool = self.cache.pages_array()
        shared = [pool[p].tobytes() for p in alloc.page_table[:alloc.num_shared_pages]]
        del pool
        self.view.release([seq_id], commit=False)
        return alloc.reused_tokens, shared

    def close(self) -> None:
        self.tier.close()
        self.view.close()
        self.cache.check()
        self.cache.close()


@pytest.fixture
def make_host(new_name):
    """Builds Hosts; closes them (checking every invariant) in teardown."""
    made = []

    def make(remote: RemoteConfig, **config) -> Host:
        host = Host(new_name(), remote, host_config(**config))
        made.append(host)
        return host

    yield make
    for host in made:
        host.close()


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n, dtype=np.int32)


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


