"""hostkv.remote: a shared second tier under the host segment, on Redis/Valkey (or another
store behind :class:`RemoteBackend`).

    import hostkv, hostkv.remote
    cache = hostkv.HostKVCache.attach("engine")
    tier = hostkv.remote.RemoteTier(cache, hostkv.remote.RemoteConfig("redis://kv:6379/0"))
    look = tier.lookup(prompt_tokens)        # early: queues, returns at once
    ...                                      # look.done() / look.wait(timeout)
    allocs = view.allocate_pages_for_sequences_with_prefix([...])   # reuses what arrived
    ...
    tier.release(view, seq_ids)              # release, then write the committed pages behind

Off unless an engine makes a RemoteTier: hostkv alone stays the default, and neither
``import hostkv`` nor ``import hostkv.remote`` needs redis-py (only building a Redis backend
does). See tier.py for the map of the tier (fetch.py reads, writer.py and evict.py write) and
codec.py for keys and values.
"""

from hostkv.remote.backend import (
    UNAVAILABLE,
    RedisBackend,
    RemoteBackend,
    RemoteError,
    RemoteFullError,
    backend_for,
)
from hostkv.remote.codec import chain_keys, decode_value, encode_value, layout_fingerprint
from hostkv.remote.config import ParsedURL, RemoteConfig, parse_url
from hostkv.remote.tier import RemoteLookup, RemoteStats, RemoteTier

__all__ = [
    "UNAVAILABLE",
    "ParsedURL",
    "RedisBackend",
    "RemoteBackend",
    "RemoteConfig",
    "RemoteError",
    "RemoteFullError",
    "RemoteLookup",
    "RemoteStats",
    "RemoteTier",
    "backend_for",
    "chain_keys",
    "decode_value",
    "encode_value",
    "layout_fingerprint",
    "parse_url",
]
