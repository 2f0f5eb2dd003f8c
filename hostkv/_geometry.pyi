"""Type stubs for hostkv._geometry (where a segment's regions lie)."""

from typing import Any, Dict

MADV: Dict[str, int]

def layout_info() -> Dict[str, Any]: ...
