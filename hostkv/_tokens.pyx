# cython: language_level=3, embedsignature=True
"""Validation of token ids, sequence ids and namespaces at the API boundary, before any shared
state is touched.

At the bottom of the compiled stack: it knows no segment, and every compiled module that
takes tokens (_radix, _viewstate, _sequences) reads them through it, as the Python modules
do (cache, worker_view). The engines' own formats are read in C: an int32 array is checked
in one vectorised loop (first_bad_token, checked_copy), a list or tuple of ints is read
straight from CPython's int objects (tokens_from_sequence); anything else goes through
numpy (as_tokens).
"""

from collections.abc import Sequence

import numpy as np
cimport numpy as cnp

from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcpy
from cpython.object cimport PyObject

from hostkv.includes.python cimport (
    PyLong_CheckExact, PySequence_Fast_GET_SIZE, PySequence_Fast_ITEMS, hkv_token_value)

from hostkv._validate import int_in, is_bool
from hostkv.errors import SequenceError

cnp.import_array()

TOKEN_LIMIT = 2**31
# Iterable, but bytes, not ids or tokens: refused wherever a sequence of them is expected.
BYTES_LIKE = (str, bytes, bytearray, memoryview)
NAMESPACE_LIMIT = 2**64
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


# -- the engines' formats, in C -----------------------------------------------------------------

cdef int check_i32(cnp.ndarray arr, str what) except -1:
    """The compiled entry points read arrays raw: they must be 1-D, int32 and contiguous."""
    if (arr.ndim != 1 or cnp.PyArray_TYPE(arr) != cnp.NPY_INT32
            or not cnp.PyArray_IS_C_CONTIGUOUS(arr) or not cnp.PyArray_ISNOTSWAPPED(arr)
            or not cnp.PyArray_ISALIGNED(arr)):
        # (A big-endian '>i4' array is NPY_INT32 too: read raw, its ids would be others.)
        raise ValueError(f"{what} must be a contiguous 1-D np.int32 array, got {arr.dtype} "
                         f"with shape {(<object>arr).shape}")
    return 0


cdef int64_t first_negative(const int32_t* data, int64_t n) noexcept nogil:
    """The index of the first negative id of data[:n], or -1. It ORs blocks of ids (a loop
    without a branch, which the compiler vectorizes: ~0.05 ns an id, where a loop that
    stops at the first negative id costs ~0.8) and looks for the index only in a block
    whose OR is negative."""
    cdef int64_t i = 0, j, end
    cdef int32_t acc
    while i < n:
        end = min(i + 4096, n)
        acc = 0
        for j in range(i, end):
            acc = acc | data[j]
        if acc < 0:
            for j in range(i, end):
                if data[j] < 0:
                    return j
        i = end
    return -1


def first_bad_token(cnp.ndarray tokens):
    """The index of the first token id outside [0, 2**31) in a contiguous int32 array, or -1.

    (For int32 only negative ids can be out of range.) A C loop: validating a prompt costs
    a fraction of a microsecond, not a numpy reduction's call overhead."""
    cdef int64_t found
    check_i32(tokens, "tokens")
    with nogil:
        found = first_negative(<const int32_t*>cnp.PyArray_DATA(tokens), tokens.shape[0])
    return found


def checked_copy(cnp.ndarray tokens):
    """A new array holding a copy of a contiguous int32 token array, or None when an id is
    outside [0, 2**31) (first_bad_token says which): one C call where a check and a numpy
    copy would be two, for a caller that must not keep the caller's own memory."""
    check_i32(tokens, "tokens")
    return checked_i32_copy(tokens)


cdef object checked_i32_copy(cnp.ndarray tokens):
    """checked_copy of an array already known to be contiguous, aligned, native int32."""
    cdef int64_t n = tokens.shape[0], found
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(1, [n], cnp.NPY_INT32, 0)
    with nogil:
        memcpy(cnp.PyArray_DATA(out), cnp.PyArray_DATA(tokens), <size_t>n * 4)
        found = first_negative(<const int32_t*>cnp.PyArray_DATA(out), n)
    return out if found < 0 else None


