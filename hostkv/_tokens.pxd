# Token ids, sequence ids and namespaces at the API boundary, for the compiled calls to
# cimport: the checks and reads in C that the engines' own formats (int32 arrays, lists of
# ints) go through. At the bottom of the stack: nothing here knows a segment.

cimport numpy as cnp

cdef int check_i32(cnp.ndarray arr, str what) except -1
# A new int32 array holding the tokens, or None when the general path (as_tokens) must decide.
cdef object sequence_tokens(object seq, str what, Py_ssize_t request)
cdef object checked_i32_copy(cnp.ndarray tokens)
