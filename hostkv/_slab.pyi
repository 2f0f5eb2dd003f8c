"""Type stubs for hostkv._slab: its functions are cdef; the Python-level names are test hooks
(tests/test_slab.py)."""

from typing import Any, Dict, List, Sequence, Tuple

from hostkv._segment import Segment

def _mutate(seg: Segment, region: str, ops: Sequence[Tuple[Any, ...]],
            commit: bool = ...) -> List[Any]: ...
def _state(seg: Segment, region: str) -> Dict[str, Any]: ...
def _check(seg: Segment, region: str) -> None: ...
