"""Keys and values of the remote tier: chained page hashes and self-checking page records.

Keys. Page i of a token sequence is stored under

    key_prefix ":" hex(BLAKE2b-128(namespace, layout fingerprint, key of page i-1, tokens of page i))

so every host computes the same key for the same prefix, a page's key commits to everything
before it (a page is only ever found after the pages it follows), and namespaces (tenants,
models, salts) and layouts never share a key. BLAKE2b, not Python's ``hash``: the keys cross
processes and machines, and must not collide by construction.

Values. A value is a fixed header, the page's token ids, then its KV bytes:

    magic "HKVR" | format u16 | flags u16 | layout fingerprint 16 B | page_size u32 |
    kv length u32 | crc32 of the KV bytes u32 | namespace u64 | key digest 16 B |
    token ids (page_size x i32 LE) | KV

:func:`decode_value` checks every field against what the reader expects (format, fingerprint,
page size, length, namespace, the key it was written under, the exact token ids, the
checksum) and says which check failed: a value that fails any is a miss, never loaded. The
key digest ties a value to its whole prefix, not only to its own page's tokens: a value of
another prefix whose page holds the same tokens (repeated text, a run of image placeholders)
that a store, a proxy or a bug hands back under this key is refused. A truncated value (a
node lost mid-write, a partial reply) fails the length check. CRC-32 (zlib: ~6 GB/s here, vs ~1.3 GB/s for BLAKE2b)
guards against corruption, not against an attacker who can write the server: such a writer
could forge any value, checksum included; keep the server private (password, TLS, network).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Any, List, Optional, Tuple, Union

import numpy as np

__all__ = [
    "FORMAT_VERSION",
    "HEADER",
    "chain_keys",
    "decode_value",
    "encode_value",
    "key_digest",
    "layout_fingerprint",
]

# 2: values name the key they were written under.
FORMAT_VERSION = 2
_MAGIC = b"HKVR"
# magic, format, flags, fingerprint, page_size, kv length, crc32, namespace, key digest
HEADER = struct.Struct("<4sHH16sIIIQ16s")
_DIGEST = 16

Buffer = Union[bytes, bytearray, memoryview]


def layout_fingerprint(config: Any) -> bytes:
    """16 bytes naming the page format: page size, bytes per page and the KV layout.

    Two segments whose pages mean the same bytes get the same fingerprint; anything that
    changes what a page's bytes mean (another layout, dtype or page size) changes it.
    """
    layout = config.kv_layout
    described = (f"hostkv-remote/{FORMAT_VERSION}|page_size={config.page_size}"
                 f"|page_bytes={config.page_bytes}")
    if layout is not None:
        # "canonical": pages hold KVLayout's one byte order whatever engine wrote them;
        # values written before pages were canonical named no order, so never match.
        described += (f"|canonical|kind={layout.kind}|layers={layout.num_layers}"
                      f"|kv_heads={layout.num_kv_heads}|head_dim={layout.head_dim}"
                      f"|dtype={layout.dtype}")
        if layout.state_layers:
            # Slots of state layers hold states, not K/V (their layout is in the namespace).
            described += f"|state_layers={','.join(map(str, layout.state_layers))}"
        if layout.window_layers:
            # Those layers' KV is in window parts, not in the page's bytes.
            described += f"|window_layers={','.join(map(str, layout.window_layers))}"
    return hashlib.blake2b(described.encode(), digest_size=_DIGEST).digest()


def chain_keys(prefix: bytes, namespace: int, fingerprint: bytes, tokens: np.ndarray,
               page_size: int, num_pages: int, previous: bytes = b"") -> List[bytes]:
    """The keys of the first num_pages full pages of tokens (np.int32), in order.

    Args:
        prefix: The key prefix, e.g. b"hostkv".
        namespace: The sequence's namespace (unsigned 64-bit).
        fingerprint: layout_fingerprint() of the segment's config.
        tokens: At least num_pages * page_size token ids.
        previous: The raw digest of the page before the first (b"" for page 0).
    """
    ids = np.ascontiguousarray(tokens[:num_pages * page_size], dtype="<i4")
    raw = ids.tobytes()
    head = struct.pack("<Q", namespace) + fingerprint
    step = page_size * 4
    keys = []
    digest = previous
    for i in range(num_pages):
        digest = hashlib.blake2b(head + digest + raw[i * step:(i + 1) * step],
                                 digest_size=_DIGEST).digest()
        keys.append(prefix + b":" + digest.hex().encode())
    return keys


def key_digest(key: bytes) -> bytes:
    """The raw chain digest a key of :func:`chain_keys` ends with.

    Raises:
        ValueError: a key that does not end with ":" and a digest's hex.
    """
    _, colon, tail = key.rpartition(b":")
    try:
        if colon and len(tail) == 2 * _DIGEST:
            return bytes.fromhex(tail.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        pass
    raise ValueError(f"not a hostkv remote key (key_prefix, ':', a {_DIGEST}-byte digest "
                     f"in hex): {key[:80]!r}")


def encode_value(fingerprint: bytes, namespace: int, tokens: np.ndarray, kv: Buffer, *,
                 key: bytes) -> bytes:
    """One page's value: header, token ids (np.int32, page_size of them), KV bytes; ``key``:
    the key it is stored under (:func:`chain_keys`), which the value names."""
    ids = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    kv_view = memoryview(kv).cast("B")
    header = HEADER.pack(_MAGIC, FORMAT_VERSION, 0, fingerprint, len(tokens), kv_view.nbytes,
                         zlib.crc32(kv_view), namespace, key_digest(key))
    return b"".join((header, ids, kv_view))


def decode_value(value: Optional[Buffer], fingerprint: bytes, namespace: int,
                 tokens: np.ndarray, page_bytes: int, *,
                 key: bytes) -> Tuple[Optional[memoryview], str]:
    """Checks a value fetched for one page and returns (its KV bytes, "") or (None, reason).

    Args:
        value: The bytes the server returned, or None for a missing key.
        fingerprint, namespace: What the reader expects.
        tokens: The page's expected token ids (np.int32, page_size of them).
        page_bytes: The expected KV length.
        key: The key the value was read from.

    Returns:
        reason is "missing", "truncated", "magic", "format", "layout", "namespace", "key",
        "tokens" or "checksum" when the value must not be loaded.
    """
    if value is None:
        return None, "missing"
    view = memoryview(value)
    page_size = len(tokens)
    expected = HEADER.size + 4 * page_size + page_bytes
    if view.nbytes < HEADER.size:
        return None, "truncated"
    (magic, version, _flags, value_fp, value_ps, kv_len, crc, value_ns,
     value_key) = HEADER.unpack_from(view)
    if magic != _MAGIC:
        return None, "magic"
    if version != FORMAT_VERSION:
        return None, "format"
    if value_fp != fingerprint or value_ps != page_size or kv_len != page_bytes:
        return None, "layout"
    if view.nbytes != expected:
        return None, "truncated"
    if value_ns != namespace:
        return None, "namespace"
    if value_key != key_digest(key):
        return None, "key"
    stored = np.frombuffer(view, dtype="<i4", count=page_size, offset=HEADER.size)
    if not np.array_equal(stored, tokens):
        return None, "tokens"
    kv = view[HEADER.size + 4 * page_size:]
    if zlib.crc32(kv) != crc:
        return None, "checksum"
    return kv, ""
