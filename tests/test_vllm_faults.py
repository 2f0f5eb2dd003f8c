"""Real vLLM engines under faults: what a faulty engine leaves in the segment is never wrong.

The connector's promise: a page is committed only if every tensor-parallel rank wrote every
byte of it from KV computed on verified inputs. Here a TP=2 engine ("faulty") runs
asynchronous scheduling (vLLM 0.32's default with the mp executor: a step is planned before
the previous one's results and the workers' reports are in) and chunked prefill with a
budget of two blocks a step, so every prompt spans several steps and its saves several
reports; its rank 1's copies fail at random through workers/faulty_connector.py (at submit,
or late, after writing none or part of their pages). Phases, on the same two engines:

1. rank 1's saves fail, ``async_saves`` on (a step's saves finish beside the next steps);
2. the same with ``async_saves`` off (saves over within their step);
3. rank 1's loads fail, on a segment warmed by the clean engine;
4. another thread evicts hard while the faulty engine loads and saves (its saves failing).

After each, a clean engine (plain hostkv connector, TP=1) serves the same requests from the
segment, then again under a cache salt of its own (no block shared with anything cached:
computed from scratch). The two must be the same tokens: a page whose KV is not its tokens'
shows up as other tokens (before the connector froze a request at its first failed step,
phase 1 committed pages rank 1 never wrote, and 4 of its 9 prompts came out otherwise, each
from its second to fifth token on). ``python -m hostkv check`` must pass too. Where the
faulty engine's own tokens are sure to rest on verified KV (not in phase 3, see there) they
must equal the clean engine's recomputed ones.

Greedy float32 decoding of a tiny random Llama; short generations keep a near-tie (CPU
kernels are not batch-invariant, and the two engines run different TP degrees) from
flipping a late token. The engines start once for the module (~30-90 s each on the CI
machine): the fault rates and ``async_saves`` switch at run time through a control file the
faulty connector reads at every step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from typing import Dict, List, Optional, Sequence

import pytest

import hostkv
from conftest import unlink_quietly
from lib.vllm_engine import (BLOCK_SIZE, Engine, stop_engines, unlink_vllm_shm, vllm_shm,
                             write_model)
from lib.vllm_helpers import random_tokens

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: ./scripts/test.sh installs it (see README)",
                allow_module_level=True)

MAX_TOKENS = 10
FAULTY = ("FaultyHostKVConnector", "workers.faulty_connector")


def _family_prompts(rng: random.Random, families: int = 3,
                    per_family: int = 3) -> List[List[int]]:
    """Prompts that share prefixes: each family's prompts start with the same two blocks,
    then go their own ways (4 to 7 blocks in all, several steps of two blocks each)."""
    prompts = []
    for _ in range(families):
        header = random_tokens(rng, 2 * BLOCK_SIZE)
        for _ in range(per_family):
            prompts.append(header + random_tokens(rng, rng.randrange(60, 160)))
    return prompts


def _next_turns(rng: random.Random, prompts: Sequence[Sequence[int]],
                outputs: Sequence[Sequence[int]]) -> List[List[int]]:
    """Each conversation's next turn: its history, then new user tokens."""
    return [list(p) + list(o) + random_tokens(rng, rng.randrange(30, 70))
            for p, o in zip(prompts, outputs)]


