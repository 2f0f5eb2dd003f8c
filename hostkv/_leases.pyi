"""Type stubs for hostkv._leases (robust mutexes and the lease thread)."""

MUTEX_KIND: int
MUTEX_KIND_OFFSET: int