def tokens_from_sequence(object seq, str what):
    """Reads a list or tuple of Python ints as a new contiguous np.int32 array, or None.

    The engines' own format (vLLM and SGLang hold prompts as Python lists) read in one C
    loop, with no intermediate numpy conversion: a few ns per token. Returns None when an
    item is not exactly an int (a bool, a numpy integer, anything else), so the caller's
    general path decides; no Python code runs while the items are read, so the sequence
    cannot change under the loop.

    Raises:
        ValueError: an id outside [0, 2**31), naming its index and value.
    """
    if type(seq) is not list and type(seq) is not tuple:
        raise TypeError(f"tokens_from_sequence needs a list or tuple, got {type(seq).__name__}")
    return sequence_tokens(seq, what, -1)


cdef object sequence_tokens(object seq, str what, Py_ssize_t request):
    """tokens_from_sequence for a list or tuple. The sequence is named `what` in errors, or,
    with request >= 0, `what[request].tokens`: a batch's caller then formats no name for
    the requests that have no error."""
    cdef Py_ssize_t i, n = PySequence_Fast_GET_SIZE(seq)
    cdef PyObject** items
    cdef PyObject* item
    cdef long long value
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(1, [n], cnp.NPY_INT32, 0)
    cdef int32_t* dst = <int32_t*>cnp.PyArray_DATA(out)
    # The items are read only now, after the one allocation, with nothing in between that
    # could run Python code (a list's item array moves when the list grows).
    items = PySequence_Fast_ITEMS(seq)
    for i in range(n):
        item = items[i]
        if not PyLong_CheckExact(item):
            return None
        value = hkv_token_value(item)
        if value < 0:
            name = what if request < 0 else f"{what}[{request}].tokens"
            raise ValueError(f"{name}[{i}] = {<object>item} is outside [0, 2**31)")
        dst[i] = <int32_t>value
    return out


# -- any input -------------------------------------------------------------------------------------

def as_tokens(tokens, what="tokens", private=False):
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
            copy = checked_copy(tokens)
            if copy is None:
                _raise_out_of_range(tokens, what)
            return copy
        if first_bad_token(tokens) >= 0:
            _raise_out_of_range(tokens, what)
        return tokens
    if type(tokens) is list or type(tokens) is tuple:
        # The engines' own format, read in one C loop into a new array; None: not all
        # plain ints.
        arr = tokens_from_sequence(tokens, what)
        if arr is not None:
            return arr
    arr = _as_int32_array(tokens, what)
    if private and (arr is tokens or arr.base is not None):
        arr = arr.copy()
    return arr


def _as_int32_array(tokens, what):
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
        if first_bad_token(arr) >= 0:
            _raise_out_of_range(arr, what)
        return arr
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= TOKEN_LIMIT):
        _raise_out_of_range(arr, what)
    return arr.astype(np.int32)


def _refuse_bools(tokens, arr, what):
    """numpy turns True and False among integers into 1 and 0: look at the elements that
    became 0 or 1 (few, in real prompts), not at every element."""
    for i in np.flatnonzero(arr <= 1).tolist():
        if is_bool(tokens[i]):
            raise ValueError(f"{what}[{i}] is {tokens[i]!r}: token ids must be integers, "
                             "not bools")


def _raise_out_of_range(arr, what):
    bad = np.nonzero((arr < 0) | (arr >= TOKEN_LIMIT))[0][0]
    raise ValueError(f"{what}[{bad}] = {int(arr[bad])} is outside [0, 2**31)")


def as_seq_id(seq_id):
    """Returns a sequence id as an int in [-2**63, 2**63), or raises SequenceError."""
    if type(seq_id) is int and _INT64_MIN <= seq_id <= _INT64_MAX:
        return seq_id
    return int_in(seq_id, _INT64_MIN, _INT64_MAX + 1, SequenceError, "sequence ids",
                  "integers", "fit int64")


def as_namespace(namespace):
    """Returns the namespace as an int in [0, 2**64), or raises ValueError."""
    if type(namespace) is int and 0 <= namespace < NAMESPACE_LIMIT:
        return namespace
    return int_in(namespace, 0, NAMESPACE_LIMIT, ValueError, "namespace",
                  "an integer in [0, 2**64)", "be in [0, 2**64)")
