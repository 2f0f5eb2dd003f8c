"""Argument checks shared by hostkv's entry points: "an int, not a bool" and friends.

bool is an int to Python (``True == 1``, ``operator.index(True) == 1``), but num_pages=True
or namespace=False is always a mistake, so every check here refuses bools, numpy's
included; and none of them rounds: 0.9 pages is not 0 pages, "3" is not 3.

Pure Python, importing neither numpy nor a compiled module: hostkv.config must stay
importable without numpy, and the compiled modules may import this one without a cycle.
numpy's bool is recognised only once numpy is imported (nothing can hold one before).
The exception each check raises is the caller's (a ConfigError for a config field, a
SequenceError for a sequence id, a ValueError elsewhere), and so is the wording of its
message, which tests and users match.
"""

from __future__ import annotations

import math
import numbers
import operator
import sys
from typing import Any, Type

__all__ = ["as_index", "describe", "int_in", "is_bool", "is_int", "is_real", "number",
           "positive_index"]


def is_bool(value: Any) -> bool:
    """True for a Python or numpy bool."""
    if isinstance(value, bool):
        return True
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.bool_)


def is_int(value: Any) -> bool:
    """True for a Python or numpy integer that is not a bool."""
    return isinstance(value, numbers.Integral) and not is_bool(value)


def is_real(value: Any) -> bool:
    """True for a real number (int, float, a numpy scalar, a Fraction) that is not a bool."""
    return isinstance(value, numbers.Real) and not is_bool(value)


def describe(value: Any) -> str:
    """A value and its type, for messages: ``'8' (str)``."""
    return f"{value!r} ({type(value).__name__})"


def as_index(value: Any, what: str, error: Type[Exception]) -> int:
    """Returns value as a Python int: anything with ``__index__`` (int, numpy integers),
    never a bool, a float or a str.

    Raises:
        error: "{what} must be an integer, got {value!r} ({type})".
    """
    if not is_bool(value):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise error(f"{what} must be an integer, got {describe(value)}")


def positive_index(value: Any, what: str, error: Type[Exception]) -> int:
    """as_index, and > 0.

    Raises:
        error: not an integer (as as_index), or "{what} must be a positive integer, got N".
    """
    result = as_index(value, what, error)
    if result <= 0:
        raise error(f"{what} must be a positive integer, got {result}")
    return result


def int_in(value: Any, low: int, high: int, error: Type[Exception], subject: str, kind: str,
           within: str) -> int:
    """Returns value, a Python or numpy integer (not a bool), as an int in [low, high).

    Raises:
        error: "{subject} must be {kind}, got {value!r}" for anything but an integer,
            "{subject} must {within}, got N" for one outside the range.
    """
    if not is_int(value):
        raise error(f"{subject} must be {kind}, got {value!r}")
    result = int(value)
    if not low <= result < high:
        raise error(f"{subject} must {within}, got {result}")
    return result


def number(value: Any, field: str, minimum: float, maximum: float, integer: bool,
           error: Type[Exception]) -> Any:
    """Returns value unchanged if it is a Python int (integer) or int or float in
    [minimum, maximum], finite.

    Only Python's own int and float, not numpy's: the value is kept as given, and goes as it
    is into a RemoteConfig's repr and to redis-py.

    Raises:
        error: "{field} must be an integer|a number, got {value!r} ({type})", "{field} must
            be finite, got ...", or "{field} must be in [minimum, maximum], got ...".
    """
    if is_bool(value) or not isinstance(value, (int, float)) or (
            integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise error(f"{field} must be {kind}, got {describe(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise error(f"{field} must be finite, got {value!r}")
    if not minimum <= value <= maximum:
        raise error(f"{field} must be in [{minimum}, {maximum}], got {value!r}")
    return value
