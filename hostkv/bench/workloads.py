"""The bench's seeded workloads: request lists built the same way in every process."""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Callable, Dict, List, Tuple

import numpy as np

PAGE_SIZE = 16
VOCAB = 32_000


@dataclasses.dataclass
class Workload:
    """A named list of requests (token arrays) and the pool size to replay them with.

    Attributes:
        name: The workload's name in the report.
        requests: Prompt token arrays, in arrival order.
        streams: Per request, the conversation it belongs to: requests of one stream depend
            on each other (a chat's turns), so one process replays a stream, in order.
        pool_fraction: The pool's size as a fraction of the working set (1.0: no eviction).
    """

    name: str
    requests: List[np.ndarray]
    streams: List[int]
    pool_fraction: float = 1.0

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.requests)

    @property
    def max_pages(self) -> int:
        """Full pages of all requests together (an upper bound of the working set)."""
        return sum(len(r) // PAGE_SIZE for r in self.requests)

    def working_set_pages(self) -> int:
        """Distinct cacheable pages: full pages with distinct prefixes across all requests."""
        ids: Dict[Tuple[int, bytes], int] = {}
        for tokens in self.requests:
            parent = -1
            full = len(tokens) // PAGE_SIZE
            for page in tokens[:full * PAGE_SIZE].reshape(full, PAGE_SIZE):
                parent = ids.setdefault((parent, page.tobytes()), len(ids))
        return len(ids)

    def pool_pages(self, live: int = 1) -> int:
        """The pool for a replay: pool_fraction of the working set, plus room for `live`
        sequences of the largest request (one per process replaying at once)."""
        largest = max(-(-len(r) // PAGE_SIZE) for r in self.requests)
        return int(math.ceil(self.working_set_pages() * self.pool_fraction)) + live * largest + 16

    def share(self, index: int, count: int) -> List[int]:
        """The requests process `index` of `count` replays: every stream that is index mod
        count, in arrival order."""
        return [i for i, stream in enumerate(self.streams) if stream % count == index]


Requests = Tuple[List[np.ndarray], List[int]]      # requests and their streams


def shared_prompts(rng: np.random.Generator, num_requests: int) -> Requests:
    """8 system prompts of 2,048 tokens, picked at random; each request adds a unique
    256-token suffix. Every request is a stream of its own."""
    prompts = [rng.integers(0, VOCAB, 2048, dtype=np.int32) for _ in range(8)]
    picks = rng.integers(0, len(prompts), num_requests)
    requests = [np.concatenate([prompts[p], rng.integers(0, VOCAB, 256, dtype=np.int32)])
                for p in picks]
    return requests, list(range(num_requests))


def multi_turn(rng: np.random.Generator, num_chats: int, turns: int = 10) -> Requests:
    """Chats whose every turn resends the whole context plus ~200 new tokens; interleaved
    turn by turn. A chat is a stream."""
    contexts = [np.empty(0, dtype=np.int32) for _ in range(num_chats)]
    requests = []
    for _ in range(turns):
        for c in range(num_chats):
            grow = int(rng.integers(150, 251))
            contexts[c] = np.concatenate([contexts[c], rng.integers(0, VOCAB, grow, dtype=np.int32)])
            requests.append(contexts[c])
    return requests, list(range(num_chats)) * turns


def no_sharing(rng: np.random.Generator, num_requests: int) -> Requests:
    """Random 1,024-token prompts: nothing to reuse, every page is new."""
    return ([rng.integers(0, VOCAB, 1024, dtype=np.int32) for _ in range(num_requests)],
            list(range(num_requests)))


def short_prompts(rng: np.random.Generator, num_requests: int) -> Requests:
    """Prompts of 100-300 tokens: one of 16 shared 96-token preambles and a unique rest,
    where a request's fixed cost, not its length, decides the speed."""
    preambles = [rng.integers(0, VOCAB, 96, dtype=np.int32) for _ in range(16)]
    picks = rng.integers(0, len(preambles), num_requests)
    rests = rng.integers(4, 205, num_requests)
    requests = [np.concatenate([preambles[p], rng.integers(0, VOCAB, int(r), dtype=np.int32)])
                for p, r in zip(picks, rests)]
    return requests, list(range(num_requests))


GENERATORS: Dict[str, Callable[[np.random.Generator, int], Requests]] = {
    "short-prompt": short_prompts,
    "shared-prompt": shared_prompts,
    "multi-turn": multi_turn,
    "no-sharing": no_sharing,
}


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """How to build a workload: small and picklable, so spawned processes rebuild the very
    same requests from it instead of receiving them.

    Attributes:
        name: The name in the report.
        kind: A key of GENERATORS.
        size: Requests (shared-prompt, no-sharing) or chats (multi-turn).
        seed: The generator's seed (mixed with the name, so workloads differ).
        pool_fraction: See Workload.
    """

    name: str
    kind: str
    size: int
    seed: int
    pool_fraction: float = 1.0

    def build(self) -> Workload:
        rng = np.random.default_rng([self.seed, zlib.crc32(self.name.encode())])
        requests, streams = GENERATORS[self.kind](rng, self.size)
        return Workload(self.name, requests, streams, self.pool_fraction)


def workload_specs(quick: bool, seed: int) -> List[WorkloadSpec]:
    """The engine workloads (the eviction one: shared prompts in a pool of a quarter of
    their working set)."""
    return [
        WorkloadSpec("shared-prompt", "shared-prompt", 300 if quick else 2000, seed),
        WorkloadSpec("multi-turn", "multi-turn", 12 if quick else 60, seed),
        WorkloadSpec("no-sharing", "no-sharing", 200 if quick else 1000, seed),
        WorkloadSpec("short-prompt", "short-prompt", 500 if quick else 5000, seed),
        WorkloadSpec("eviction", "shared-prompt", 300 if quick else 2000, seed, pool_fraction=0.25),
    ]
