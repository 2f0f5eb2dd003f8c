"""Small pieces the hostkv.vllm tests share: the package imported quietly, random prompts,
and vLLM's own Request and KVCacheBlocks for driving the connector's halves without an
engine. vLLM is imported inside each function: a module that skips without vLLM can still
import this one."""

from __future__ import annotations

import random
import warnings
from typing import Any, List, Sequence

from lib.vllm_engine import BLOCK_SIZE


def random_tokens(rng: random.Random, n: int) -> List[int]:
    """n token ids in [1, 1000), the tiny test models' vocabulary."""
    return [rng.randrange(1, 1000) for _ in range(n)]


def vllm_module() -> Any:
    """hostkv.vllm, imported without the deprecation warnings torch and vLLM raise on import
    (pytest turns warnings into errors)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # torch/vllm deprecation warnings on import
        import hostkv.vllm as module
    return module


def vllm_request(req_id: str, tokens: Sequence[int]) -> Any:
    """A vllm.v1.request.Request for tokens, with the block hasher of BLOCK_SIZE-token
    blocks that vLLM's scheduler would give it."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(req_id, list(tokens), SamplingParams(max_tokens=4), None,
                   block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))


def vllm_blocks(ids: Sequence[int]) -> Any:
    """vLLM's KVCacheBlocks (one KV-cache group) of the block ids."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),))
