# cython: language_level=3, embedsignature=True
"""The WorkerView's public value types: SequenceRequest and SequenceAllocation.

Immutable records with value equality, hashing and a repr, as frozen dataclasses have (they
were ones until issue 12): compiled because an engine makes a request and gets an
allocation for every sequence it starts, and a Python __init__ each cost more than the rest
of the view's Python for a short prompt. worker_view re-exports both; their fields are read
and filled from C by _sequences.

Fields are not checked here: an allocation checks a request's id, tokens and namespace, in
the order the view documents, so that a bad one is refused before anything changes.
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
        return (self.seq_id, self.tokens, self.namespace)

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self.fields() == (<SequenceRequest>other).fields()

    def __hash__(self):
        return hash(self.fields())

    def __repr__(self):
        return (f"{type(self).__qualname__}(seq_id={self.seq_id!r}, tokens={self.tokens!r}, "
                f"namespace={self.namespace!r})")

    def __reduce__(self):
        return type(self), self.fields()


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
        return (self.seq_id, self.reused_tokens, self.page_table, self.page_size)

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self.fields() == (<SequenceAllocation>other).fields()

    def __hash__(self):
        return hash(self.fields())

    def __repr__(self):
        return (f"{type(self).__qualname__}(seq_id={self.seq_id!r}, "
                f"reused_tokens={self.reused_tokens!r}, page_table={self.page_table!r}, "
                f"page_size={self.page_size!r})")

    def __reduce__(self):
        return type(self), self.fields()


cdef SequenceAllocation new_allocation(object seq_id, object reused_tokens, object page_table,
                                       object page_size):
    """A SequenceAllocation filled from C, without parsing __init__'s arguments."""
    cdef SequenceAllocation allocation = SequenceAllocation.__new__(SequenceAllocation)
    allocation.seq_id = seq_id
    allocation.reused_tokens = reused_tokens
    allocation.page_table = page_table
    allocation.page_size = page_size
    return allocation
