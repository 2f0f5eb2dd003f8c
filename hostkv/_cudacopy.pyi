"""Type stubs for hostkv._cudacopy (batched asynchronous copies for the GPU path)."""

import numpy as np
import numpy.typing as npt

def host_memcpy_function() -> int: ...
def memcpy_batch(
    function: int,
    dst: npt.NDArray[np.uint64],
    src: npt.NDArray[np.uint64],
    nbytes: npt.NDArray[np.uint64],
    stream: int,
) -> None: ...
