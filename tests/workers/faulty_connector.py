"""A HostKVConnector whose copies fail at random on one tensor-parallel rank (tests only).

Real engines load it (``kv_connector_module_path: "workers.faulty_connector"``, with tests/
on the engine processes' path) to check the connector's promise under the faults it is built
for: a page is committed only if every rank wrote every byte of it, from KV computed on
verified inputs. The product code has no fault hooks: the subclass wraps the worker's
:class:`hostkv.copy_engine.CopyEngine` on the chosen rank, so the faults enter exactly where
real ones would, through the two ways a copy fails in ``hostkv/vllm/worker.py``:

- at submit: ``submit_save`` / ``submit_load`` raise, nothing copied;
- late: the copy writes only some of its pages (none, or a prefix) and its
  :class:`~hostkv.transfers.Transfer` ends with an error. A late save error comes when the
  copy thread reaches it (a step or more later with ``async_saves``); a late load error
  comes after the forward read the blocks, as on a GPU, where a load is only known to have
  failed once its stream is done (on a CPU a real load is over when submitted, so only
  this subclass makes one fail late).

``kv_connector_extra_config`` keys, removed before the connector reads the rest:

    fault_rank        the rank whose copies fail (default 1)
    fault_save_rate   the chance that a step's save fails (default 0)
    fault_load_rate   the chance that a step's load fails (default 0)
    fault_seed        seeds each rank's random choices (default 0)
    fault_control     a JSON file read at every step whose keys, when present, replace
                      the rates ("save_rate", "load_rate"), switch "async_saves" and, with
                      a new "seed", start the random choices afresh, so one engine serves
                      batches under several fault settings, each reproducible alone (an
                      engine start costs 30-90 s on the CI machine)
                      A "kill_mid_save" key {"cached_pages_above": N, "sequences": S}
                      makes the rank kill -9 itself right after it submits a save, once
                      the segment caches more than N pages and has S live sequences: a
                      rank lost mid-save (with ``async_saves``, its save still in flight)
                      at a point no outside observer has to catch
    fault_counts      a path: each faulty rank writes what it injected to PATH.rank<R>
                      (JSON: "saves", "save_faults", "saves_failed_late", and the same
                      for loads), so a test can tell that faults happened, and a trace of
                      each step's copies and each fault to PATH.rank<R>.trace

Switching ``async_saves`` at run time (between batches, the engine idle) sets what the two
sides read of it: the scheduler's settings (whether a finished request's blocks wait for its
saves) and the worker's (whether a step's saves are waited for inside the step). The copy
engine keeps the copy thread it was built with; with ``async_saves`` off each step drains it,
so every step's saves are over, and reported, within the step, as with inline copies.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hostkv.transfers import Transfer
from hostkv.vllm import HostKVConnector

__all__ = ["FaultyHostKVConnector", "InjectedFault"]

_KEYS = ("fault_rank", "fault_save_rate", "fault_load_rate", "fault_seed", "fault_control",
         "fault_counts")


class InjectedFault(RuntimeError):
    """A copy this module made fail (the connector logs the class name once per cause)."""


class _FailsAfter(Transfer):
    """A copy that wrote part of its pages (``inner``) and then failed: done once the part
    is done, with ``error``."""

    def __init__(self, inner: Transfer, nbytes: int, error: BaseException) -> None:
        super().__init__(nbytes)
        self._inner = inner
        self._error = error

    def _settle(self) -> None:
        if not self._finished.is_set():
            self.seconds = self._inner.seconds
            self._finish(self._error)

    def done(self) -> bool:
        if self._inner.done():
            self._settle()
        return self._finished.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        if self._inner.wait(timeout):
            self._settle()
        return self._finished.is_set()


class _Faults:
    """The rates, read again from the control file whenever it changed."""

    def __init__(self, options: Dict[str, Any], rank: int) -> None:
        self.rank = rank
        self.save_rate = float(options.get("fault_save_rate", 0.0))
        self.load_rate = float(options.get("fault_load_rate", 0.0))
        self.async_saves: Optional[bool] = None
        self.kill_mid_save: Optional[Dict[str, int]] = None
        self.control = options.get("fault_control")
        self.counts_path = options.get("fault_counts")
        self.seed = options.get("fault_seed", 0)
        self.reseed()
        self.counts = {"saves": 0, "save_faults": 0, "saves_failed_late": 0,
                       "loads": 0, "load_faults": 0, "loads_failed_late": 0}
        self._stamp: Optional[int] = None
        # The step's loads (req_id, pages, blocks), to name the requests a fault hits.
        self.step_loads: List[Tuple[str, List[int], List[int]]] = []

    def reseed(self) -> None:
        # One stream for saves, one for loads: how a step's saves and loads interleave
        # does not change which of them fail.
        self.save_rng = random.Random(f"{self.seed}/{self.rank}/save")
        self.load_rng = random.Random(f"{self.seed}/{self.rank}/load")

    def refresh(self) -> None:
        if not self.control:
            return
        try:
            stamp = os.stat(self.control).st_mtime_ns
        except FileNotFoundError:
            return
        if stamp == self._stamp:
            return
        with open(self.control) as f:
            values = json.load(f)
        self._stamp = stamp
        if "seed" in values and values["seed"] != self.seed:
            # A phase of its own seed: its faults do not depend on what ran before it.
            self.seed = values["seed"]
            self.reseed()
        self.save_rate = float(values.get("save_rate", self.save_rate))
        self.load_rate = float(values.get("load_rate", self.load_rate))
        if "async_saves" in values:
            self.async_saves = bool(values["async_saves"])
        self.kill_mid_save = values.get("kill_mid_save")

    def loads_missed(self, done: int) -> List[str]:
        """The requests of the step's loads whose pages lie past the first ``done``."""
        missed, start = [], 0
        for req_id, pages, _ in self.step_loads:
            if start + len(pages) > done:
                missed.append(req_id)
            start += len(pages)
        return missed

    def trace(self, text: str) -> None:
        """One line of PATH.rank<R>.trace: what failed, and each step's copies, so that a
        wrong page found later can be followed back to the fault beneath it."""
        if self.counts_path:
            with open(f"{self.counts_path}.rank{self.rank}.trace", "a") as f:
                f.write(text + "\n")

    def count(self, key: str) -> None:
        self.counts[key] += 1
        if self.counts_path:
            # Written whole each time, then renamed: a reader never sees half a file.
            path = f"{self.counts_path}.rank{self.rank}"
            with open(path + ".tmp", "w") as f:
                json.dump(self.counts, f)
            os.replace(path + ".tmp", path)


