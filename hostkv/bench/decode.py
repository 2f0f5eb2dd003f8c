"""The decode section: append_tokens per sequence per step at batch 1 to 128."""

from __future__ import annotations

import time
from typing import Any, Dict, List

import numpy as np

from hostkv.bench.common import _create, _destroy
from hostkv.bench.workloads import PAGE_SIZE, VOCAB
from hostkv.worker_view import SequenceRequest, WorkerView

DECODE_BATCHES = (1, 8, 32, 128)


def decode_steps(quick: bool, seed: int) -> List[Dict[str, Any]]:
    """append_tokens through a WorkerView: one decode step of a batch of sequences per call
    (a 100-token prompt each; a page is taken every PAGE_SIZE steps), ns per sequence per
    step at each batch size, beside the least an engine's own bookkeeping costs (a Python
    list.append per sequence per step), timed alternately in the same process."""
    steps = 64 if quick else 512
    rng = np.random.default_rng(seed)
    rows = []
    for batch in DECODE_BATCHES:
        cache = _create(batch * (steps // PAGE_SIZE + 10) + 64, batch)
        try:
            view = WorkerView(cache)
            step_tokens = rng.integers(0, VOCAB, (steps, batch)).tolist()
            best = {"view": float("inf"), "list": float("inf")}
            for rep in range(3):
                seq_ids = list(range(rep * batch, (rep + 1) * batch))
                view.allocate_pages_for_sequences_with_prefix(
                    [SequenceRequest(s, rng.integers(0, VOCAB, 100).tolist()) for s in seq_ids])
                start = time.perf_counter()
                for tokens in step_tokens:
                    view.append_tokens(seq_ids, tokens)
                best["view"] = min(best["view"], time.perf_counter() - start)
                view.release(seq_ids, commit=False)
                histories: List[List[int]] = [[] for _ in range(batch)]
                start = time.perf_counter()
                for tokens in step_tokens:
                    for history, token in zip(histories, tokens):
                        history.append(token)
                best["list"] = min(best["list"], time.perf_counter() - start)
            view.close()
        finally:
            _destroy(cache)
        view_ns = best["view"] / (steps * batch) * 1e9
        list_ns = best["list"] / (steps * batch) * 1e9
        rows.append({"batch": batch, "steps": steps, "ns_per_sequence_step": view_ns,
                     "list_append_ns": list_ns, "vs_list_append": view_ns / list_ns})
    return rows
