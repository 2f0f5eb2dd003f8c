"""hostkv.vllm.window: which pages of a hit need their window part, against vLLM's rules, and
the longest hit whose needed pages all have one."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("torch")

import hostkv  # noqa: E402
from lib.vllm_helpers import vllm_module  # noqa: E402

P = 16


def _kv(*windowed):
    """An engine of page size P with the windowed groups given as (kind, span) beside a
    full-attention group."""
    vllm_module()
    from hostkv.copy_engine import VLLM
    from hostkv.vllm.layout import EngineKV, KVGroup

    groups = [KVGroup(kind, (i,), span if kind == "sliding_window" else None,
                      None, span if kind == "chunked_local" else None)
              for i, (kind, span) in enumerate(windowed)]
    groups.append(KVGroup("full", (len(windowed),)))
    layout = hostkv.KVLayout(len(groups), 1, 8, "float32",
                             window_layers=tuple(range(len(windowed))))
    return EngineKV(layout, P, tuple(f"model.layers.{i}.attn" for i in range(len(groups))),
                    VLLM, 1, "test", tuple(groups))


def _kept_by_vllm(kind: str, span: int, pages: int) -> int:
    """The first block vLLM keeps for the next token after ``pages`` pages, by its own
    managers' ``get_num_skipped_tokens`` (called on a stand-in for the manager's state)."""
    from types import SimpleNamespace

    from vllm.v1.core.single_type_kv_cache_manager import (ChunkedLocalAttentionManager,
                                                           SlidingWindowManager)

    if kind == "sliding_window":
        skipped = SlidingWindowManager.get_num_skipped_tokens(
            SimpleNamespace(sliding_window=span, extra_retained_tokens=0), pages * P)
    else:
        skipped = ChunkedLocalAttentionManager.get_num_skipped_tokens(
            SimpleNamespace(attention_chunk_size=span), pages * P)
    return skipped // P


@pytest.mark.parametrize("kind,span", [("sliding_window", 1), ("sliding_window", 16),
                                       ("sliding_window", 17), ("sliding_window", 40),
                                       ("sliding_window", 1024), ("chunked_local", 32),
                                       ("chunked_local", 64)])
def test_the_first_needed_page_is_the_first_block_vllm_keeps(kind, span):
    first_needed_page = vllm_module().window.first_needed_page
    kv = _kv((kind, span))
    for pages in range(0, 200):
        assert first_needed_page(kv, pages) == min(pages, _kept_by_vllm(kind, span, pages)), \
            pages


def test_two_windowed_groups_need_the_union_of_their_spans():
    first_needed_page = vllm_module().window.first_needed_page
    kv = _kv(("sliding_window", 40), ("chunked_local", 64))
    for pages in range(0, 50):
        assert first_needed_page(kv, pages) == min(
            _kept_by_vllm("sliding_window", 40, pages), _kept_by_vllm("chunked_local", 64, pages))


def test_the_hit_is_the_longest_whose_needed_pages_have_parts():
    """Against a brute force over random part maps: the longest hit beyond vLLM's own whose
    pages from max(local, first needed) on all have parts, else 0."""
    window = vllm_module().window
    rng = random.Random(5)
    for kv in (_kv(("sliding_window", 40)), _kv(("chunked_local", 64)),
               _kv(("sliding_window", 17), ("chunked_local", 32))):
        for _ in range(400):
            n = rng.randrange(0, 30)
            parts = [rng.choice([-1, 0, 1, 2]) if rng.random() < 0.6 else -1
                     for _ in range(n)]
            local = rng.randrange(0, n + 2)
            want = next((k for k in range(n, local, -1)
                         if all(q >= 0 for q in parts[max(local, window.first_needed_page(
                             kv, k)):k])), 0)
            assert window.window_hit(kv, parts, local) == want, (parts, local)
    kv = _kv(("sliding_window", 40))       # needs the last 3 pages
    assert window.window_hit(kv, [-1, -1, 5, 6, 7], 0) == 5
    assert window.window_hit(kv, [-1, -1, 5, 6, -1], 0) == 0
    assert window.window_hit(kv, [-1, 3, 5, 6, -1], 0) == 4
    # vLLM's own hit covers the partless pages: they are not loaded.
    assert window.window_hit(kv, [-1, -1, -1, -1, 7], 4) == 5
    assert window.window_hit(kv, [-1, -1, -1, -1, -1], 2) == 0


def test_tokens_vllm_retains_behind_the_window_need_their_parts():
    """A sliding window with ``extra_retained_tokens`` (vLLM keeps their blocks for
    speculative decoding): the pages of those tokens need parts too, by vLLM's rule."""
    from types import SimpleNamespace

    import dataclasses

    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    window = vllm_module().window
    kv = _kv(("sliding_window", 40))
    kv = dataclasses.replace(kv, groups=(dataclasses.replace(kv.groups[0], extra_retained=20),
                                         kv.groups[1]))
    for pages in range(0, 60):
        skipped = SlidingWindowManager.get_num_skipped_tokens(
            SimpleNamespace(sliding_window=40, extra_retained_tokens=20), pages * P)
        assert window.first_needed_page(kv, pages) == min(pages, skipped // P), pages
