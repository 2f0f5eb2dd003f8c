"""Type stubs for hostkv._viewstate (a WorkerView's compiled bookkeeping)."""

from typing import Any, Dict, List

import numpy as np
import numpy.typing as npt

from hostkv._segment import Segment

class ViewSequence:
    seq_id: int
    record: int
    generation: int
    namespace: int
    tokens: npt.NDArray[np.int32]
    num_tokens: int
    cacheable_tokens: int
    reused_tokens: int
    committed_pages: int
    pages: npt.NDArray[np.int32]
    num_pages: int
    def __init__(self, seq_id: int, record: int, generation: int, namespace: int,
                 tokens: npt.NDArray[np.int32], reused_tokens: int, reused_pages: int,
                 pages: npt.NDArray[np.int32]) -> None: ...

class ViewState:
    segment: Segment
    live: Dict[int, ViewSequence]
    page_size: int
    pool_pages: int
    reuse_enabled: bool
    min_reuse_pages: int
    min_store_pages: int
    view: int
    requests: int
    prompt_tokens: int
    reused_tokens: int
    committed_pages: int
    def __init__(self, segment: Segment, live: Dict[int, ViewSequence], page_size: int,
                 pool_pages: int, reuse_enabled: bool, min_reuse_pages: int,
                 min_store_pages: int, view: int) -> None: ...
    def pages_to_commit(self, full_pages: int, committed_pages: int) -> int: ...

def live_of(live: Dict[int, ViewSequence], seq_ids: Any, what: str) -> List[ViewSequence]: ...
