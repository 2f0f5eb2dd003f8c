# The WorkerView's public value types, compiled: a request to allocate and what an allocation
# hands back. Declared here so that _sequences reads and fills their fields as C struct
# members (no attribute lookups, no Python __init__ per request).

cdef class ValueRecord:
    cdef object __weakref__
    cdef int set_fields(self, tuple values) except -1


cdef class SequenceRequest(ValueRecord):
    cdef readonly object seq_id
    cdef readonly object tokens
    cdef readonly object namespace


cdef class SequenceAllocation(ValueRecord):
    cdef readonly object seq_id
    cdef readonly object reused_tokens
    cdef readonly object page_table
    cdef readonly object page_size


cdef SequenceAllocation new_allocation(object seq_id, object reused_tokens, object page_table,
                                       object page_size)
