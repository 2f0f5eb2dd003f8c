"""What the scheduler tells the workers each step, and what every worker answers."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

__all__ = ["HostKVConnectorMetadata", "HostKVWorkerMetadata"]


@dataclasses.dataclass
class HostKVConnectorMetadata(KVConnectorMetadata):
    """One step's copies, from the scheduler to every worker (each tensor-parallel rank
    moves its slice of the same pages).

    Attributes:
        step: The scheduler's step number (the workers confirm steps by it).
        loads: (req_id, hostkv pages, vLLM blocks) to copy pool -> blocks before the
            forward; the blocks one list per KV-cache group, each as long as the pages.
        saves: (req_id, vLLM blocks, hostkv pages) to copy blocks -> pool after the forward
            (the blocks as in ``loads``).
        bad_blocks: Blocks promised as external hits that hostkv could not hold (evicted
            between lookup and borrow); the workers report them as load errors.
        finishing: Requests that finished while their saves ran: vLLM keeps their blocks
            until every worker reports them finished sending (its saves are over).
        preempted: Requests vLLM preempted this step: their blocks go to other requests,
            so a worker finishes their saves before this step's forward.
        recv_failed: Requests whose asynchronous load (a model of several KV-cache groups)
            failed before it reached the workers: each worker reports them received and
            failed, and vLLM computes them from their first token.
        segment_id: The id of the segment the scheduler's pages are in
            (``HostKVCache.segment_id``); 0: unknown. A worker that mapped a segment of
            another id (the name was unlinked and made again between their opens) copies
            nothing: its loads are reported bad, its saves failed.
        load_parts: With window parts, each load's pages' parts (-1: none), by request;
            the borrow holds them until the load is over.
        save_parts: With window parts, each save's pages' parts (-1: none; a page without
            one is saved without its window layers), by request.
        scheduler_lease: The scheduler's lease in the segment, (slot, generation)
            (``HostKVCache.lease_identity``); None: unknown. Each worker joins its group
            before its first copy, so that, should the scheduler die, the pages its
            sequences reserved stay quarantined while a worker may still write them; and
            a worker stops saving once that lease is dead.
    """

    step: int = 0
    loads: List[Tuple[str, List[int], List[List[int]]]] = dataclasses.field(
        default_factory=list)
    saves: List[Tuple[str, List[List[int]], List[int]]] = dataclasses.field(
        default_factory=list)
    bad_blocks: List[int] = dataclasses.field(default_factory=list)
    finishing: List[str] = dataclasses.field(default_factory=list)
    preempted: List[str] = dataclasses.field(default_factory=list)
    recv_failed: List[str] = dataclasses.field(default_factory=list)
    segment_id: int = 0
    scheduler_lease: Optional[Tuple[int, int]] = None
    load_parts: Dict[str, List[int]] = dataclasses.field(default_factory=dict)
    save_parts: Dict[str, List[int]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class HostKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Steps whose copies workers finished: (step, rank, request ids whose copies failed).

    vLLM merges every rank's report of a step with :meth:`aggregate`; the scheduler
    commits a step's saves only once every rank has confirmed it.
    """

    done: List[Tuple[int, int, List[str]]] = dataclasses.field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merges another worker's report (one entry per step and rank)."""
        merged: Dict[Tuple[int, int], Set[str]] = {}
        for step, rank, failed in self.done + list(getattr(other, "done", [])):
            merged.setdefault((step, rank), set()).update(failed)
        return HostKVWorkerMetadata(done=[(step, rank, sorted(failed))
                                          for (step, rank), failed in sorted(merged.items())])
