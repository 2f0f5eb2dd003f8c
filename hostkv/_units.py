"""Sizes written the way operators write them: ``4GiB``, ``512MB``, ``1000000``.

Shared by ``python -m hostkv create`` and the vLLM connector's ``size`` key; no torch, no vLLM.
"""

from __future__ import annotations

import re
from typing import Any

from hostkv._validate import is_bool

__all__ = ["parse_size"]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
          "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
          "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4}


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as ``"4GiB"`` (powers of 1024), ``"512MB"``
    (powers of 1000) or ``"1000000"``.

    Raises:
        ValueError: not a positive size.
    """
    if is_bool(value):
        raise ValueError(f"size must be bytes or a string like '4GiB', got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE_RE.match(str(value))
        if not match:
            raise ValueError(f"size must be bytes or a string like '4GiB', got {value!r}")
        size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size
