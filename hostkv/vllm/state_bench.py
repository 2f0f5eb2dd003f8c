"""`python -m hostkv.vllm.state_bench`: recurrent-state copies against a plain memcpy.

A model with state layers (:mod:`hostkv.vllm.state`) saves, with a page, each state
layer's state at the page's end, and a hit loads it into the hit's last block. Those copies
run inline in the step (:class:`~hostkv.vllm.state.StateCopies`): one ``torch`` copy per
state tensor, layer and page. This measures them on one thread between vLLM-shaped state
tensors and a hostkv segment, beside a plain ``torch`` copy of as many bytes between two
pre-faulted buffers (the memory's limit), interleaved round by round, medians.

Two shapes, both from vLLM's own shape calculator for Gated DeltaNet at TP=1:

- ``qwen3-next``: Qwen3-Next-80B-A3B's GDN layers (16 key heads and 32 value heads of 128:
  a conv state of 8,192 channels and a 32 x 128 x 128 recurrent state, bfloat16; 1.05 MiB a
  layer), 12 of them (a quarter of the model's 36: one of its three state groups), 8 pages
  a step. Large copies: does hostkv reach the memory's speed?
- ``tiny``: the test suite's random Qwen3-Next (2 heads of 64: 24 KiB a layer), 3 layers,
  8 pages. Small copies: what each copy's Python costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Callable, Dict, List, Optional, Tuple

import torch

from hostkv.cache import HostKVCache
from hostkv.config import HostKVConfig, KVLayout
from hostkv.copy_engine import VLLM
from hostkv.vllm.layout import (EngineKV, KVGroup, StateLayout, conv_state_dim_first,
                                 state_splits)
from hostkv.vllm.state import StateCopies

__all__ = ["SHAPES", "measure", "main"]

# name: (GDN key heads, value heads, head dim, conv kernel, state layers, full layers,
#        attention KV heads, attention head dim, pages a step)
SHAPES: Dict[str, Tuple[int, ...]] = {
    "qwen3-next": (16, 32, 128, 4, 12, 4, 2, 256, 8),
    "tiny": (2, 2, 64, 4, 3, 1, 2, 64, 8),
}


def _gdn_state(key_heads: int, value_heads: int, head_dim: int, kernel: int
               ) -> Tuple[Tuple[Tuple[int, ...], ...], Tuple[torch.dtype, ...]]:
    """A GDN layer's state shapes and element types at TP=1, as vLLM 0.32 computes them
    (``MambaStateShapeCalculator.gated_delta_net_state_shape``) for a bfloat16 model."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator, MambaStateShapeCalculator)

    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, key_heads, value_heads, head_dim, head_dim, kernel)
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.bfloat16, "auto")
    return tuple(tuple(s) for s in shapes), tuple(dtypes)


