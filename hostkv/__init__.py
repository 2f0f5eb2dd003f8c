"""hostkv: a host-memory KV-page store with prefix reuse, shared by every worker process.

See README.md for a tour; the names below are the whole public API.
"""

import os as _os
from importlib.machinery import PathFinder as _PathFinder

# The compiled modules (setup.py's MODULES; one per .pyx). Checked before anything imports
# them: in a source tree that was never built, the first `from hostkv import _pages` deep in
# hostkv.cache fails with "cannot import name '_pages' from partially initialized module
# 'hostkv' (most likely due to a circular import)", which sends the reader looking for a
# cycle that is not there. They are looked for in this package's own directory only: an
# editable install of another checkout adds a finder that would otherwise hand this tree
# that checkout's modules, built from other sources. A module that is present but fails to
# load (built against another numpy, say) is not caught here: its own ImportError says more.
_COMPILED = ("_tokens", "_crash", "_leases", "_geometry", "_format", "_lock", "_segment", "_pages",
             "_slab", "_radix", "_introspect", "_requests", "_records", "_viewstate", "_sequences",
             "_blockcopy", "_cudacopy")
_missing = [m for m in _COMPILED if _PathFinder.find_spec(f"{__name__}.{m}", __path__) is None]
if _missing:
    raise ImportError(
        f"hostkv's compiled extensions are not built in {_os.path.dirname(__file__)} "
        f"(missing for this Python: {', '.join(_missing)}): build them with "
        f"`python setup.py build_ext --inplace` in the source tree, or install it with "
        f"`pip install -e .`. If hostkv is installed and this directory is its source tree, "
        f"run from another directory so that Python imports the installed copy.",
        name=__name__, path=__file__)
del _os, _PathFinder, _missing

from hostkv.cache import (
    CacheMetrics,
    CacheStats,
    EvictionCandidate,
    HostKVCache,
    PrefaultStatus,
    PrefixMatch,
)
from hostkv.config import HostKVConfig, KVLayout
from hostkv.errors import (
    AbandonedSegmentError,
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
    SegmentInUseError,
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
    "AbandonedSegmentError",
    "CacheMetrics",
    "CacheStats",
    "CapacityError",
    "ConfigError",
    "CorruptionError",
    "EvictionCandidate",
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
    "SegmentInUseError",
    "SegmentNotFoundError",
    "SegmentPermissionError",
    "SequenceAllocation",
    "SequenceError",
    "SequenceRequest",
    "WorkerView",
    "WorkerViewStats",
]
