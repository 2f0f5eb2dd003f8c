"""What the CPU and GPU copy paths share: a layer's copy as a grid of contiguous runs, and
the copy engine's counters.

:class:`hostkv.copy_engine.CopyEngine` builds one :class:`CopyPlan` per layer and hands it
to the compiled CPU loop; :class:`hostkv.cuda_copy.CudaCopier` builds one for a staged page
against the pool's and turns it into the addresses of its DMA copies. Both import it from
here: ``copy_engine`` imports ``cuda_copy`` (only for CUDA tensors), never the other way.

Pure Python, importing neither torch nor numpy.
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

__all__ = ["CopyPlan", "CopyStats"]


@dataclasses.dataclass(frozen=True)
class CopyPlan:
    """One layer's copy, as the compiled loop takes it: a grid of contiguous runs per block.

    Attributes:
        shape: The grid's axes (runs of ``run`` bytes), outermost first.
        pool_strides, engine_strides: Each grid axis's stride in bytes on either side.
        run: Bytes of one contiguous run.
    """

    shape: Tuple[int, ...]
    pool_strides: Tuple[int, ...]
    engine_strides: Tuple[int, ...]
    run: int

    @staticmethod
    def build(shape: Sequence[int], pool_strides: Sequence[int],
              engine_strides: Sequence[int], itemsize: int) -> "CopyPlan":
        """Coalesces a block's element grid into the fewest, longest runs.

        Axes of size 1 drop out; the innermost axes contiguous on both sides become the
        run; then neighbours that are contiguous with each other on both sides merge.
        """
        axes = [(int(n), int(p), int(e)) for n, p, e in zip(shape, pool_strides, engine_strides)
                if n != 1]
        run = itemsize
        while axes and axes[-1][1] == run and axes[-1][2] == run:
            run *= axes.pop()[0]
        merged: List[Tuple[int, int, int]] = []
        for n, p, e in axes:
            if merged:
                on, op, oe = merged[-1]
                if op == p * n and oe == e * n:
                    merged[-1] = (on * n, p, e)
                    continue
            merged.append((n, p, e))
        return CopyPlan(tuple(a[0] for a in merged), tuple(a[1] for a in merged),
                        tuple(a[2] for a in merged), run)


@dataclasses.dataclass(frozen=True)
class CopyStats:
    """A copy engine's counters since it was built (``CopyEngine.stats()``).

    Attributes:
        transfers: Saves and loads that moved bytes.
        copy_calls: Copy calls they made: on a GPU, DMA calls enqueued (one a page, or one
            per run of adjacent pages); on a CPU, compiled copy calls.
        pieces: Staging fills (GPU; a transfer larger than the staging takes several).
        staging_bytes: Device memory held for staging, both directions (GPU; fixed when the
            engine is built).
        registered_bytes: Pool bytes registered with CUDA so far (GPU).
        register_failures: Registration chunks that failed (GPU; they stay pageable).
    """

    transfers: int = 0
    copy_calls: int = 0
    pieces: int = 0
    staging_bytes: int = 0
    registered_bytes: int = 0
    register_failures: int = 0
