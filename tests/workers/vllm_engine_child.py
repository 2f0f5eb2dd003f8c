"""The child side of tests/lib/vllm_engine.py: what runs in the spawned processes.

vLLM starts its own processes with spawn, so an engine cannot live in the pytest process (nor
in a forked child): lib.vllm_engine.Engine spawns engine_main here, which makes itself a
process-group leader (so that a kill takes the engine's EngineCore process with it) and
serves generate calls over a pipe. save_model writes a tiny random-weight model, so that the
parent never imports transformers, in model_writer_main, one process that writes every model
of a test run; open_segment_at_once is one of several engines opening a
segment at the same moment. Nothing here imports pytest.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any, Dict, Optional, Tuple

BLOCK_SIZE = 32


def set_env() -> None:
    """What every engine process runs with: offline, a small KV cache of its own, quiet logs."""
    os.environ["HF_HUB_OFFLINE"] = "1"          # nothing is downloaded
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB of vLLM's own KV cache per engine
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def save_model(path: str, num_layers: int, num_kv_heads: int, seed: int, head_dim: int,
               kind: str) -> None:
    """write_model's child: builds the model with transformers and save_pretrained()s it."""
    set_env()
    import torch

    torch.manual_seed(seed)
    # Random weights, tiny: fast to start and to run. vLLM's CPU attention takes head_dim
    # 32 to 512 (not 16).
    common = dict(vocab_size=1000, num_hidden_layers=num_layers,
                  max_position_embeddings=4096, torch_dtype="float32")
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        heads = max(2, num_kv_heads)
        config = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=heads,
                             num_key_value_heads=num_kv_heads, head_dim=head_dim, **common)
        model = LlamaForCausalLM(config)
    elif kind == "deepseek_v2":
        # Dense MLA (no MoE layers): vLLM's CPU MLA backend takes only kv_lora_rank 512 with
        # qk_rope_head_dim 64, a latent of 576 per token.
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        config = DeepseekV2Config(hidden_size=128, intermediate_size=256,
                                  num_attention_heads=2, num_key_value_heads=2,
                                  kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                                  qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=num_layers,
                                  n_routed_experts=1, num_experts_per_tok=1, **common)
        model = DeepseekV2ForCausalLM(config)
    elif kind == "gemma3":
        # Sliding-window layers beside full-attention ones (a hybrid KV cache).
        from transformers import Gemma3TextConfig, Gemma3ForCausalLM

        config = Gemma3TextConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                  num_key_value_heads=num_kv_heads, head_dim=head_dim,
                                  sliding_window=64, sliding_window_pattern=2, **common)
        model = Gemma3ForCausalLM(config)
    elif kind == "gemma3_swa":
        # Every layer sliding-window (Gemma-3 below six layers, Mistral-7B-v0.1): one
        # KV-cache group whose blocks leave the window.
        from transformers import Gemma3TextConfig, Gemma3ForCausalLM

        config = Gemma3TextConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                  num_key_value_heads=num_kv_heads, head_dim=head_dim,
                                  sliding_window=64, **common)
        assert set(config.layer_types) == {"sliding_attention"}, config.layer_types
        model = Gemma3ForCausalLM(config)
    elif kind == "gemma3_5to1":
        # Gemma-3's own pattern: five sliding-window layers, then a full-attention one.
        from transformers import Gemma3TextConfig, Gemma3ForCausalLM

        config = Gemma3TextConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                  num_key_value_heads=num_kv_heads, head_dim=head_dim,
                                  sliding_window=64, sliding_window_pattern=6, **common)
        assert [t == "full_attention" for t in config.layer_types] == [
            i % 6 == 5 for i in range(num_layers)], config.layer_types
        model = Gemma3ForCausalLM(config)
    elif kind == "gpt_oss":
        # gpt-oss: sliding-window and full-attention layers alternating, with attention
        # sinks and a mixture of experts.
        from transformers import GptOssConfig, GptOssForCausalLM

        config = GptOssConfig(hidden_size=128, intermediate_size=128, num_attention_heads=2,
                              num_key_value_heads=num_kv_heads, head_dim=head_dim,
                              num_local_experts=2, num_experts_per_tok=1, sliding_window=64,
                              **common)
        model = GptOssForCausalLM(config)
    elif kind == "qwen3_next":
        # Gated DeltaNet (linear attention, a recurrent state) beside full attention. vLLM's
        # CPU kernel for it takes bfloat16 and a head dim of 64 or 128.
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(
            hidden_size=128, intermediate_size=256, num_attention_heads=2,
            num_key_value_heads=num_kv_heads, head_dim=head_dim, linear_num_value_heads=2,
            linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
            num_experts=2, num_experts_per_tok=1, moe_intermediate_size=64,
            # Three Gated DeltaNet layers of every four, as Qwen3-Next's checkpoints: vLLM
            # makes groups of equal size, so three state groups beside the attention one.
            shared_expert_intermediate_size=64, full_attention_interval=4,
            **{**common, "torch_dtype": "bfloat16"})
        model = Qwen3NextForCausalLM(config)
    elif kind == "lfm2":
        # LFM2: gated short convolutions (a recurrent conv state, vLLM's MambaSpec
        # SHORT_CONV) beside full attention. vLLM reads the config names of LFM2's own
        # checkpoints (block_dim, conv_dim), which transformers' config no longer has.
        from transformers import Lfm2Config, Lfm2ForCausalLM

        config = Lfm2Config(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                            num_key_value_heads=num_kv_heads,
                            layer_types=["conv" if i % 2 == 0 else "full_attention"
                                         for i in range(num_layers)],
                            # Larger weights, embeddings untied: with the defaults a random
                            # LFM2 repeats its last input token whatever the KV.
                            initializer_range=0.3, tie_word_embeddings=False, **common)
        config.block_dim = config.conv_dim = 128
        config.block_auto_adjust_ff_dim = False
        model = Lfm2ForCausalLM(config)
    elif kind == "granite_h":
        # Granite-4.0-H: Mamba-2 layers (vLLM's MambaSpec MAMBA2) beside full attention, as
        # Nemotron-H and Falcon-H1 have them. Two groups, so that each rank of TP=2 holds
        # one (Granite-4.0-H's checkpoints have one, which vLLM copies to every rank).
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        config = GraniteMoeHybridConfig(
            hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=num_kv_heads, tie_word_embeddings=False,
            layer_types=["mamba" if i % 2 == 0 else "attention" for i in range(num_layers)],
            mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=64,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256, num_local_experts=0,
            num_experts_per_tok=0, shared_intermediate_size=256,
            position_embedding_type="rope", **common)
        model = GraniteMoeHybridForCausalLM(config)
    elif kind == "nemotron_h":
        # Nemotron-H: Mamba-2, attention and MLP layers each a layer of their own; two
        # groups, one per rank at TP=2, as Granite-4.0-H's above.
        from transformers import NemotronHConfig, NemotronHForCausalLM

        types = ["mamba", "attention", "mlp"] * num_layers
        config = NemotronHConfig(
            hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=num_kv_heads, head_dim=32,
            layers_block_type=types[:num_layers + num_layers // 2],
            ssm_state_size=64, mamba_num_heads=8, mamba_head_dim=32, n_groups=2,
            conv_kernel=4, expand=2, chunk_size=256, vocab_size=1000,
            max_position_embeddings=4096, torch_dtype="float32")
        model = NemotronHForCausalLM(config)
    elif kind == "falcon_h1":
        # Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side. One
        # group, as its checkpoints have: vLLM copies it to every rank at TP=2.
        from transformers import FalconH1Config, FalconH1ForCausalLM

        config = FalconH1Config(
            hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=num_kv_heads, mamba_d_ssm=256, mamba_n_heads=8,
            mamba_d_head=32, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4,
            mamba_expand=2, mamba_chunk_size=256, **common)
        model = FalconH1ForCausalLM(config)
    elif kind == "lfm2_moe":
        # LFM2-MoE: LFM2's gated short convolutions beside full attention, experts after
        # the dense first layer. Every token goes to both experts: a random router's one
        # choice flips at a near-tie between engines that batch a step differently
        # (measured: an engine's 8th token differed from its own cached rerun's), which no
        # cache causes and which would hide what the tests check.
        from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

        config = Lfm2MoeConfig(hidden_size=128, intermediate_size=256,
                               moe_intermediate_size=64, num_attention_heads=2,
                               num_key_value_heads=num_kv_heads, num_experts=2,
                               num_experts_per_tok=2, num_dense_layers=1,
                               layer_types=["conv" if i % 2 == 0 else "full_attention"
                                            for i in range(num_layers)],
                               initializer_range=0.3, tie_word_embeddings=False, **common)
        model = Lfm2MoeForCausalLM(config)
    elif kind == "zamba2":
        # Zamba2: Mamba-2 layers, with a shared attention block before some of them. A
        # state size of 256 makes vLLM's block 256 tokens, as the other Mamba-2 models'
        # (vLLM 0.32 loads Zamba2's attention with as many KV heads as query heads only).
        from transformers import Zamba2Config, Zamba2ForCausalLM

        config = Zamba2Config(
            hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=4, n_mamba_heads=8, mamba_d_state=256,
            mamba_d_conv=4,
            mamba_expand=2, mamba_ngroups=2, chunk_size=256, num_mem_blocks=1,
            layers_block_type=["mamba" if i % 2 == 0 else "hybrid" for i in range(num_layers)],
            use_mem_rope=True, **common)
        model = Zamba2ForCausalLM(config)
    elif kind == "llama4":
        # Llama 4: three layers of every four attend within chunks of attention_chunk_size
        # tokens (vLLM's chunked-local attention), the fourth to every token (no RoPE).
        # One expert: its router has no choice to flip at a near-tie.
        from transformers import Llama4TextConfig, Llama4ForCausalLM

        config = Llama4TextConfig(hidden_size=128, intermediate_size=256,
                                  intermediate_size_mlp=256, num_attention_heads=2,
                                  num_key_value_heads=num_kv_heads, head_dim=head_dim,
                                  num_local_experts=1, num_experts_per_tok=1,
                                  interleave_moe_layer_step=1, attention_chunk_size=64,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, **common)
        model = Llama4ForCausalLM(config)
    else:
        raise ValueError(f"no such model kind {kind!r}")
    model.save_pretrained(path)


def save_adapter(path: str, num_layers: int, seed: int, rank: int = 8) -> None:
    """write_adapter's child: a LoRA adapter (PEFT's files) of random weights on the q and v
    projections of write_model's Llama, large enough to change every output."""
    set_env()
    import json

    import torch
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for layer in range(num_layers):
        for proj in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            # PEFT starts B at zero (an adapter that changes nothing): random both.
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, 128) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(128, rank) * 0.3
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
              "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
              "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
              "use_dora": False, "base_model_name_or_path": None}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def engine_main(conn: Any, model: str, extra: Optional[Dict[str, Any]], log_path: str,
                llm_kwargs: Dict[str, Any], env: Dict[str, str],
                connector: Tuple[str, str] = ("HostKVConnector", "hostkv.vllm")) -> None:
    """The engine process: starts LLM(model, ...) with the connector (extra: its
    kv_connector_extra_config; None: without it; connector: its class and module), writes
    its output to log_path, then serves Engine's messages on conn until "exit"."""
    os.setsid()                                  # the engine's processes form one group
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    set_env()
    try:
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig

        kwargs: Dict[str, Any] = {"max_model_len": 2048, **llm_kwargs}
        if extra is not None:
            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector=connector[0], kv_connector_module_path=connector[1],
                kv_role="kv_both", kv_connector_extra_config=extra)
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("block_size", BLOCK_SIZE)
        llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, seed=0,
                  **kwargs)
    except BaseException:                        # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        message = conn.recv()
        if message[0] == "exit":
            break
        if message[0] == "metrics":
            # hostkv's connector counters (an engine started with disable_log_stats=False).
            try:
                from hostkv.vllm.metrics import registry_counters

                conn.send(("ok", registry_counters()))
            except BaseException:                # noqa: BLE001 - reported to the parent
                conn.send(("error", traceback.format_exc()))
            continue
        if message[0] == "reset":
            # vLLM's reset of its prefix cache with the connector's (after new weights).
            try:
                conn.send(("ok", llm.reset_prefix_cache(reset_connector=True)))
            except BaseException:                # noqa: BLE001 - reported to the parent
                conn.send(("error", traceback.format_exc()))
            continue
        _, prompts, max_tokens, salts, loras = message
        try:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            inputs = []
            for tokens, salt in zip(prompts, salts):
                item: Dict[str, Any]
                if hasattr(tokens, "dtype"):
                    # A numpy array: the prompt's embeddings (an engine started with
                    # enable_prompt_embeds=True).
                    import torch

                    item = {"prompt_embeds": torch.from_numpy(tokens)}
                else:
                    item = {"prompt_token_ids": list(tokens)}
                if salt is not None:
                    item["cache_salt"] = salt
                inputs.append(item)
            lora_requests = None
            if loras is not None:
                from vllm.lora.request import LoRARequest

                lora_requests = [None if lora is None else LoRARequest(*lora)
                                 for lora in loras]
            start = time.perf_counter()
            outs = llm.generate(inputs, params, use_tqdm=False, lora_request=lora_requests)
            wall = time.perf_counter() - start
            conn.send(("ok", ([list(o.outputs[0].token_ids) for o in outs],
                              [int(o.num_cached_tokens or 0) for o in outs], wall)))
        except BaseException:                    # noqa: BLE001 - reported to the parent
            conn.send(("error", traceback.format_exc()))
    conn.send(("bye", None))
    del llm
    sys.stdout.flush()


