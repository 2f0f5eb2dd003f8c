"""Which pages of a hit need their window part, and the longest hit whose window is whole.

With window parts (``HostKVSettings.window_parts``) a sliding-window or chunked-local
group's layers live in the pages' parts, and a page may have lost its part to the part LRU
while its other layers stay cached (``hostkv.config.KVLayout.window_layers``). A hit of
``k`` pages is loaded into vLLM's blocks from the first block vLLM did not have (``j``, its
own prefix-cache hit) to ``k``, and a windowed group reads only the blocks vLLM keeps for
the span at the hit's end; those must come from parts. vLLM's rule for what it keeps:

- sliding window ``W``: the last ``cdiv(W - 1 + E, P)`` blocks before the next token
  (``SlidingWindowManager``: tokens before ``k*P - W + 1 - E`` are skipped; ``E``, its
  ``extra_retained_tokens``, is 0 without speculative decoding);
- chunked-local attention of chunk ``C``: the blocks of the current chunk, from
  ``(k*P // C) * C`` (``ChunkedLocalAttentionManager``); none where a chunk ends at ``k``.

The lookup walks a match back to the longest ``k`` whose needed pages all have parts
(:func:`window_hit`); it holds nothing, so the borrow checks again against the block table
vLLM gave (the blocks it will read: those that are not the null block) and fails the whole
load if a needed page lost its part in between (``hostkv.vllm.scheduler``).
"""

from __future__ import annotations

from typing import Sequence

from hostkv.vllm.layout import EngineKV

__all__ = ["first_needed_page", "window_hit"]


def first_needed_page(kv: EngineKV, pages: int) -> int:
    """The first of a hit of ``pages`` pages whose window part some windowed group reads
    (``pages``: none does)."""
    size = kv.page_size
    first = pages
    for g in kv.windowed_groups:
        group = kv.groups[g]
        if group.kind == "sliding_window":
            assert group.sliding_window is not None
            keep = -(-(group.sliding_window - 1 + group.extra_retained) // size)
            first = min(first, max(0, pages - keep))
        else:
            assert group.attention_chunk is not None
            first = min(first, (pages * size // group.attention_chunk)
                        * group.attention_chunk // size)
    return first


def window_hit(kv: EngineKV, parts: Sequence[int], local: int) -> int:
    """The longest hit, in pages, of at most ``len(parts)`` (the matched pages' parts,
    -1: none) whose pages from ``local`` (vLLM's own hit, in blocks) up all have the parts
    the windowed groups read; 0 if none is longer than ``local``."""
    # before[i]: the last page below i without a part (-1: none), so that one look says
    # whether a range ending at i is whole.
    before, missing = [], -1
    for i, part in enumerate(parts):
        before.append(missing)
        if part < 0:
            missing = i
    before.append(missing)
    for pages in range(len(parts), local, -1):
        if before[pages] < max(local, first_needed_page(kv, pages)):
            return pages
    return 0
