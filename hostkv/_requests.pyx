# cython: language_level=3, embedsignature=True
"""The WorkerView's public value types: SequenceRequest and SequenceAllocation.

Immutable records with value equality, hashing and a repr, as frozen dataclasses have (they
were ones until issue 12): compiled because an engine makes a request and gets an
allocation for every sequence it starts, and a Python __init__ each cost more than the rest
of the view's Python for a short prompt. worker_view re-exports both; their fields are read
and filled from C by _sequences.

Fields are not checked here: an allocation checks a request's id, tokens and namespace, in
the order the view documents, so that a bad one is refused before anything changes.

They are not dataclasses (dataclasses.replace, fields and asdict do not apply): a subclass
adds its own fields in its own __init__, after calling this one's.
"""


cdef class SequenceRequest:
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

    cdef tuple fields(self):
        if type(self) is SequenceRequest:
            return (self.seq_id, self.tokens, self.namespace)
        # A subclass may make a field a property: read what Python code reads.
        return (getattr(self, "seq_id"), getattr(self, "tokens"), getattr(self, "namespace"))

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self.fields() == (<SequenceRequest>other).fields()

    def __hash__(self):
        return hash(self.fields())

    def __repr__(self):
        seq_id, tokens, namespace = self.fields()
        return (f"{type(self).__qualname__}(seq_id={seq_id!r}, tokens={tokens!r}, "
                f"namespace={namespace!r})")

    def __reduce__(self):
        return rebuilt_request, (type(self), self.seq_id, self.tokens, self.namespace), \
            instance_state(self)


cdef class SequenceAllocation:
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

    @property
    def num_shared_pages(self):
        """Leading pages borrowed from the cache: shared with other sequences, read-only."""
        return self.reused_tokens // self.page_size

    @property
    def write_from_token(self):
        """The first token whose KV the engine must compute and write (== reused_tokens)."""
        return self.reused_tokens

    cdef tuple fields(self):
        if type(self) is SequenceAllocation:
            return (self.seq_id, self.reused_tokens, self.page_table, self.page_size)
        return (getattr(self, "seq_id"), getattr(self, "reused_tokens"),
                getattr(self, "page_table"), getattr(self, "page_size"))

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self.fields() == (<SequenceAllocation>other).fields()

    def __hash__(self):
        return hash(self.fields())

    def __repr__(self):
        seq_id, reused_tokens, page_table, page_size = self.fields()
        return (f"{type(self).__qualname__}(seq_id={seq_id!r}, "
                f"reused_tokens={reused_tokens!r}, page_table={page_table!r}, "
                f"page_size={page_size!r})")

    def __reduce__(self):
        return rebuilt_allocation, (type(self), self.seq_id, self.reused_tokens,
                                    self.page_table, self.page_size), instance_state(self)


cdef object instance_state(object instance):
    """What a subclass keeps beyond the fields (its __dict__), for pickle and copy to
    restore after the rebuild; None for the classes themselves."""
    state = getattr(instance, "__dict__", None)
    return dict(state) if state else None


def rebuilt_request(cls, seq_id, tokens, namespace):
    """Unpickles a SequenceRequest (or a subclass, without running its __init__, whose
    arguments may differ): the fields, then pickle restores any state of the subclass."""
    cdef SequenceRequest request = cls.__new__(cls)
    request.seq_id = seq_id
    request.tokens = tokens
    request.namespace = namespace
    return request


def rebuilt_allocation(cls, seq_id, reused_tokens, page_table, page_size):
    """Unpickles a SequenceAllocation (or a subclass), as rebuilt_request does."""
    cdef SequenceAllocation allocation = cls.__new__(cls)
    allocation.seq_id = seq_id
    allocation.reused_tokens = reused_tokens
    allocation.page_table = page_table
    allocation.page_size = page_size
    return allocation


cdef SequenceAllocation new_allocation(object seq_id, object reused_tokens, object page_table,
                                       object page_size):
    """A SequenceAllocation filled from C, without parsing __init__'s arguments."""
    cdef SequenceAllocation allocation = SequenceAllocation.__new__(SequenceAllocation)
    allocation.seq_id = seq_id
    allocation.reused_tokens = reused_tokens
    allocation.page_table = page_table
    allocation.page_size = page_size
    return allocation
