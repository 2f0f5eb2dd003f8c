"""Validation of token ids, sequence ids and namespaces at the API boundary, before any shared state is touched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from hostkv import _radix
from hostkv._validate import int_in, is_bool
from hostkv.errors import SequenceError

TOKEN_LIMIT = 2**31
# Iterable, but bytes, not ids or tokens: refused wherever a sequence of them is expected.
BYTES_LIKE = (str, bytes, bytearray, memoryview)
NAMESPACE_LIMIT = 2**64
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def as_tokens(tokens: Any, what: str = "tokens", private: bool = False) -> np.ndarray:
    """Returns token ids as a contiguous 1-D np.int32 array (no copy when it already is one,
    unless private).

    Accepts lists or tuples of Python or numpy integers, numpy integer arrays and CPU torch
    integer tensors. private: the result is never memory the caller can still change (numpy
    and torch input is copied), for a caller that keeps it.

    Raises:
        ValueError: not 1-D, not integers (floats, bools), or an id outside [0, 2**31).
    """
    if (type(tokens) is np.ndarray and tokens.dtype == np.int32 and tokens.ndim == 1
            and tokens.flags.c_contiguous and tokens.flags.aligned):
        # The common case, first and cheap: an engine's own int32 token array.
        if private:
            copy = _radix.checked_copy(tokens)
            if copy is None:
                _raise_out_of_range(tokens, what)
            return copy
        if _radix.first_bad_token(tokens) >= 0:
            _raise_out_of_range(tokens, what)
        return tokens
    if type(tokens) is list or type(tokens) is tuple:
        # The engines' own format, read in one C loop into a new array; None: not all
        # plain ints.
        arr = _radix.tokens_from_sequence(tokens, what)
        if arr is not None:
            return arr
    arr = _as_int32_array(tokens, what)
    if private and (arr is tokens or arr.base is not None):
        arr = arr.copy()
    return arr


def _as_int32_array(tokens: Any, what: str) -> np.ndarray:
    """as_tokens for everything but its fast paths (maybe the caller's own memory)."""
    if type(tokens).__module__.startswith("torch"):
        if getattr(tokens, "device", None) is not None and tokens.device.type != "cpu":
            raise ValueError(f"{what} must be on the CPU, got a tensor on {tokens.device}")
        tokens = tokens.detach().numpy()
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        if isinstance(tokens, BYTES_LIKE) or not isinstance(tokens, Sequence):
            # bytes, bytearray and memoryview iterate as small ints, but they are bytes, not
            # token ids; a dict or set has no order (each was once let through, or refused
            # with a misleading message).
            raise ValueError(f"{what} must be a sequence of integer ids (a list, tuple, numpy "
                             f"or torch integer array), got {type(tokens).__name__}")
        if len(tokens) == 0:
            return np.empty(0, dtype=np.int32)
        try:
            arr = np.asarray(tokens)
        except (OverflowError, ValueError, TypeError) as exc:
            raise ValueError(f"{what} must be integer ids in [0, 2**31): {exc}") from None
        if arr.dtype == object:
            raise ValueError(f"{what} must be integer ids in [0, 2**31); got values beyond "
                             "int64 or that are not integers")
        if arr.ndim == 1 and arr.dtype.kind in "iu":
            _refuse_bools(tokens, arr, what)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must be integer ids, got dtype {arr.dtype}")
    if arr.dtype == np.int32:              # native order ('>i4' is not equal to it)
        if not (arr.flags.c_contiguous and arr.flags.aligned):
            arr = arr.copy()                  # the compiled layer reads it raw
        if _radix.first_bad_token(arr) >= 0:
            _raise_out_of_range(arr, what)
        return arr
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= TOKEN_LIMIT):
        _raise_out_of_range(arr, what)
    return arr.astype(np.int32)


def _refuse_bools(tokens: Sequence, arr: np.ndarray, what: str) -> None:
    """numpy turns True and False among integers into 1 and 0: look at the elements that
    became 0 or 1 (few, in real prompts), not at every element."""
    for i in np.flatnonzero(arr <= 1).tolist():
        if is_bool(tokens[i]):
            raise ValueError(f"{what}[{i}] is {tokens[i]!r}: token ids must be integers, "
                             "not bools")


def _raise_out_of_range(arr: np.ndarray, what: str) -> NoReturn:
    bad = np.nonzero((arr < 0) | (arr >= TOKEN_LIMIT))[0][0]
    raise ValueError(f"{what}[{bad}] = {int(arr[bad])} is outside [0, 2**31)")


def as_seq_id(seq_id: Any) -> int:
    """Returns a sequence id as an int in [-2**63, 2**63), or raises SequenceError."""
    if type(seq_id) is int and _INT64_MIN <= seq_id <= _INT64_MAX:
        return seq_id
    return int_in(seq_id, _INT64_MIN, _INT64_MAX + 1, SequenceError, "sequence ids",
                  "integers", "fit int64")


def as_namespace(namespace: Any) -> int:
    """Returns the namespace as an int in [0, 2**64), or raises ValueError."""
    if type(namespace) is int and 0 <= namespace < NAMESPACE_LIMIT:
        return namespace
    return int_in(namespace, 0, NAMESPACE_LIMIT, ValueError, "namespace",
                  "an integer in [0, 2**64)", "be in [0, 2**64)")
