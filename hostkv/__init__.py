"""hostkv: a host-memory KV-page store with prefix reuse, shared by every worker process.

See README.md for a tour; the names below are the whole public API.
"""

from hostkv.cache import CacheStats, HostKVCache
from hostkv.config import HostKVConfig, KVLayout
from hostkv.errors import (
    CapacityError,
    ConfigError,
    CorruptionError,
    ForeignSegmentError,
    HostKVError,
    IncompatibleSegmentError,
    LockTimeoutError,
    OutOfPagesError,
    SegmentError,
    SegmentExistsError,
    SegmentNotFoundError,
    SegmentPermissionError,
    SequenceError,
)

__version__ = "0.1.0"

__all__ = [
    "CacheStats",
    "CapacityError",
    "ConfigError",
    "CorruptionError",
    "ForeignSegmentError",
    "HostKVCache",
    "HostKVConfig",
    "HostKVError",
    "IncompatibleSegmentError",
    "KVLayout",
    "LockTimeoutError",
    "OutOfPagesError",
    "SegmentError",
    "SegmentExistsError",
    "SegmentNotFoundError",
    "SegmentPermissionError",
    "SequenceError",
]
