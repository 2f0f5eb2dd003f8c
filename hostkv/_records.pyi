"""Type stubs for hostkv._records (sequence records and their page lists)."""

from typing import List, Tuple

from hostkv._segment import Segment

def check_references(seg: Segment, exact: bool) -> None: ...
def live_sequences(seg: Segment) -> List[Tuple[int, int, int, int, Tuple[int, ...]]]: ...
