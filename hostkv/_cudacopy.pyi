"""Type stubs for hostkv._cudacopy (batched asynchronous 2-D copies for the GPU path)."""

import numpy as np
import numpy.typing as npt

def host_memcpy2d_function() -> int: ...
def memcpy2d_batch(
    function: int,
    to_host: bool,
    host: npt.NDArray[np.uint64],
    device: npt.NDArray[np.uint64],
    host_pitch: npt.NDArray[np.uint64],
    device_pitch: npt.NDArray[np.uint64],
    width: npt.NDArray[np.uint64],
    height: npt.NDArray[np.uint64],
    stream: int,
) -> int: ...
