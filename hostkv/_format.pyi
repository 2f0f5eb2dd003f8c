"""Type stubs for hostkv._format (what a segment's header says it is)."""

from hostkv.config import DTYPE_CODES as DTYPE_CODES
from hostkv.config import KV_KINDS as KV_KINDS

RESERVE_CHUNK: int

def _pace_reservation(chunk_bytes: int = ..., delay: float = ...) -> None: ...
