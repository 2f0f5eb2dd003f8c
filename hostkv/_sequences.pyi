"""Type stubs for hostkv._sequences (the batch entry points over sequences)."""

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from hostkv._records import check_references as check_references
from hostkv._records import live_sequences as live_sequences
from hostkv._requests import SequenceAllocation
from hostkv._segment import Segment
from hostkv._viewstate import ViewSequence, ViewState
from hostkv._viewstate import live_of as live_of

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
def token_list(token_ids: Any) -> Any: ...
def append_tokens(seg: Segment, sequences: List[ViewSequence], token_ids: Any,
                  page_size: int) -> None: ...
def view_sequences(seg: Segment, view: int) -> List[Tuple[int, int, int, List[int]]]: ...

from hostkv.errors import OutOfPagesError

class SweepNeeded(OutOfPagesError): ...
