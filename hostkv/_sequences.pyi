"""Type stubs for hostkv._sequences (sequence records and the batch entry points)."""

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import numpy.typing as npt

from hostkv._segment import Segment

def allocate(seg: Segment, token_arrays: List[npt.NDArray[np.int32]],
             seq_ids: List[int], namespaces: List[int],
             reuse_pages: List[int], min_reuse_pages: int,
             view: int) -> List[Tuple[int, int, npt.NDArray[np.int32], int]]: ...
def allocate_requests(seg: Segment, requests: Sequence[Any], request_type: type,
                      live: Dict[int, Any], page_size: int, pool_pages: int,
                      reuse_enabled: bool, min_reuse_pages: int, view: int, seq_ids: List[int]
                      ) -> Tuple[List[npt.NDArray[np.int32]], List[int],
                                 List[Tuple[int, int, npt.NDArray[np.int32], int]]]: ...
def hold(seg: Segment, token_arrays: List[npt.NDArray[np.int32]],
         seq_ids: npt.NDArray[np.int64], namespaces: List[int],
         view: int) -> List[Tuple[int, int, npt.NDArray[np.int32], int]]: ...
def append_pages(seg: Segment, records: npt.NDArray[np.int32], seq_ids: npt.NDArray[np.int64],
                 generations: npt.NDArray[np.int64]) -> npt.NDArray[np.int32]: ...
def commit(seg: Segment, records: List[int], seq_ids: List[int], generations: List[int],
           token_arrays: List[npt.NDArray[np.int32]], tables: List[npt.NDArray[np.int32]],
           num_pages: List[int], namespaces: List[int]) -> List[int]: ...
def release(seg: Segment, records: List[int], seq_ids: List[int], generations: List[int],
            token_arrays: List[npt.NDArray[np.int32]], tables: List[npt.NDArray[np.int32]],
            num_pages: List[int], namespaces: List[int]) -> List[int]: ...
def release_sequences(seg: Segment, sequences: List[Any], commit: bool,
                      min_store_pages: int) -> List[int]: ...
def view_sequences(seg: Segment, view: int) -> List[Tuple[int, int, int, List[int]]]: ...
def check_references(seg: Segment, exact: bool) -> None: ...
def live_sequences(seg: Segment) -> List[Tuple[int, int, int, int, Tuple[int, ...]]]: ...

from hostkv.errors import OutOfPagesError

class SweepNeeded(OutOfPagesError): ...
