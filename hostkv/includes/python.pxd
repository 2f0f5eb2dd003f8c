# The CPython API the token intake reads lists and tuples of ints with, beyond Cython's
# bundled cpython declarations, and hkv_token_value (compat.h).

from cpython.object cimport PyObject


cdef extern from "Python.h":
    bint PyLong_CheckExact(PyObject* obj) noexcept
    PyObject** PySequence_Fast_ITEMS(object seq) noexcept
    Py_ssize_t PySequence_Fast_GET_SIZE(object seq) noexcept


cdef extern from "includes/compat.h":
    long long hkv_token_value(PyObject* obj) noexcept