def measure(shape: str = "qwen3-next", rounds: int = 15,
            name: Optional[str] = None) -> Dict[str, object]:
    """Saves and loads one step's states through StateCopies, and a plain copy of as many
    bytes, in ``rounds`` interleaved rounds; returns GB/s (medians, best) and ratios to the
    plain copy's median.

    Raises:
        KeyError: an unknown shape.
    """
    (key_heads, value_heads, head_dim, kernel, state_layers, full_layers, kv_heads,
     attn_dim, pages) = SHAPES[shape]
    shapes, dtypes = _gdn_state(key_heads, value_heads, head_dim, kernel)
    state = StateLayout(shapes=shapes, dtypes=tuple(str(d).replace("torch.", "") for d in dtypes),
                        itemsizes=tuple(torch.empty((), dtype=d).element_size() for d in dtypes),
                        tp_world=1, kind="GDN_ATTN",
                        # Qwen3-Next's whole state, as engines of every degree share it.
                        splits=state_splits("GDN_ATTN", ("Qwen3NextForCausalLM",), shapes,
                                            conv_state_dim_first()))
    num_layers = state_layers + full_layers
    # vLLM's hybrid manager makes an attention page at least as large as a state; hostkv's
    # pages hold a power-of-two number of tokens (the block size such an engine is given).
    token_bytes = 2 * kv_heads * attn_dim * 2
    page_size = 1 << max(4, (-(-state.slot_bytes // token_bytes) - 1).bit_length())
    # State layers first: one group of them, one of the attention layers.
    states = tuple(range(state_layers))
    layout = KVLayout(num_layers=num_layers, num_kv_heads=kv_heads, head_dim=attn_dim,
                      dtype="bfloat16", state_layers=states)
    kv = EngineKV(layout=layout, page_size=page_size,
                  layer_names=tuple(f"model.layers.{i}" for i in range(num_layers)),
                  block_layout=VLLM, tp_world=1, backend="bench",
                  groups=(KVGroup("state", states, state=state),
                          KVGroup("full", tuple(range(state_layers, num_layers)))))
    num_blocks = pages + 1                      # block 0 is vLLM's null block
    kv_caches = {kv.layer_names[i]: [torch.randn((num_blocks, *s)).to(d)
                                     for s, d in zip(shapes, dtypes)]
                 for i in states}
    name = name or f"hostkv-state-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    cfg = HostKVConfig(num_pages=pages, page_size=page_size,
                       page_bytes=layout.page_bytes(page_size), kv_layout=layout)
    nbytes = pages * state_layers * state.rank_bytes
    with HostKVCache.create(name, cfg) as cache:
        pool = copies = None
        try:
            pool = cache.pages_tensor(dtype=torch.uint8, shape=(pages, cfg.page_bytes))
            pool.view(-1)[::4096].fill_(0)          # fault the pool in: a warm pool
            copies = StateCopies(pool, kv, kv_caches, rank=0, group=0)
            blocks = list(range(1, num_blocks))
            slots = list(range(pages))
            source = torch.randn(nbytes // 4).view(torch.uint8)
            target = torch.empty_like(source)
            target.fill_(0)

            def save() -> None:
                assert copies.save(blocks, slots).error is None

            def load() -> None:
                assert copies.load(slots, blocks).error is None

            ops: Dict[str, Callable[[], None]] = {
                "save": save, "load": load, "plain": lambda: target.copy_(source)}
            times: Dict[str, List[float]] = {op: [] for op in ops}
            with _one_torch_thread():
                for op in ops.values():             # once each, untimed
                    op()
                for _ in range(rounds):
                    for op_name, op in ops.items():
                        start = time.perf_counter()
                        op()
                        times[op_name].append(time.perf_counter() - start)
        finally:
            pool = copies = None                    # the pool's views, before close()
            cache.unlink()
    rates = {op: nbytes / statistics.median(t) / 1e9 for op, t in times.items()}
    return {
        "shape": shape, "pages": pages, "state_layers": state_layers, "bytes": nbytes,
        "layer_bytes": state.rank_bytes, "copies": pages * state_layers * len(shapes),
        "gbps": rates,
        "best_gbps": {op: nbytes / min(t) / 1e9 for op, t in times.items()},
        "x_plain": {op: rates[op] / rates["plain"] for op in ("save", "load")},
        "us_per_copy": {op: statistics.median(times[op]) * 1e6 / (pages * state_layers * len(shapes))
                        for op in ("save", "load")},
    }


class _one_torch_thread:
    """torch's intra-op threads set to one for the measurement (a copy engine's thread)."""

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.before)


def report(result: Dict[str, object]) -> str:
    """One measurement in words."""
    gbps, best, ratio, per_copy = (result["gbps"], result["best_gbps"], result["x_plain"],
                                   result["us_per_copy"])
    lines = [f"{result['shape']}: {result['pages']} pages x {result['state_layers']} state "
             f"layers of {result['layer_bytes'] / 2**10:,.0f} KiB = "
             f"{result['bytes'] / 2**20:,.1f} MiB a step, {result['copies']} tensor copies"]
    for op in ("save", "load", "plain"):
        line = f"  {op:5} {gbps[op]:6.1f} GB/s median, {best[op]:6.1f} best"  # type: ignore[index]
        if op != "plain":
            line += (f", {ratio[op]:.2f}x plain, "  # type: ignore[index]
                     f"{per_copy[op]:.1f} us a copy")  # type: ignore[index]
        lines.append(line)
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """The command line: every shape (or the ones named), printed."""
    parser = argparse.ArgumentParser(prog="python -m hostkv.vllm.state_bench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES))
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    for shape in args.shape or list(SHAPES):
        print(report(measure(shape, args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
