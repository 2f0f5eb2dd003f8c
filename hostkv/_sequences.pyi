"""Type stubs for hostkv._sequences (sequence records and the batch entry points)."""

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from hostkv._requests import SequenceAllocation
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

def allocate_requests(state: ViewState, requests: Sequence[Any],
                      seq_ids: List[int]) -> List[SequenceAllocation]: ...
def check_requests(requests: Sequence[Any], live: Dict[int, Any],
                   seq_ids: List[int]) -> Tuple[List[npt.NDArray[np.int32]], List[int]]: ...
def hold(seg: Segment, token_arrays: List[npt.NDArray[np.int32]],
         seq_ids: npt.NDArray[np.int64], namespaces: List[int],
         view: int) -> List[Tuple[int, int, npt.NDArray[np.int32], int]]: ...
def commit(seg: Segment, records: List[int], seq_ids: List[int], generations: List[int],
           token_arrays: List[npt.NDArray[np.int32]], tables: List[npt.NDArray[np.int32]],
           num_pages: List[int], namespaces: List[int]) -> List[int]: ...
def release(seg: Segment, records: List[int], seq_ids: List[int], generations: List[int],
            token_arrays: List[npt.NDArray[np.int32]], tables: List[npt.NDArray[np.int32]],
            num_pages: List[int], namespaces: List[int]) -> List[int]: ...
def commit_view_sequences(state: ViewState, sequences: List[ViewSequence],
                          num_pages: List[int]) -> List[int]: ...
def release_sequences(state: ViewState, sequences: List[ViewSequence],
                      commit: bool) -> List[int]: ...
def live_of(live: Dict[int, ViewSequence], seq_ids: Any, what: str) -> List[ViewSequence]: ...
def token_list(token_ids: Any) -> Any: ...
def append_tokens(seg: Segment, sequences: List[ViewSequence], token_ids: Any,
                  page_size: int) -> None: ...
def view_sequences(seg: Segment, view: int) -> List[Tuple[int, int, int, List[int]]]: ...
def check_references(seg: Segment, exact: bool) -> None: ...
def live_sequences(seg: Segment) -> List[Tuple[int, int, int, int, Tuple[int, ...]]]: ...

from hostkv.errors import OutOfPagesError

class SweepNeeded(OutOfPagesError): ...
