"""Type stubs for hostkv._introspect (the radix tree read without changing it)."""

from typing import List, Set, Tuple

import numpy as np
import numpy.typing as npt

from hostkv._segment import Segment

INSPECT_TOKENS: int

def check_tree(seg: Segment) -> None: ...
def tree_contents(seg: Segment) -> Set[Tuple[int, Tuple[int, ...], Tuple[int, ...], int]]: ...
def tree_summary_chunk(
    seg: Segment, start: int, max_nodes: int,
) -> Tuple[List[Tuple[int, int, int, int, int, Tuple[int, ...]]], int, int]: ...
def eviction_candidates(
    seg: Segment, max_pages: int, skip_pages: int = ...,
) -> List[Tuple[int, npt.NDArray[np.int32], npt.NDArray[np.int32], int, int]]: ...
def part_lru_state(seg: Segment) -> Set[Tuple[int, int, int]]: ...
