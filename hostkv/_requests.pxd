# The WorkerView's public value types, compiled: a request to allocate and what an allocation
# hands back. Declared here so that _sequences reads and fills their fields as C struct
# members (no attribute lookups, no Python __init__ per request).

cdef class SequenceRequest:
    cdef readonly object seq_id
    cdef readonly object tokens
    cdef readonly object namespace
    cdef object __weakref__
    cdef tuple fields(self)


cdef class SequenceAllocation:
    cdef readonly object seq_id
    cdef readonly object reused_tokens
    cdef readonly object page_table
    cdef readonly object page_size
    cdef object __weakref__
    cdef tuple fields(self)


cdef SequenceAllocation new_allocation(object seq_id, object reused_tokens, object page_table,
                                       object page_size)
