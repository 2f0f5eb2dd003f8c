"""Configuration of a hostkv segment: :class:`HostKVConfig` and :class:`KVLayout`.

A config is validated when it is built, so a bad value is a :class:`~hostkv.errors.ConfigError`
(also a ``ValueError``) naming the field and the value, before any shared memory exists.
Capacities left at 0 mean "derive"; :meth:`HostKVConfig.apply_runtime_defaults` returns the
resolved config, which is the one stored in the segment header.

This module must stay importable without torch (and without numpy): torch dtypes are
recognised by their ``str()``, numpy dtypes only when numpy is already imported.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import sys
import types
from typing import Any, Callable, Mapping, Optional, Tuple

from hostkv._validate import as_index, describe, is_bool, positive_index
from hostkv.errors import ConfigError

__all__ = ["DTYPE_CODES", "KV_KINDS", "MAX_STATE_LAYER", "HostKVConfig", "KVLayout",
           "dtype_from_code"]

# Records address each other by int32 index, so every count of records (and the number of
# token slots, num_pages * page_size) must stay below this.
_INT32_LIMIT = 2**31

# The page pool is num_pages * page_bytes bytes; 64 TiB is far beyond any host's memory and
# keeps every byte offset well inside int64 arithmetic in the compiled layer.
_MAX_POOL_BYTES = 2**46

_MAX_PAGE_SIZE = 65536
_MAX_PROCESSES = 4096
# The smallest mutations (registering a lease, one radix insert) log a few dozen stores.
_MIN_UNDO_LOG = 256

_ENV_PREFIX_REUSE = "HOSTKV_ENABLE_PREFIX_REUSE"

#: Stable small-integer code of each supported KV dtype. The code, not the name, is stored
#: in the segment header, so these values must never change; new dtypes get new codes.
DTYPE_CODES: Mapping[str, int] = types.MappingProxyType(
    {
        "float16": 1,
        "bfloat16": 2,
        "float32": 3,
        "float64": 4,
        "float8_e4m3fn": 5,
        "float8_e5m2": 6,
        "int8": 7,
        "uint8": 8,
    }
)

_ITEMSIZES: Mapping[str, int] = types.MappingProxyType(
    {
        "float16": 2,
        "bfloat16": 2,
        "float32": 4,
        "float64": 8,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
        "int8": 1,
        "uint8": 1,
    }
)

# The segment header records KVLayout.state_layers as a bitmap of this many layers.
MAX_STATE_LAYER = 1024

# What a page's bytes hold (KVLayout.kind), by the code stored in the segment header.
KV_KINDS: Mapping[str, int] = types.MappingProxyType({"mha": 0, "mla": 1})

_CODE_TO_DTYPE: Mapping[int, str] = types.MappingProxyType(
    {code: name for name, code in DTYPE_CODES.items()}
)


def dtype_from_code(code: int) -> str:
    """Return the dtype name stored in a segment header as ``code``.

    Args:
        code: A value of :data:`DTYPE_CODES`.

    Returns:
        The dtype's name, e.g. ``"bfloat16"``.

    Raises:
        ConfigError: ``code`` is not a known dtype code.
    """
    if is_bool(code) or not isinstance(code, int) or code not in _CODE_TO_DTYPE:
        raise ConfigError(
            f"dtype code must be one of {sorted(_CODE_TO_DTYPE)}, got {code!r}"
        )
    return _CODE_TO_DTYPE[code]


def _dtype_name(dtype: Any) -> str:
    """Normalise a dtype given as a name, a torch dtype or a numpy dtype to its name."""
    name: Optional[str] = None
    if isinstance(dtype, str):
        name = dtype
    elif str(dtype).startswith("torch."):
        # torch.float16 prints as "torch.float16"; matching the text keeps torch unimported.
        name = str(dtype)
    else:
        numpy = sys.modules.get("numpy")
        # A numpy dtype can only exist if numpy is already imported: no need to import it.
        if numpy is not None:
            if isinstance(dtype, numpy.dtype):
                name = dtype.name
            elif isinstance(dtype, type) and issubclass(dtype, numpy.generic):
                name = numpy.dtype(dtype).name
    if name is not None and name.startswith("torch."):
        name = name[len("torch."):]
    if name is None or name not in DTYPE_CODES:
        raise ConfigError(
            f"KVLayout.dtype must be one of {', '.join(DTYPE_CODES)}, got {dtype!r}"
        )
    return name


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """The shape of the KV cache one page holds: the canonical layout of a page's bytes.

    A page's bytes mean the same KV to every engine that reads them, whatever attention
    backend, tensor-parallel degree or device wrote them (the copy engine maps each
    engine's blocks onto this layout):

    - ``kind="mha"`` (multi-head, grouped-query and multi-query attention): for each layer,
      K then V for ``page_size`` tokens, each token's K (or V) ``[num_kv_heads, head_dim]``:
      the page is ``(num_layers, 2, page_size, num_kv_heads, head_dim)``, C-contiguous.
      ``num_kv_heads`` is the model's total (a tensor-parallel rank holds a slice).
    - ``kind="mla"`` (multi-head latent attention, DeepSeek-V2/V3): one latent vector of
      ``head_dim`` elements per token and layer, no K/V split: the page is
      ``(num_layers, page_size, head_dim)``; ``num_kv_heads`` is 1.

    A model with recurrent-state layers (Mamba, Gated DeltaNet and other linear attention)
    names them in ``state_layers``: such a layer's slot of the page (its bytes of the shape
    above) holds the layer's state after the page's last token instead of K/V, in bytes
    whose layout the engine integration defines (``hostkv.vllm.state``) and keys apart in
    its namespace.

    A model whose attention layers keep only a window of recent tokens (sliding-window,
    chunked-local) may name them in ``window_layers``: their KV leaves the page for the
    page's window part (``HostKVConfig.num_parts``), which a hit needs only near its end.
    The page then holds the other layers (:attr:`page_layers`, in order) and the part the
    window layers, each in the shape above over its own layers (:meth:`page_shape`,
    :meth:`part_shape`); :meth:`slot` says where a layer's bytes are.

    Attributes:
        num_layers: Transformer layers, > 0.
        num_kv_heads: KV heads per layer (after GQA/MQA grouping, before tensor
            parallelism), > 0; 1 for ``"mla"``.
        head_dim: Elements per head (the latent size for ``"mla"``), > 0.
        dtype: Element type, one of the names in :data:`DTYPE_CODES`. A numpy dtype or a
            torch dtype is accepted and stored as its name (``torch.bfloat16`` becomes
            ``"bfloat16"``).
        kind: ``"mha"`` or ``"mla"`` (see above; the codes are :data:`KV_KINDS`).
        state_layers: The layers whose slot holds a recurrent state, increasing, each below
            ``num_layers`` and :data:`MAX_STATE_LAYER`; at least one layer holds K/V. A
            list is accepted and stored as a tuple.
        window_layers: The layers whose KV lives in window parts, increasing, each below
            ``num_layers`` and :data:`MAX_STATE_LAYER`, none a state layer, leaving one
            layer in the page. A list is accepted and stored as a tuple.

    Raises:
        ConfigError: A field is not a positive integer, the dtype or kind is not supported,
            an ``"mla"`` layout has more than one KV head, or ``state_layers`` is not
            increasing layers of the layout below :data:`MAX_STATE_LAYER` that leave one
            K/V layer, or ``window_layers`` is not increasing layers below it that leave
            one layer in the page and name no state layer.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    kind: str = "mha"
    state_layers: Tuple[int, ...] = ()
    window_layers: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # object.__setattr__: the dataclass is frozen, and normalising here keeps equality
        # and hashing on canonical values (numpy int 8 and int 8 give equal layouts).
        for field in ("num_layers", "num_kv_heads", "head_dim"):
            value = positive_index(getattr(self, field), f"KVLayout.{field}", ConfigError)
            object.__setattr__(self, field, value)
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        if self.kind not in KV_KINDS:
            raise ConfigError(f"KVLayout.kind must be one of {', '.join(KV_KINDS)}, "
                              f"got {self.kind!r}")
        if self.kind == "mla" and self.num_kv_heads != 1:
            raise ConfigError(f"KVLayout of kind 'mla' holds one latent vector per token: "
                              f"num_kv_heads must be 1, got {self.num_kv_heads}")
        state = self._layer_list("state_layers", "leaving one K/V layer",
                                 lambda layers: True)
        object.__setattr__(self, "state_layers", state)
        window = self._layer_list(
            "window_layers", f"none of state_layers {list(state)}, leaving one layer in the "
            "page", lambda layers: not set(layers) & set(state))
        object.__setattr__(self, "window_layers", window)

    def _layer_list(self, field: str, rule: str,
                    allowed: Callable[[Tuple[int, ...]], bool]) -> Tuple[int, ...]:
        """The layers ``field`` names, as plain ints: increasing, below num_layers and the
        header's bitmap, leaving one layer out, and ``allowed``; else ConfigError."""
        try:
            layers = tuple(operator.index(layer) for layer in getattr(self, field))
        except TypeError:
            raise ConfigError(f"KVLayout.{field} must be layer indices, got "
                              f"{getattr(self, field)!r}") from None
        if (list(layers) != sorted(set(layers)) or any(layer < 0 for layer in layers)
                or (layers and layers[-1] >= min(self.num_layers, MAX_STATE_LAYER))
                or len(layers) >= self.num_layers or not allowed(layers)):
            raise ConfigError(
                f"KVLayout.{field} must be increasing layers below num_layers "
                f"{self.num_layers} and {MAX_STATE_LAYER}, {rule}; got {list(layers)}")
        return layers

    @property
    def itemsize(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return _ITEMSIZES[self.dtype]

    @property
    def dtype_code(self) -> int:
        """The code of :attr:`dtype` stored in the segment header (see :data:`DTYPE_CODES`)."""
        return DTYPE_CODES[self.dtype]

    @property
    def kind_code(self) -> int:
        """The code of :attr:`kind` stored in the segment header (see :data:`KV_KINDS`)."""
        return KV_KINDS[self.kind]

    @property
    def kv_planes(self) -> int:
        """2 for ``"mha"`` (K and V), 1 for ``"mla"`` (the latent vector)."""
        return 2 if self.kind == "mha" else 1

    @property
    def page_layers(self) -> Tuple[int, ...]:
        """The layers a page holds, in order: every layer but :attr:`window_layers`."""
        window = set(self.window_layers)
        return tuple(layer for layer in range(self.num_layers) if layer not in window)

    def slot(self, layer: int) -> Tuple[str, int]:
        """Where ``layer``'s bytes are: ``("page", i)``, the i-th layer of the page's shape,
        or ``("part", j)``, the j-th of the window part's.

        Raises:
            ConfigError: ``layer`` is not a layer of this layout.
        """
        if not 0 <= layer < self.num_layers:
            raise ConfigError(f"layer {layer} is not one of the layout's {self.num_layers}")
        if layer in self.window_layers:
            return ("part", self.window_layers.index(layer))
        return ("page", layer - sum(1 for w in self.window_layers if w < layer))

    @property
    def layer_token_bytes(self) -> int:
        """Bytes of KV per token of one layer: K and V (or the latent), every head."""
        return self.kv_planes * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def token_bytes(self) -> int:
        """Bytes per token a page holds: K and V (or the latent) of every page layer
        (all layers but :attr:`window_layers`), every head and element."""
        return (self.num_layers - len(self.window_layers)) * self.layer_token_bytes

    @property
    def window_token_bytes(self) -> int:
        """Bytes per token a window part holds: the :attr:`window_layers`' KV (0: none)."""
        return len(self.window_layers) * self.layer_token_bytes

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page of ``page_size`` tokens.

        Args:
            page_size: Tokens per page, > 0.

        Returns:
            ``page_size * token_bytes``.

        Raises:
            ConfigError: ``page_size`` is not a positive integer.
        """
        return positive_index(page_size, "page_size", ConfigError) * self.token_bytes

    def page_shape(self, page_size: int) -> Tuple[int, ...]:
        """Shape of one page viewed as an array of :attr:`dtype`.

        Args:
            page_size: Tokens per page, > 0.

        Returns:
            ``(layers, 2, page_size, num_kv_heads, head_dim)`` for ``"mha"``: for each
            of the page's layers (:attr:`page_layers`), K (index 0) then V (index 1), each
            ``[page_size, num_kv_heads, head_dim]``; ``(layers, page_size, head_dim)`` for
            ``"mla"``.

        Raises:
            ConfigError: ``page_size`` is not a positive integer.
        """
        return self._shape(self.num_layers - len(self.window_layers), page_size)

    def part_bytes(self, page_size: int) -> int:
        """Bytes of one window part of ``page_size`` tokens: 0 without window layers.

        Raises:
            ConfigError: ``page_size`` is not a positive integer.
        """
        return positive_index(page_size, "page_size", ConfigError) * self.window_token_bytes

    def part_shape(self, page_size: int) -> Tuple[int, ...]:
        """Shape of one window part: :meth:`page_shape`'s over the :attr:`window_layers`.

        Raises:
            ConfigError: ``page_size`` is not a positive integer, or the layout has no
                window layers.
        """
        if not self.window_layers:
            raise ConfigError("a KVLayout without window_layers has no window part")
        return self._shape(len(self.window_layers), page_size)

    def _shape(self, layers: int, page_size: int) -> Tuple[int, ...]:
        page_size = positive_index(page_size, "page_size", ConfigError)
        if self.kind == "mla":
            return (layers, page_size, self.head_dim)
        return (layers, 2, page_size, self.num_kv_heads, self.head_dim)


# Fields where 0 means "derive in apply_runtime_defaults".
_DERIVED_FIELDS = (
    "radix_node_capacity",
    "sequence_page_node_capacity",
    "max_sequences",
    "max_processes",
    "undo_log_capacity",
)


def _env_prefix_reuse() -> Optional[bool]:
    """Read HOSTKV_ENABLE_PREFIX_REUSE: None when unset or empty, else its boolean value."""
    raw = os.environ.get(_ENV_PREFIX_REUSE)
    # An empty value counts as unset, so `HOSTKV_ENABLE_PREFIX_REUSE= cmd` clears it.
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value in ("1", "true"):
        return True
    if value in ("0", "false"):
        return False
    raise ConfigError(
        f"{_ENV_PREFIX_REUSE} must be 0, 1, false or true, got {raw!r}"
    )


def _undo_per_part(radix_node_capacity: int) -> int:
    """Undo-log entries a window part may cost one mutation: its eviction from a one-page
    node used since it entered the part heap (a re-key and its sift, then the removal and
    its sift: 2 stores a level each), and its hand-out. Measured: 68 a part for 16,384
    such nodes (budget 76), 80 for 131,072 (budget 88)."""
    return 16 + 4 * max(1, radix_node_capacity).bit_length()


@dataclasses.dataclass(frozen=True)
class HostKVConfig:
    """The configuration of one segment.

    Give the page size in bytes either as ``page_bytes`` or as a ``kv_layout`` (which
    derives it); when both are given they must agree. Capacities set to 0 are derived by
    :meth:`apply_runtime_defaults`; a config stored in a segment is always resolved.

    Attributes:
        num_pages: Pages in the pool, > 0 and < 2**31.
        page_size: Tokens per page: a power of two, at most 65536. Only full pages are
            reusable.
        page_bytes: Bytes per page. 0 means "take it from ``kv_layout``".
        kv_layout: The KV shape of a page, or None when only ``page_bytes`` is known (the
            pool is then raw bytes to the cache).
        enable_prefix_reuse: Whether allocation matches and borrows cached prefixes and
            commit caches pages. Overridden by the environment variable
            ``HOSTKV_ENABLE_PREFIX_REUSE`` (``0``/``1``/``false``/``true``) in
            :meth:`apply_runtime_defaults`.
        prefix_min_reuse_pages: The fewest matched pages worth borrowing, >= 1; a shorter
            match is ignored.
        prefix_min_store_pages: The fewest full pages worth committing to the tree, >= 1.
        radix_node_capacity: Radix-tree node records. 0 derives ``max(4096, num_pages // 2)``.
        sequence_page_node_capacity: Records of sequences' page lists (twelve pages each).
            0 derives ``ceil(num_pages / 12) + max_sequences``.
        max_sequences: Live sequences across all processes. 0 derives
            ``min(num_pages, 4096)``.
        max_processes: Lease slots, i.e. processes attached at once, at most 4096. 0
            derives 64.
        undo_log_capacity: Undo-log entries. 0 derives
            ``16 * num_pages + 64 * max_sequences + 65536 + (16 + 4 *
            bits(radix_node_capacity)) * num_parts``.
        num_parts: Window parts, 0 (the default) for none: records of ``part_bytes`` bytes
            in a second pool that a page may or may not have, for the KV a hit needs only
            near its end (a sliding-window layer's). Fresh pages take a part while one is
            free; a page's last reference frees its part. Must be < 2**31.
        part_bytes: Bytes per window part: > 0 exactly when ``num_parts`` is; 0 with a
            ``kv_layout`` that has window layers derives it (their KV for one page),
            and such a layout needs ``num_parts > 0``.

    Raises:
        ConfigError: A field has the wrong type or is out of range, ``page_bytes`` and
            ``kv_layout`` disagree or are both missing, a count would not fit an int32
            index, or the pool would exceed 2**46 bytes.
    """

    num_pages: int
    page_size: int = 16
    page_bytes: int = 0
    kv_layout: Optional[KVLayout] = None
    enable_prefix_reuse: bool = True
    prefix_min_reuse_pages: int = 1
    prefix_min_store_pages: int = 1
    radix_node_capacity: int = 0
    sequence_page_node_capacity: int = 0
    max_sequences: int = 0
    max_processes: int = 0
    undo_log_capacity: int = 0
    num_parts: int = 0
    part_bytes: int = 0

    def __post_init__(self) -> None:
        # Types first, normalised to plain ints (object.__setattr__: the class is frozen),
        # so every later check and the header writer see Python ints.
        for field in (
            "num_pages",
            "page_size",
            "page_bytes",
            "num_parts",
            "part_bytes",
            "prefix_min_reuse_pages",
            "prefix_min_store_pages",
        ) + _DERIVED_FIELDS:
            value = as_index(getattr(self, field), f"HostKVConfig.{field}", ConfigError)
            object.__setattr__(self, field, value)
        if not isinstance(self.enable_prefix_reuse, bool):
            raise ConfigError(
                "HostKVConfig.enable_prefix_reuse must be a bool, got "
                f"{describe(self.enable_prefix_reuse)}"
            )
        if self.kv_layout is not None and not isinstance(self.kv_layout, KVLayout):
            raise ConfigError(
                "HostKVConfig.kv_layout must be a KVLayout or None, got "
                f"{describe(self.kv_layout)}"
            )

        if self.num_pages <= 0:
            raise ConfigError(
                f"HostKVConfig.num_pages must be a positive integer, got {self.num_pages}"
            )
        page_size = self.page_size
        if page_size <= 0 or page_size & (page_size - 1) or page_size > _MAX_PAGE_SIZE:
            raise ConfigError(
                "HostKVConfig.page_size must be a power of two between 1 and "
                f"{_MAX_PAGE_SIZE}, got {page_size}"
            )
        if self.page_bytes < 0:
            raise ConfigError(
                f"HostKVConfig.page_bytes must be >= 0 (0: from kv_layout), got {self.page_bytes}"
            )
        for field in ("num_parts", "part_bytes"):
            if getattr(self, field) < 0:
                raise ConfigError(
                    f"HostKVConfig.{field} must be >= 0 (0: no window parts), "
                    f"got {getattr(self, field)}"
                )
        for field in ("prefix_min_reuse_pages", "prefix_min_store_pages"):
            if getattr(self, field) < 1:
                raise ConfigError(
                    f"HostKVConfig.{field} must be >= 1, got {getattr(self, field)}"
                )
        for field in _DERIVED_FIELDS:
            if getattr(self, field) < 0:
                raise ConfigError(
                    f"HostKVConfig.{field} must be >= 0 (0: derive), got {getattr(self, field)}"
                )
        if 0 < self.undo_log_capacity < _MIN_UNDO_LOG:
            raise ConfigError(
                f"HostKVConfig.undo_log_capacity must be 0 (derive) or at least {_MIN_UNDO_LOG}, "
                f"got {self.undo_log_capacity}"
            )
        if self.max_processes > _MAX_PROCESSES:
            raise ConfigError(
                f"HostKVConfig.max_processes must be at most {_MAX_PROCESSES}, "
                f"got {self.max_processes}"
            )

        if self.kv_layout is not None:
            layout_bytes = self.kv_layout.page_bytes(page_size)
            if self.page_bytes == 0:
                object.__setattr__(self, "page_bytes", layout_bytes)
            elif self.page_bytes != layout_bytes:
                raise ConfigError(
                    f"HostKVConfig.page_bytes is {self.page_bytes} but kv_layout gives "
                    f"{layout_bytes} bytes per page of {page_size} tokens"
                )
        elif self.page_bytes == 0:
            raise ConfigError(
                "HostKVConfig: give page_bytes or kv_layout "
                "(page_bytes is 0 and kv_layout is None)"
            )
        if self.kv_layout is not None and self.kv_layout.window_layers:
            # The window layers' KV has no room in the page: only parts hold it.
            part_bytes = self.kv_layout.part_bytes(page_size)
            if self.num_parts == 0:
                raise ConfigError(
                    f"HostKVConfig: kv_layout keeps window layers "
                    f"{list(self.kv_layout.window_layers)} in window parts, so num_parts "
                    "must be > 0"
                )
            if self.part_bytes == 0:
                object.__setattr__(self, "part_bytes", part_bytes)
            elif self.part_bytes != part_bytes:
                raise ConfigError(
                    f"HostKVConfig.part_bytes is {self.part_bytes} but kv_layout gives "
                    f"{part_bytes} bytes per window part of {page_size} tokens"
                )
        if (self.num_parts == 0) != (self.part_bytes == 0):
            raise ConfigError(
                "HostKVConfig.num_parts and part_bytes must both be 0 (no window parts) or "
                f"both positive, got num_parts={self.num_parts}, part_bytes={self.part_bytes}"
            )

        for field in ("num_pages", "num_parts") + _DERIVED_FIELDS:
            value = getattr(self, field)
            if value >= _INT32_LIMIT:
                raise ConfigError(
                    f"HostKVConfig.{field} must be < 2**31 (int32 indexes), got {value}"
                )
        token_slots = self.num_pages * page_size
        if token_slots >= _INT32_LIMIT:
            raise ConfigError(
                f"HostKVConfig.num_pages * page_size must be < 2**31 token slots (int32 "
                f"indexes), got {self.num_pages} * {page_size} = {token_slots}"
            )
        pool_bytes = self.num_pages * self.page_bytes
        if pool_bytes > _MAX_POOL_BYTES:
            raise ConfigError(
                f"HostKVConfig.num_pages * page_bytes must be at most 2**46 bytes, got "
                f"{self.num_pages} * {self.page_bytes} = {pool_bytes}"
            )
        part_pool_bytes = self.num_parts * self.part_bytes
        if part_pool_bytes > _MAX_POOL_BYTES:
            raise ConfigError(
                f"HostKVConfig.num_parts * part_bytes must be at most 2**46 bytes, got "
                f"{self.num_parts} * {self.part_bytes} = {part_pool_bytes}"
            )

    @property
    def is_resolved(self) -> bool:
        """True when no capacity is left at 0 ("derive"); see :meth:`apply_runtime_defaults`."""
        return all(getattr(self, field) != 0 for field in _DERIVED_FIELDS)

    def apply_runtime_defaults(self) -> HostKVConfig:
        """Return the resolved config: every 0 capacity derived, environment applied.

        Derived values (only where the field is 0):

        - ``radix_node_capacity``: ``max(4096, num_pages // 2)``; nodes span several pages,
          so half a node per page is plenty, with a floor for small pools.
        - ``max_sequences``: ``min(num_pages, 4096)``; a live sequence holds at least one page.
        - ``sequence_page_node_capacity``: ``ceil(num_pages / 12) + max_sequences``: a page
          is in one sequence's page list at most, a record lists twelve, and each sequence's
          last record may be part full, so every page of the pool fits.
        - ``max_processes``: 64.
        - ``undo_log_capacity``: ``16 * num_pages + 64 * max_sequences + 65536 + (16 + 4 *
          bits(radix_node_capacity)) * num_parts`` (with max_sequences and
          radix_node_capacity resolved first; bits is int.bit_length): every store to shared state
          during a mutation is logged before it is made. Measured (layout 7): a batch
          allocation logs about 1 entry per page and 17 per sequence, a release with
          commit about 1.2 per page and 44 per sequence, one without commit about 4 per
          page (each page it frees), so a batch of every page and every sequence fits,
          with room for eviction. Window parts add their worst case: one allocation may
          evict every part of the tree, one node at a time (5 stores for the part, 4 for
          the node's count and the totals, a re-key of a node used since it entered the
          part heap and a removal from it, each sifting an entry: up to 2 stores a level
          each), and then hand each out (2 stores).

        ``HOSTKV_ENABLE_PREFIX_REUSE``, when set to ``0``, ``1``, ``false`` or ``true``
        (any case), overrides ``enable_prefix_reuse``; empty counts as unset.

        Applying it to a resolved config returns an equal config (it is idempotent).

        Returns:
            A new :class:`HostKVConfig` with :attr:`is_resolved` true.

        Raises:
            ConfigError: The environment variable has another value, or a derived value
                would not fit an int32 index (set that field explicitly).
        """
        derived = {
            "radix_node_capacity": max(4096, self.num_pages // 2),
            "max_sequences": min(self.num_pages, 4096),
            "max_processes": 64,
        }
        max_sequences = self.max_sequences or derived["max_sequences"]
        # A page is in one sequence's list at most, twelve to a record, and each sequence's
        # last record may be part full.
        derived["sequence_page_node_capacity"] = -(-self.num_pages // 12) + max_sequences
        node_capacity = self.radix_node_capacity or derived["radix_node_capacity"]
        derived["undo_log_capacity"] = (16 * self.num_pages + 64 * max_sequences + 65536
                                        + _undo_per_part(node_capacity) * self.num_parts)
        changes: dict = {}
        for field, value in derived.items():
            if getattr(self, field) != 0:
                continue
            if value >= _INT32_LIMIT:
                raise ConfigError(
                    f"HostKVConfig.{field} derived from num_pages={self.num_pages} is "
                    f"{value}, which does not fit an int32 index; set {field} explicitly"
                )
            changes[field] = value
        reuse = _env_prefix_reuse()
        if reuse is not None:
            changes["enable_prefix_reuse"] = reuse
        # replace() runs __post_init__ again, so the resolved config is validated whole.
        return dataclasses.replace(self, **changes)