class _FaultyCopies:
    """A CopyEngine whose saves and loads fail at the faults' rates; the rest delegates."""

    def __init__(self, engine: Any, faults: _Faults, cache: Any) -> None:
        self._engine = engine
        self._faults = faults
        self._cache = cache

    def _kill_if_due(self) -> None:
        """kill -9 of this rank, its save just submitted, once the armed point is reached."""
        armed = self._faults.kill_mid_save
        if not armed:
            return
        stats = self._cache.stats()
        if (stats.cached_pages > armed["cached_pages_above"]
                and stats.active_sequences >= armed["sequences"]):
            self._faults.trace("kill -9 mid-save")
            os.kill(os.getpid(), signal.SIGKILL)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @staticmethod
    def _written_part(rng: random.Random, n: int) -> int:
        """How many of a failing copy's n pages it wrote first: none, or a prefix."""
        return rng.choice([0, rng.randrange(n + 1)])

    @staticmethod
    def _head(blocks: Sequence[Any], parts: Tuple[Any, ...], done: int) -> Tuple[Any, ...]:
        """The first ``done`` pages' blocks (each group's, for GroupCopies) and parts."""
        if blocks and isinstance(blocks[0], (list, tuple)):
            head = [list(group[:done]) for group in blocks]
        else:
            head = list(blocks[:done])
        return (head,) + tuple(list(p[:done]) for p in parts)

    def submit_save(self, blocks: Sequence[Any], pages: Sequence[int],
                    *parts: Sequence[int]) -> Transfer:
        faults = self._faults
        if not blocks:
            return self._engine.submit_save(blocks, pages, *parts)
        faults.count("saves")
        if faults.save_rng.random() >= faults.save_rate:
            transfer = self._engine.submit_save(blocks, pages, *parts)
            self._kill_if_due()
            return transfer
        faults.count("save_faults")
        if faults.save_rng.random() < 0.5:
            faults.trace(f"save fails at submit: blocks {list(blocks)}")
            raise InjectedFault(f"save of {len(pages)} pages failed at submit")
        faults.count("saves_failed_late")
        done = self._written_part(faults.save_rng, len(pages))
        faults.trace(f"save fails late: blocks {list(blocks[done:])} not saved")
        # Queued behind the step's other copies like a real one: the error shows only when
        # the copy thread gets to it.
        head, *head_parts = self._head(blocks, parts, done)
        inner = self._engine.submit_save(head, list(pages[:done]), *head_parts)
        return _FailsAfter(inner, len(pages) * self._engine.bytes_per_page,
                           InjectedFault(f"save failed after {done} of {len(pages)} pages"))

    def submit_load(self, pages: Sequence[int], blocks: Sequence[Any],
                    *parts: Sequence[int]) -> Transfer:
        faults = self._faults
        if not pages:
            return self._engine.submit_load(pages, blocks, *parts)
        faults.count("loads")
        if faults.load_rng.random() >= faults.load_rate:
            return self._engine.submit_load(pages, blocks, *parts)
        faults.count("load_faults")
        if faults.load_rng.random() < 0.5:
            faults.trace(f"load fails at submit: blocks {list(blocks)}, requests "
                         f"{faults.loads_missed(0)}")
            raise InjectedFault(f"load of {len(pages)} pages failed at submit")
        faults.count("loads_failed_late")
        done = self._written_part(faults.load_rng, len(pages))
        faults.trace(f"load fails late: blocks {list(blocks[done:])} not loaded, requests "
                     f"{faults.loads_missed(done)}")
        head, *head_parts = self._head(blocks, parts, done)
        inner = self._engine.submit_load(list(pages[:done]), head, *head_parts)
        return _FailsAfter(inner, len(pages) * self._engine.bytes_per_page,
                           InjectedFault(f"load failed after {done} of {len(pages)} pages"))


