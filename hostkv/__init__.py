"""hostkv: a host-memory KV-page store with prefix reuse, shared by every worker process.

See README.md for a tour; the names below are the whole public API.
"""

from hostkv.cache import CacheMetrics, CacheStats, HostKVCache, PrefaultStatus, PrefixMatch
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
    SegmentFormatError,
    SegmentNotFoundError,
    SegmentPermissionError,
    SequenceError,
)

from hostkv.worker_view import (
    PrefixSequenceState,
    SequenceAllocation,
    SequenceRequest,
    WorkerView,
    WorkerViewStats,
)

__version__ = "0.1.0"

__all__ = [
    "CacheMetrics",
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
    "PrefaultStatus",
    "PrefixMatch",
    "PrefixSequenceState",
    "SegmentError",
    "SegmentExistsError",
    "SegmentFormatError",
    "SegmentNotFoundError",
    "SegmentPermissionError",
    "SequenceAllocation",
    "SequenceError",
    "SequenceRequest",
    "WorkerView",
    "WorkerViewStats",
]