def _own(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> List[int]:
    """Tokens of KV that serving prompts left in an engine's own prefix cache: the prompt
    and its generated tokens but the last (whose KV is never computed), whole blocks."""
    return [(len(p) + len(o) - 1) // BLOCK_SIZE * BLOCK_SIZE for p, o in zip(prompts, outputs)]


def _shared_before(prompts: Sequence[Sequence[int]], i: int) -> int:
    """The longest prefix, in whole blocks, that prompt i shares with an earlier one."""
    best = 0
    for other in prompts[:i]:
        n = 0
        for a, b in zip(prompts[i], other):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best // BLOCK_SIZE * BLOCK_SIZE


def _first_differences(got: Sequence[Sequence[int]],
                       want: Sequence[Sequence[int]]) -> Dict[int, int]:
    """prompt -> the first generated token that differs (a near-tie flips a late one;
    wrong KV the first ones)."""
    return {i: next(k for k, (a, b) in enumerate(zip(g, w)) if a != b)
            for i, (g, w) in enumerate(zip(got, want)) if g != w}


def _trace(world: Dict) -> str:
    try:
        with open(world["counts"] + ".trace") as f:
            return f.read()[-6000:]
    except FileNotFoundError:
        return ""


def _differing(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]) -> List[int]:
    return [i for i, (g, w) in enumerate(zip(got, want)) if g != w]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The faulty TP=2 engine and the clean TP=1 one on a fresh segment (its name unique,
    as the segment_name fixture makes them, for a module of tests), started at once; both
    stopped, the segment and vLLM's leftovers unlinked after the module."""
    root = tmp_path_factory.mktemp("faults")
    model = write_model(str(root / "model"), num_layers=2, num_kv_heads=2, seed=3)
    segment = f"hostkv-test-{os.getpid()}-{uuid.uuid4().hex[:12]}-faults"
    control = str(root / "faults.json")
    counts = str(root / "faults-injected")
    with open(control, "w") as f:
        json.dump({"save_rate": 0.0, "load_rate": 0.0, "async_saves": True}, f)
    # Copies finish beside the next steps on a copy thread (the path a GPU takes); phase 2
    # switches that off.
    faulty_extra = {"segment": segment, "size": "64MiB", "async_saves": True,
                    "fault_rank": 1, "fault_seed": 7, "fault_control": control,
                    "fault_counts": counts}
    clean_extra = {"segment": segment, "size": "64MiB"}
    # Two blocks a step: a prompt of 4-7 blocks is prefilled over several steps, and a
    # batch's requests share steps.
    steps = {"async_scheduling": True, "enable_chunked_prefill": True,
             "max_num_batched_tokens": 2 * BLOCK_SIZE, "max_num_seqs": 16}
    shm_before = vllm_shm()
    started: List[Engine] = []
    try:
        faulty = Engine(model, faulty_extra, str(root / "faulty.log"), tp=2, connector=FAULTY,
                        disable_log_stats=False, **steps)
        started.append(faulty)
        clean = Engine(model, clean_extra, str(root / "clean.log"), **steps)
        started.append(clean)
        faulty.ready()
        clean.ready()
        yield {"faulty": faulty, "clean": clean, "segment": segment, "control": control,
               "counts": counts + ".rank1", "rng": random.Random(11)}
    finally:
        stop_engines(started)
        unlink_quietly(segment)
        unlink_vllm_shm(shm_before)


def _set_faults(world: Dict, save_rate: float = 0.0, load_rate: float = 0.0,
                async_saves: bool = True, seed: str = "") -> None:
    """Rewrites the control file (the engines are idle: a batch runs under one setting);
    seed: a phase's own, so that its faults are the same run alone or after others."""
    path = world["control"]
    with open(path + ".tmp", "w") as f:
        json.dump({"save_rate": save_rate, "load_rate": load_rate,
                   "async_saves": async_saves, "seed": seed}, f)
    os.replace(path + ".tmp", path)


def _injected(world: Dict) -> Dict[str, int]:
    try:
        with open(world["counts"]) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def _check_segment(segment: str) -> None:
    """`python -m hostkv check NAME`, as an operator runs it."""
    proc = subprocess.run([sys.executable, "-m", "hostkv", "check", segment],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _clean_reads(world: Dict, prompts: List[List[int]], salt: str,
                 local: Optional[Sequence[int]] = None,
                 must_hit: bool = True) -> List[List[int]]:
    """The clean engine serves prompts from the segment, then computes them from scratch
    (under a salt): the tokens must be the same. local: the tokens of each prompt in the
    clean engine's own prefix cache (what it computed itself), beyond which its hits came
    from the segment; must_hit: at least one did. Returns the recomputed tokens."""
    clean = world["clean"]
    hit, cached, _ = clean.generate(prompts, MAX_TOKENS)
    cold, cold_cached, _ = clean.generate(prompts, MAX_TOKENS, salts=[salt] * len(prompts))
    # Under the salt nothing cached before is shared: only what an earlier prompt of the
    # same batch computed (a family's first blocks).
    assert all(c <= _shared_before(prompts, i) for i, c in enumerate(cold_cached)), cold_cached
    bad = _differing(hit, cold)
    assert not bad, (
        f"{len(bad)} of {len(prompts)} prompts served from the segment differ from their "
        f"recompute (prompt: first token that differs {_first_differences(hit, cold)}; "
        f"cached tokens {cached}; faults {_injected(world)}); the faulty rank's trace:\n"
        + _trace(world))
    local = list(local) if local is not None else [0] * len(prompts)
    from_segment = [max(0, c - n) for c, n in zip(cached, local)]
    if must_hit:
        # Not vacuous: the clean engine did read what the faulty one left.
        assert sum(from_segment) > 0, f"nothing came from the segment ({cached}, {local})"
    return cold


def _save_faults(world: Dict, async_saves: bool, salt: str) -> None:
    faulty = world["faulty"]
    prompts = _family_prompts(world["rng"])
    before = _injected(world)
    _set_faults(world, save_rate=0.5, async_saves=async_saves, seed=salt)
    outs, _, _ = faulty.generate(prompts, MAX_TOKENS)
    _set_faults(world)
    after = _injected(world)
    assert after.get("save_faults", 0) > before.get("save_faults", 0), (before, after)
    expected = _clean_reads(world, prompts, salt)
    # Failed saves never change what the faulty engine computes.
    assert outs == expected, _first_differences(outs, expected)
    _check_segment(world["segment"])


def test_rank_saves_fail_with_async_saves(engines):
    """Rank 1's saves fail at random, finishing a step or more later: no page of a request
    past a failed save is committed, though its next steps were planned (and confirmed by
    every rank) before the failure was known."""
    _save_faults(engines, async_saves=True, salt="recompute-async")


def test_rank_saves_fail_with_saves_in_the_step(engines):
    """The same with each step's saves over inside the step (a CPU's default)."""
    _save_faults(engines, async_saves=False, salt="recompute-sync")


def test_rank_loads_fail(engines):
    """The clean engine computes first turns into the segment; the faulty engine serves
    their next turns, loading those pages, while rank 1's loads fail at random. A load that
    fails at submit goes to vLLM as load errors (recomputed); one that fails late (after the
    forward read the blocks, as on a GPU) leaves KV of that rank that is not the tokens',
    and everything computed on top of it: none of it may be committed."""
    world = engines
    faulty, clean = world["faulty"], world["clean"]
    rng = world["rng"]
    first = _family_prompts(rng, families=4)
    first_outs, _, _ = clean.generate(first, MAX_TOKENS)
    nexts = _next_turns(rng, first, first_outs)
    before_counts = faulty.metrics()
    before = _injected(world)
    _set_faults(world, load_rate=0.7, seed="loads")
    faulty.generate(nexts, MAX_TOKENS)
    _set_faults(world)
    after = _injected(world)
    gained = {k: v - before_counts.get(k, 0) for k, v in faulty.metrics().items()}
    assert after.get("load_faults", 0) > before.get("load_faults", 0), (before, after)
    assert gained.get("loaded_pages", 0) > 0, gained
    # The faulty engine's own tokens are not checked: a late load failure is known only
    # after the forward ran on the blocks (vLLM cannot be told), so they may be wrong; what
    # matters is that none of it reaches the segment. The clean engine holds the first
    # turns in its own prefix cache, so what it takes from the segment is the faulty
    # engine's saves.
    _clean_reads(world, nexts, "recompute-loads", local=_own(first, first_outs))
    _check_segment(world["segment"])


def test_hard_eviction_beside_failing_saves(engines):
    """Another process (this one: a thread with its own handle) evicts pages every few
    milliseconds while the faulty engine looks up, borrows and loads the clean engine's
    pages (a block evicted between lookup and borrow goes to vLLM as a load error, and is
    recomputed) and saves its own (rank 1's failing at random): the faulty engine's tokens
    are right, and what is left in the segment is too."""
    world = engines
    faulty, clean = world["faulty"], world["clean"]
    rng = world["rng"]
    first = _family_prompts(rng)
    first_outs, _, _ = clean.generate(first, MAX_TOKENS)
    nexts = _next_turns(rng, first, first_outs)
    stop = threading.Event()
    evicted = [0, 0]
    errors: List[BaseException] = []

    attached = threading.Event()

    def evict() -> None:
        try:
            with hostkv.HostKVCache.attach(world["segment"]) as cache:
                attached.set()
                evictor_rng = random.Random(5)
                # From the faulty engine's first allocation on (the clean engine is idle):
                # its first requests then surely borrow and load, and the later ones' lookups
                # race the evictions. Evicting from the start could leave nothing to load.
                # Its counter, not its live sequences: a sequence may come and go between
                # two looks. The count before is read before the engine starts: read here,
                # the engine may already have made every allocation of the batch, and the
                # evictor would wait for one that never comes.
                while not stop.is_set() and cache.stats().pages_allocated == allocated_before:
                    time.sleep(0.001)
                # At least one round, even if the batch was over before the evictor saw
                # its first allocation (a busy machine): the test asks that it evicted.
                while not stop.is_set() or evicted[1] == 0:
                    evicted[0] += cache.evict(evictor_rng.randrange(1, 5))
                    evicted[1] += 1
                    # The lock is let go between evictions, so the engines' lookups and
                    # borrows interleave with them.
                    time.sleep(0.002)
        except BaseException as exc:   # noqa: BLE001 - reported by the test
            errors.append(exc)
            attached.set()

    before = _injected(world)
    before_counts = faulty.metrics()
    with hostkv.HostKVCache.attach(world["segment"]) as cache:
        allocated_before = cache.stats().pages_allocated
    _set_faults(world, save_rate=0.5, seed="evictions")
    evictor = threading.Thread(target=evict, name="evictor")
    evictor.start()
    try:
        # Attached before the engine starts: on a busy machine the batch could otherwise
        # be over before the evictor had its handle.
        assert attached.wait(60)
        outs, _, _ = faulty.generate(nexts, MAX_TOKENS)
    finally:
        stop.set()
        evictor.join(60)
        _set_faults(world)
    assert not errors, errors
    assert evicted[0] > 0, evicted
    after = _injected(world)
    gained = {k: v - before_counts.get(k, 0) for k, v in faulty.metrics().items()}
    assert after.get("save_faults", 0) > before.get("save_faults", 0), (before, after)
    assert gained.get("loaded_pages", 0) > 0, (gained, evicted)
    # What survived the evictions may be nothing of the faulty engine's.
    expected = _clean_reads(world, nexts, "recompute-evicted", local=_own(first, first_outs),
                            must_hit=False)
    assert outs == expected, _first_differences(outs, expected)
    _check_segment(world["segment"])
