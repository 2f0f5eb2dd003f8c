# cython: language_level=3, embedsignature=True
"""The WorkerView's public value types: SequenceRequest and SequenceAllocation.

Immutable records with value equality, hashing and a repr, as frozen dataclasses have (they
were frozen dataclasses before): compiled because an engine makes a request and gets an
allocation for every sequence it starts, and a Python __init__ each cost more than the rest
of the view's Python for a short prompt. worker_view re-exports both; their fields are read
and filled from C by _sequences.

Fields are not checked here: an allocation checks a request's id, tokens and namespace, in
the order the view documents, so that a bad one is refused before anything changes.

They are not dataclasses (dataclasses.replace, fields and asdict do not apply): a subclass
adds its own fields in its own __init__, after calling this one's.
"""


cdef class ValueRecord:
    """What SequenceRequest and SequenceAllocation share: the fields their __match_args__
    name, compared, hashed, shown and pickled together, as a frozen dataclass's are."""

    cdef int set_fields(self, tuple values) except -1:
        raise NotImplementedError

    def _fields(self):
        # Read as Python code reads them: a subclass may make a field a property.
        return tuple([getattr(self, name) for name in type(self).__match_args__])

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self):
        return hash(self._fields())

    def __repr__(self):
        shown = ", ".join([f"{name}={value!r}"
                           for name, value in zip(type(self).__match_args__, self._fields())])
        return f"{type(self).__qualname__}({shown})"

    def __reduce__(self):
        # Rebuilt without the class's __init__ (a subclass's may take other arguments);
        # pickle then restores what a subclass keeps in its __dict__.
        state = getattr(self, "__dict__", None)
        return rebuilt, (type(self), self._fields()), (dict(state) if state else None)


def rebuilt(cls, tuple values):
    """Unpickles a SequenceRequest or SequenceAllocation (or a subclass): its fields, in
    __match_args__ order; pickle then restores any state of the subclass."""
    cdef ValueRecord record = cls.__new__(cls)
    record.set_fields(values)
    return record


cdef class SequenceRequest(ValueRecord):
    """A sequence to allocate: its id (unique within the view), prompt tokens, namespace.

    Attributes:
        seq_id: An int64 id, unique among the view's live sequences.
        tokens: The prompt's token ids (list, tuple, array('i'), numpy or CPU torch
            integers), non-empty.
        namespace: Prefixes never match across namespaces (tenant, model, LoRA, cache salt).
    """

    __match_args__ = ("seq_id", "tokens", "namespace")

    def __init__(self, seq_id, tokens, namespace=0):
        self.seq_id = seq_id
        self.tokens = tokens
        self.namespace = namespace

    cdef int set_fields(self, tuple values) except -1:
        self.seq_id, self.tokens, self.namespace = values
        return 0


cdef class SequenceAllocation(ValueRecord):
    """What the engine needs to run a newly allocated sequence.

    Attributes:
        seq_id: The request's id.
        reused_tokens: Leading prompt tokens whose KV is already in the pages (a multiple of
            page_size, always less than the prompt's length).
        page_table: np.int32 pages for the prompt's tokens, in order (read-only).
        page_size: Tokens per page.
    """

    __match_args__ = ("seq_id", "reused_tokens", "page_table", "page_size")

    def __init__(self, seq_id, reused_tokens, page_table, page_size):
        self.seq_id = seq_id
        self.reused_tokens = reused_tokens
        self.page_table = page_table
        self.page_size = page_size

    cdef int set_fields(self, tuple values) except -1:
        self.seq_id, self.reused_tokens, self.page_table, self.page_size = values
        return 0

    @property
    def num_shared_pages(self):
        """Leading pages borrowed from the cache: shared with other sequences, read-only."""
        return self.reused_tokens // self.page_size

    @property
    def write_from_token(self):
        """The first token whose KV the engine must compute and write (== reused_tokens)."""
        return self.reused_tokens


cdef SequenceAllocation new_allocation(object seq_id, object reused_tokens, object page_table,
                                       object page_size):
    """A SequenceAllocation filled from C, without parsing __init__'s arguments."""
    cdef SequenceAllocation allocation = SequenceAllocation.__new__(SequenceAllocation)
    allocation.seq_id = seq_id
    allocation.reused_tokens = reused_tokens
    allocation.page_table = page_table
    allocation.page_size = page_size
    return allocation
