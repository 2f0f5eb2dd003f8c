"""Type stubs for hostkv._slab: it has no Python-level names (its functions are cdef)."""