def model_writer_main(conn: Any) -> None:
    """The process that writes every model and adapter of a test run (lib.vllm_engine's
    write_model and write_adapter): torch and transformers are imported once, not once a
    model (~6 s each, one core busy and the other idle). Each request is (function name,
    arguments), answered ("ok", None) or ("error", traceback); ends when the pipe closes.
    Each model is as a fresh process writes it: save_model and save_adapter seed torch
    themselves, and nothing else they use keeps state between models."""
    writers = {"save_model": save_model, "save_adapter": save_adapter}
    while True:
        try:
            name, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            writers[name](*args)
            conn.send(("ok", None))
        except BaseException:                    # noqa: BLE001 - reported to the parent
            conn.send(("error", traceback.format_exc()))


def open_segment_at_once(name: str, barrier: Any, results: Any, num_layers: int) -> None:
    """In a spawned child: hostkv.vllm.open_segment(name) once every child is ready, as
    engines starting together do; puts (pid, 'ok' | error text) on results."""
    import warnings

    warnings.simplefilter("ignore")
    import hostkv
    import hostkv.vllm as hv

    layout = hostkv.KVLayout(num_layers=num_layers, num_kv_heads=2, head_dim=64,
                             dtype="float32")
    settings = hv.HostKVSettings(segment=name, num_pages=64)
    barrier.wait(120)
    try:
        cache = hv.open_segment(settings, layout, BLOCK_SIZE)
    except Exception as exc:                     # noqa: BLE001 - reported to the parent
        results.put((os.getpid(), f"{type(exc).__name__}: {exc}"))
        return
    results.put((os.getpid(), "ok"))
    barrier.wait(120)                            # all attached at the same time
    cache.close()


def hf_config_texts(model: str, overrides: Any, results: Any) -> None:
    """In a spawned child: for each hf_overrides in ``overrides``, (the text of the HF config
    vLLM's ModelConfig loads, the text of hostkv's hf_config_as_loaded of that ModelConfig,
    and the latter again after the live config was changed as model code changes it) on
    results; an error text instead if anything raised."""
    set_env()
    import warnings

    warnings.simplefilter("ignore")
    try:
        from vllm.engine.arg_utils import EngineArgs

        from hostkv.vllm.identity import _hf_config_text, hf_config_as_loaded

        texts = []
        for hf_overrides in overrides:
            model_config = EngineArgs(model=model, hf_overrides=hf_overrides,
                                      skip_tokenizer_init=True).create_model_config()
            live = _hf_config_text(model_config.hf_config)
            loaded = _hf_config_text(hf_config_as_loaded(model_config))
            # What Llama 4's model code does to the live config where it builds the model.
            model_config.hf_config.attn_temperature_tuning = "set by model code"
            texts.append((live, loaded, _hf_config_text(hf_config_as_loaded(model_config))))
        results.put(texts)
    except BaseException:                        # noqa: BLE001 - reported to the parent
        results.put(traceback.format_exc())
