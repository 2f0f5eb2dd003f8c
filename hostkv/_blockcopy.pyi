"""Type stubs for hostkv._blockcopy (the copy engine's strided block copies)."""

from typing import Optional, Sequence

import numpy as np
import numpy.typing as npt

STREAM_MIN_BYTES: int
CAN_STREAM: bool
STREAM_STORE_BYTES: int
FAULT_AROUND_BYTES: int

def check_blocks(
    dst_index: npt.NDArray[np.int64],
    dst_blocks: int,
    src_index: npt.NDArray[np.int64],
    src_blocks: int,
) -> None: ...
def copy_layers(
    dst_layers: npt.NDArray[np.uint64],
    dst_blocks: int,
    dst_block_stride: int,
    dst_index: npt.NDArray[np.int64],
    src_layers: npt.NDArray[np.uint64],
    src_blocks: int,
    src_block_stride: int,
    src_index: npt.NDArray[np.int64],
    shape: Sequence[int],
    dst_strides: Sequence[int],
    src_strides: Sequence[int],
    run: int,
    stream: Optional[bool] = None,
) -> None: ...
def copy_blocks(
    dst: int,
    dst_blocks: int,
    dst_block_stride: int,
    dst_index: npt.NDArray[np.int64],
    src: int,
    src_blocks: int,
    src_block_stride: int,
    src_index: npt.NDArray[np.int64],
    shape: Sequence[int],
    dst_strides: Sequence[int],
    src_strides: Sequence[int],
    run: int,
    stream: Optional[bool] = None,
) -> None: ...
def populate_pages(
    base: int,
    page_stride: int,
    page_bytes: int,
    num_pages: int,
    index: npt.NDArray[np.int64],
    mapped: npt.NDArray[np.uint8],
) -> int: ...
