"""The connector's worker side: each step's copies between vLLM's KV blocks and the pages.

One runs in every vLLM worker process (one per tensor-parallel rank). It maps the worker's
per-layer KV tensors onto the pool once (a :class:`hostkv.copy_engine.CopyEngine`, its
slice of the heads), copies what the scheduler's metadata says, and reports each step back
with its rank, so the scheduler commits a page only after every rank saved its slice.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Set, Tuple

import torch

from hostkv.cache import HostKVCache
from hostkv.copy_engine import CopyEngine
from hostkv.vllm.layout import EngineKV, describe_layout
from hostkv.vllm.metadata import HostKVConnectorMetadata
from hostkv.vllm.metrics import Counters, Failures

__all__ = ["WorkerSide"]


class WorkerSide:
    """Everything the connector does in a vLLM worker process: the copies.

    Args:
        cache: This process's handle on the segment.
        kv: The engine's KV cache as hostkv pages.
        rank: This worker's tensor-parallel rank.
        failures, counters: The connector's.
    """

    def __init__(self, cache: HostKVCache, kv: EngineKV, rank: int, failures: Failures,
                 counters: Counters) -> None:
        self.cache = cache
        self.kv = kv
        self.rank = rank
        self.heads = kv.heads_of_rank(rank)
        self.failures = failures
        self.counters = counters
        self.engine: Optional[CopyEngine] = None
        self.bad_blocks: Set[int] = set()
        self.done: List[Tuple[int, int, List[str]]] = []
        self.load_failed: Set[str] = set()
        self.prefaulted = 0

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        """Maps vLLM's per-layer KV tensors onto the pages (start-up: raises, naming the
        backend and the shape it cannot map)."""
        kv = self.kv
        unknown = sorted(set(kv_caches) - set(kv.layer_names))
        missing = [name for name in kv.layer_names if name not in kv_caches]
        if unknown or missing:
            raise ValueError(f"hostkv: vLLM registered KV caches for layers {sorted(kv_caches)}"
                             f"; its KV-cache spec names {list(kv.layer_names)}")
        first, stop, writes = self.heads
        tensors = [kv_caches[name] for name in kv.layer_names]
        try:
            engine = CopyEngine(self.cache.pages_tensor(), kv.layout, kv.page_size, tensors,
                                kv.block_layout, heads=(first, stop), writes=writes)
        except ValueError as exc:
            raise ValueError(
                f"hostkv: {kv.backend}'s KV cache (layer {kv.layer_names[0]!r}: shape "
                f"{tuple(tensors[0].shape)}, stride {tuple(tensors[0].stride())}, "
                f"{tensors[0].dtype}) cannot be mapped onto pages of "
                f"{describe_layout(kv.layout, kv.page_size)} (KV heads [{first}, {stop}) of "
                f"rank {self.rank}): {exc}") from None
        self.engine = engine
        # Off the serving path: this process's first saves into a fresh mapping would
        # otherwise pay a page fault per 4 KiB of the pool.
        self.cache.start_prefault()

    def take_prefault_progress(self) -> None:
        """Adds the pool bytes pre-faulted since the last call to ``prefaulted_bytes``."""
        done = self.cache.prefault_status().done_bytes
        if done > self.prefaulted:
            self.counters.add("prefaulted_bytes", done - self.prefaulted)
            self.prefaulted = done

    def unregister_kv_caches(self) -> None:
        """vLLM is remapping its KV tensors (sleep mode): no copy may touch the old ones."""
        self.engine = None

    def _engine(self) -> CopyEngine:
        if self.engine is None:
            raise RuntimeError("vLLM's KV caches are not registered (asleep?)")
        return self.engine

    def start_load_kv(self, meta: HostKVConnectorMetadata) -> None:
        """Copies this step's borrowed pages into their blocks (before the forward)."""
        self.bad_blocks.update(meta.bad_blocks)
        self.load_failed = set()
        if not meta.loads:
            return
        pages = [p for _, ps, _ in meta.loads for p in ps]
        blocks = [b for _, _, bs in meta.loads for b in bs]
        start = time.perf_counter()
        try:
            moved = self._engine().load(pages, blocks)
        except Exception as exc:          # noqa: BLE001 - fail open: vLLM recomputes
            self.failures.note("load", exc)
            self.counters.add("failures", 1)
            self.bad_blocks.update(blocks)
            self.load_failed = {req_id for req_id, _, _ in meta.loads}
            return
        self.counters.add("load_s", time.perf_counter() - start)
        if self.rank == 0:                # pages once per engine; bytes as every rank moved
            self.counters.add("loaded_pages", len(pages))
        self.counters.add("loaded_bytes", moved)

    def wait_for_save(self, meta: HostKVConnectorMetadata) -> None:
        """Copies this step's computed blocks into their reserved pages, and reports."""
        failed = set(self.load_failed)
        saves = [s for s in meta.saves if s[0] not in self.load_failed]
        if saves:
            blocks = [b for _, bs, _ in saves for b in bs]
            pages = [p for _, _, ps in saves for p in ps]
            start = time.perf_counter()
            try:
                moved = self._engine().save(blocks, pages)
                self.counters.add("save_s", time.perf_counter() - start)
                if self.rank == 0:
                    self.counters.add("saved_pages", len(pages))
                self.counters.add("saved_bytes", moved)
            except Exception as exc:      # noqa: BLE001 - fail open: nothing is committed
                self.failures.note("save", exc)
                self.counters.add("failures", 1)
                failed |= {req_id for req_id, _, _ in saves}
        if meta.loads or meta.saves:
            self.done.append((meta.step, self.rank, sorted(failed)))
        self.load_failed = set()

    def shutdown(self) -> None:
        """Drops the views of the pool and detaches."""
        self.engine = None
        self.cache.close()
