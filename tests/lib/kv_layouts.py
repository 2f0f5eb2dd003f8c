"""Engine KV tensors of each block layout, built from one canonical reference.

The reference is, per layer, ``[blocks, kv, tokens, heads, dim]`` (kv: 2 planes K|V, or 1
for MLA's latent). Each builder lays one layer out by that layout's own axis order, written
out here independently of the copy engine's parser, so that the tests of the CPU and GPU
paths compare the engine's pages with bytes they did not derive from the engine.
"""

from __future__ import annotations

import pytest
import torch

import hostkv

LAYERS, HEADS, DIM, TOKENS, BLOCKS, PAGES = 3, 4, 8, 16, 12, 10


def reference_kv(layers=LAYERS, kv=2, heads=HEADS, dim=DIM, dtype=torch.float32, seed=0):
    """Per layer, the KV of every block, canonically: [layers][blocks, kv, tokens, heads, dim]."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, kv, TOKENS, heads, dim, generator=g).to(dtype)
            for _ in range(layers)]


def as_vllm(ref):          # [B, H, T, (kv D)]
    """vLLM's logical per-layer view, contiguous."""
    b, kv, t, h, d = ref.shape
    return ref.permute(0, 3, 2, 1, 4).reshape(b, h, t, kv * d).contiguous()


def as_vllm_nhd_memory(ref):   # logical [B, H, T, (kv D)], memory [B, T, H, (kv D)]
    """vLLM's logical view over a buffer stored tokens-major (its NHD KV-cache layout)."""
    b, kv, t, h, d = ref.shape
    return ref.permute(0, 2, 3, 1, 4).reshape(b, t, h, kv * d).contiguous().permute(0, 2, 1, 3)


def as_flash_attn(ref):    # [2, B, T, H, D]
    """flash-attention's [2, blocks, tokens, heads, dim]."""
    return ref.permute(1, 0, 2, 3, 4).contiguous()


def as_flashinfer_nhd(ref):   # [B, 2, T, H, D]
    """FlashInfer's NHD [blocks, 2, tokens, heads, dim]."""
    return ref.contiguous()


def as_flashinfer_hnd(ref):   # [B, 2, H, T, D]
    """FlashInfer's HND [blocks, 2, heads, tokens, dim]."""
    return ref.permute(0, 1, 3, 2, 4).contiguous()


def as_vllm_mla(ref):      # [B, 1, T, latent]
    """vLLM's MLA view (a reference with kv=1, heads=1)."""
    return ref[:, 0].permute(0, 2, 1, 3).contiguous()


@pytest.fixture
def make_cache(new_name):
    """A factory of segments for a KV layout (``PAGES`` pages of ``TOKENS`` tokens unless
    told), each closed and unlinked after the test."""
    caches = []

    def make(layout, num_pages=PAGES, num_parts=0):
        cfg = hostkv.HostKVConfig(num_pages=num_pages, page_size=TOKENS, kv_layout=layout,
                                  num_parts=num_parts)
        cache = hostkv.HostKVCache.create(new_name(), cfg.apply_runtime_defaults())
        caches.append(cache)
        return cache

    yield make
    for cache in caches:
        cache.close()
        cache.unlink()
