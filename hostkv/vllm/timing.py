"""Where a served request's time goes in the connector: seconds per phase, counted.

Every call vLLM makes into the connector on the serving path runs inside an engine step,
so its time is time a request waits for its first token. The connector counts that time by
phase (the counters below, in ``get_kv_connector_stats`` and on ``/metrics`` as
``vllm:hostkv_<phase>_total``), so that an operator can set it against vLLM's own time to
first token (``vllm:time_to_first_token_seconds``): the connector's share of a request's
TTFT is about ``connector_s / lookups`` over the mean TTFT.

Scheduler side (vLLM's engine-core process; each phase includes its lock wait, which is
also counted alone as ``lock_wait_s``):

- ``lookup_s``: ``get_num_new_matched_tokens``, the lookup of a prompt (per request);
- ``borrow_s``: ``update_state_after_alloc``, the borrow of the hit and the reservation of
  pages for the rest (per request);
- ``plan_s``: ``build_connector_meta``, the step's loads and saves (per step);
- ``commit_s``: ``update_connector_output``, commits of confirmed saves and releases
  (per step);
- ``finish_s``: ``request_finished`` (per request).

Worker side (each worker process, the whole call, copies included; ``load_s`` and
``save_s`` count the copies alone):

- ``load_call_s``: ``start_load_kv``, before the forward;
- ``save_call_s``: ``wait_for_save``, after it (on a CPU, by default, the copies of the
  step's saves; with ``async_saves`` their submission);
- ``worker_wait_s``: waiting for saves in flight (``handle_preemptions``) and polling
  finished ones (``get_finished``, ``build_connector_worker_meta``).

``connector_s`` is the sum of the phases (the lock waits and copies are inside them, so
they are not added again). A call that fails open is counted like one that succeeds: its
time was spent all the same.
"""

from __future__ import annotations

import time
from typing import Any, Dict

__all__ = ["DESCRIPTIONS", "PHASES", "SCHEDULER_PHASES", "TIMING_COUNTERS", "WORKER_PHASES", "PhaseClock"]

# The connector's serving-path calls, by the name the facade gives them, and the counter
# of seconds each one adds to.
SCHEDULER_PHASES: Dict[str, str] = {
    "lookup": "lookup_s",
    "update_state_after_alloc": "borrow_s",
    "build_connector_meta": "plan_s",
    "update_connector_output": "commit_s",
    "request_finished": "finish_s",
}
WORKER_PHASES: Dict[str, str] = {
    "start_load_kv": "load_call_s",
    "wait_for_save": "save_call_s",
    "handle_preemptions": "worker_wait_s",
    "get_finished": "worker_wait_s",
    "build_connector_worker_meta": "worker_wait_s",
}
PHASES: Dict[str, str] = {**SCHEDULER_PHASES, **WORKER_PHASES}
# Every counter this module adds to, in a stable order (hostkv.vllm.metrics.COUNTERS
# holds them too).
TIMING_COUNTERS = ("connector_s", "lookup_s", "borrow_s", "plan_s", "commit_s", "finish_s",
                   "lock_wait_s", "load_call_s", "save_call_s", "worker_wait_s")

DESCRIPTIONS = {
    "connector_s": "Seconds the engine spent in hostkv's connector calls on the serving "
                   "path (every phase below)",
    "lookup_s": "Seconds looking requests up (get_num_new_matched_tokens)",
    "borrow_s": "Seconds borrowing hits and reserving pages (update_state_after_alloc)",
    "plan_s": "Seconds planning each step's loads and saves (build_connector_meta)",
    "commit_s": "Seconds committing confirmed saves and releasing requests "
                "(update_connector_output)",
    "finish_s": "Seconds in request_finished",
    "lock_wait_s": "Seconds scheduler-side calls waited for the connector's lock",
    "load_call_s": "Seconds workers spent in start_load_kv (loads, before the forward)",
    "save_call_s": "Seconds workers spent in wait_for_save (saves, after the forward)",
    "worker_wait_s": "Seconds workers waited for saves in flight or polled finished ones",
}


class PhaseClock:
    """Adds each timed call's seconds to its phase's counter and to ``connector_s``.

    One per connector (the counters object is the connector's own, so nothing is shared
    between processes or engines)."""

    __slots__ = ("_add",)

    def __init__(self, counters: Any) -> None:
        """counters: the connector's ``hostkv.vllm.metrics.Counters``."""
        self._add = counters.add

    @staticmethod
    def now() -> float:
        """The clock every phase is read on (monotonic, sub-microsecond)."""
        return time.perf_counter()

    def done(self, where: str, start: float) -> None:
        """The call named ``where`` (a key of PHASES; others are not timed) that began at
        ``start`` (:meth:`now`) is over."""
        key = PHASES.get(where)
        if key is not None:
            seconds = time.perf_counter() - start
            self._add(key, seconds)
            self._add("connector_s", seconds)

    def waited(self, start: float) -> None:
        """A lock wait that began at ``start`` is over (counted inside its phase too)."""
        self._add("lock_wait_s", time.perf_counter() - start)