class FaultyHostKVConnector(HostKVConnector):
    """HostKVConnector with the fault_* keys of the module docstring."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        options = {key: extra.pop(key) for key in _KEYS if key in extra}
        # The product's settings refuse keys they do not know: they see the rest, and the
        # config is left as it was for whoever reads it next in this process.
        original = transfer.kv_connector_extra_config
        transfer.kv_connector_extra_config = extra
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            transfer.kv_connector_extra_config = original
        self._fault_rank = int(options.get("fault_rank", 1))
        rank = self._worker.rank if self._worker is not None else -1
        self._faults = _Faults(options, rank)

    def _switch(self) -> None:
        """Reads the control file; applies a switch of async_saves to this side."""
        self._faults.refresh()
        wanted = self._faults.async_saves
        if wanted is None:
            return
        if self._sched is not None and self._sched.settings.async_saves != wanted:
            self._sched.settings = dataclasses.replace(self._sched.settings,
                                                       async_saves=wanted)
            self._settings = self._sched.settings
        if self._worker is not None and self._worker.async_saves != wanted:
            # Nothing of the old mode may still be in flight under the new one.
            self._worker.drain()
            self._worker.async_saves = wanted

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        if self._worker is not None and self._worker.rank == self._fault_rank:
            self._worker.engine = _FaultyCopies(self._worker.engine, self._faults,
                                                self._worker.cache)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._switch()
        faults = self._faults
        faults.step_loads = []
        if (self._worker is not None and self._worker.rank == self._fault_rank
                and self.has_connector_metadata()):
            meta = self._get_connector_metadata()
            faults.step_loads = list(getattr(meta, "loads", []))
            if meta.loads or meta.saves:
                faults.trace(f"step {meta.step}: loads "
                             f"{[(r, list(b)) for r, _, b in meta.loads]}, saves "
                             f"{[(r, list(b)) for r, b, _ in meta.saves]}")
        super().start_load_kv(forward_context, **kwargs)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        self._switch()
        return super().build_connector_meta(scheduler_output)
