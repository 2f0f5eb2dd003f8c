"""Tests of hostkv.config: validation of HostKVConfig and KVLayout, runtime defaults, env."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from hostkv.config import DTYPE_CODES, HostKVConfig, KVLayout, dtype_from_code
from hostkv.errors import ConfigError, HostKVError

ENV = "HOSTKV_ENABLE_PREFIX_REUSE"


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    # The developer's shell must not change what these tests see.
    monkeypatch.delenv(ENV, raising=False)


def small_layout(**kw):
    args = dict(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float16")
    args.update(kw)
    return KVLayout(**args)


# (test id, constructor, kwargs, field the message must name)
BAD_CONFIGS = [
    ("num_pages-zero", HostKVConfig, dict(num_pages=0, page_bytes=64), "num_pages"),
    ("num_pages-negative", HostKVConfig, dict(num_pages=-5, page_bytes=64), "num_pages"),
    ("num_pages-bool", HostKVConfig, dict(num_pages=True, page_bytes=64), "num_pages"),
    ("num_pages-float", HostKVConfig, dict(num_pages=10.0, page_bytes=64), "num_pages"),
    ("num_pages-str", HostKVConfig, dict(num_pages="10", page_bytes=64), "num_pages"),
    ("num_pages-none", HostKVConfig, dict(num_pages=None, page_bytes=64), "num_pages"),
    ("num_pages-int32", HostKVConfig, dict(num_pages=2**31, page_size=1, page_bytes=1),
     "num_pages"),
    ("token-slots-int32", HostKVConfig, dict(num_pages=2**27, page_size=16, page_bytes=1),
     "num_pages \\* page_size"),
    ("page_size-zero", HostKVConfig, dict(num_pages=8, page_size=0, page_bytes=64), "page_size"),
    ("page_size-12", HostKVConfig, dict(num_pages=8, page_size=12, page_bytes=64), "page_size"),
    ("page_size-negative", HostKVConfig, dict(num_pages=8, page_size=-16, page_bytes=64),
     "page_size"),
    ("page_size-too-large", HostKVConfig, dict(num_pages=8, page_size=131072, page_bytes=64),
     "page_size"),
    ("page_size-float", HostKVConfig, dict(num_pages=8, page_size=16.0, page_bytes=64),
     "page_size"),
    ("page_bytes-negative", HostKVConfig, dict(num_pages=8, page_bytes=-1), "page_bytes"),
    ("page_bytes-str", HostKVConfig, dict(num_pages=8, page_bytes="64"), "page_bytes"),
    ("neither-page_bytes-nor-layout", HostKVConfig, dict(num_pages=8), "page_bytes"),
    ("page_bytes-mismatch", HostKVConfig,
     dict(num_pages=8, page_bytes=1000, kv_layout=KVLayout(2, 4, 8)), "page_bytes"),
    ("kv_layout-wrong-type", HostKVConfig, dict(num_pages=8, kv_layout=(2, 4, 8)), "kv_layout"),
    ("pool-too-large", HostKVConfig, dict(num_pages=2**20, page_bytes=2**27), "page_bytes"),
    ("enable-not-bool", HostKVConfig, dict(num_pages=8, page_bytes=64, enable_prefix_reuse=1),
     "enable_prefix_reuse"),
    ("enable-str", HostKVConfig,
     dict(num_pages=8, page_bytes=64, enable_prefix_reuse="false"), "enable_prefix_reuse"),
    ("min-reuse-zero", HostKVConfig, dict(num_pages=8, page_bytes=64, prefix_min_reuse_pages=0),
     "prefix_min_reuse_pages"),
    ("min-store-zero", HostKVConfig, dict(num_pages=8, page_bytes=64, prefix_min_store_pages=0),
     "prefix_min_store_pages"),
    ("radix-negative", HostKVConfig, dict(num_pages=8, page_bytes=64, radix_node_capacity=-1),
     "radix_node_capacity"),
    ("seq-nodes-negative", HostKVConfig,
     dict(num_pages=8, page_bytes=64, sequence_page_node_capacity=-1),
     "sequence_page_node_capacity"),
    ("max_sequences-negative", HostKVConfig, dict(num_pages=8, page_bytes=64, max_sequences=-1),
     "max_sequences"),
    ("max_sequences-int32", HostKVConfig,
     dict(num_pages=8, page_bytes=64, max_sequences=2**31), "max_sequences"),
    ("undo-negative", HostKVConfig, dict(num_pages=8, page_bytes=64, undo_log_capacity=-3),
     "undo_log_capacity"),
    ("undo-too-small", HostKVConfig, dict(num_pages=8, page_bytes=64, undo_log_capacity=10),
     "undo_log_capacity"),
    ("undo-int32", HostKVConfig, dict(num_pages=8, page_bytes=64, undo_log_capacity=2**31),
     "undo_log_capacity"),
    ("max_processes-too-large", HostKVConfig, dict(num_pages=8, page_bytes=64, max_processes=4097),
     "max_processes"),
    ("max_processes-negative", HostKVConfig, dict(num_pages=8, page_bytes=64, max_processes=-1),
     "max_processes"),
    ("layout-num_layers-zero", KVLayout, dict(num_layers=0, num_kv_heads=4, head_dim=8),
     "num_layers"),
    ("layout-num_kv_heads-negative", KVLayout, dict(num_layers=2, num_kv_heads=-4, head_dim=8),
     "num_kv_heads"),
    ("layout-head_dim-bool", KVLayout, dict(num_layers=2, num_kv_heads=4, head_dim=True),
     "head_dim"),
    ("layout-head_dim-float", KVLayout, dict(num_layers=2, num_kv_heads=4, head_dim=8.0),
     "head_dim"),
    ("layout-bad-dtype", KVLayout, dict(num_layers=2, num_kv_heads=4, head_dim=8, dtype="fp16"),
     "dtype"),
    ("layout-int64-dtype", KVLayout,
     dict(num_layers=2, num_kv_heads=4, head_dim=8, dtype=np.int64), "dtype"),
    ("layout-dtype-none", KVLayout,
     dict(num_layers=2, num_kv_heads=4, head_dim=8, dtype=None), "dtype"),
]


@pytest.mark.parametrize(
    "ctor, kwargs, field", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS]
)
def test_bad_config_raises_config_error_naming_field(ctor, kwargs, field):
    with pytest.raises(ConfigError, match=field) as info:
        ctor(**kwargs)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, HostKVError)


def test_message_names_the_value():
    with pytest.raises(ConfigError, match="page_size .*got 12"):
        HostKVConfig(num_pages=8, page_size=12, page_bytes=64)
    with pytest.raises(ConfigError, match="KVLayout.num_layers must be a positive integer, got 0"):
        KVLayout(0, 4, 8)


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(ConfigError, HostKVError)


def test_page_bytes_only():
    cfg = HostKVConfig(num_pages=10, page_bytes=4096)
    assert cfg.page_size == 16
    assert cfg.page_bytes == 4096
    assert cfg.kv_layout is None
    assert not cfg.is_resolved


def test_kv_layout_derives_page_bytes_and_shape():
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert layout.itemsize == 2
    assert layout.token_bytes == 2 * 32 * 8 * 128 * 2
    assert layout.page_shape(16) == (32, 2, 16, 8, 128)
    assert layout.page_bytes(16) == 16 * layout.token_bytes
    assert int(np.prod(layout.page_shape(16))) * layout.itemsize == layout.page_bytes(16)
    cfg = HostKVConfig(num_pages=100, page_size=16, kv_layout=layout)
    assert cfg.page_bytes == layout.page_bytes(16)
    # Both given and agreeing is fine.
    same = HostKVConfig(num_pages=100, page_size=16, page_bytes=layout.page_bytes(16),
                        kv_layout=layout)
    assert same == cfg


@pytest.mark.parametrize(
    "name, itemsize",
    [("float16", 2), ("bfloat16", 2), ("float32", 4), ("float64", 8),
     ("float8_e4m3fn", 1), ("float8_e5m2", 1), ("int8", 1), ("uint8", 1)],
)
def test_dtype_names_itemsizes_and_codes(name, itemsize):
    layout = KVLayout(1, 1, 1, dtype=name)
    assert layout.itemsize == itemsize
    assert dtype_from_code(DTYPE_CODES[name]) == name
    assert layout.dtype_code == DTYPE_CODES[name]


def test_dtype_codes_are_stable():
    # Stored in segment headers: changing one is a format change.
    assert dict(DTYPE_CODES) == {
        "float16": 1, "bfloat16": 2, "float32": 3, "float64": 4,
        "float8_e4m3fn": 5, "float8_e5m2": 6, "int8": 7, "uint8": 8,
    }
    with pytest.raises(TypeError):
        DTYPE_CODES["int64"] = 9  # type: ignore[index]


@pytest.mark.parametrize("code", [0, 9, -1, True, "1", None])
def test_dtype_from_bad_code(code):
    with pytest.raises(ConfigError, match="dtype code"):
        dtype_from_code(code)


def test_numpy_dtype_and_ints_normalised():
    for dt, name in [(np.float16, "float16"), (np.dtype("float32"), "float32"),
                     (np.dtype(np.uint8), "uint8"), (np.int8, "int8")]:
        layout = KVLayout(np.int64(2), np.int32(4), np.uint16(8), dtype=dt)
        assert layout.dtype == name
        assert type(layout.num_layers) is int and layout.num_layers == 2
        assert layout == KVLayout(2, 4, 8, dtype=name)
    cfg = HostKVConfig(num_pages=np.int64(8), page_size=np.int32(16), page_bytes=np.uint32(64),
                       max_sequences=np.int16(3))
    assert type(cfg.num_pages) is int and type(cfg.page_size) is int
    assert type(cfg.page_bytes) is int and type(cfg.max_sequences) is int
    assert cfg == HostKVConfig(num_pages=8, page_size=16, page_bytes=64, max_sequences=3)


def test_numpy_bool_rejected():
    with pytest.raises(ConfigError, match="num_pages"):
        HostKVConfig(num_pages=np.bool_(True), page_bytes=64)


def test_torch_dtype_normalised():
    torch = pytest.importorskip("torch")
    assert KVLayout(2, 4, 8, dtype=torch.bfloat16).dtype == "bfloat16"
    assert KVLayout(2, 4, 8, dtype=torch.half).dtype == "float16"
    assert KVLayout(2, 4, 8, dtype=torch.float8_e4m3fn).dtype == "float8_e4m3fn"
    assert KVLayout(2, 4, 8, dtype=torch.uint8) == KVLayout(2, 4, 8, dtype="uint8")
    with pytest.raises(ConfigError, match="dtype"):
        KVLayout(2, 4, 8, dtype=torch.int64)
    # The torch view of a page has the documented shape and byte size.
    layout = KVLayout(2, 4, 8, dtype=torch.bfloat16)
    page = torch.empty(layout.page_shape(16), dtype=torch.bfloat16)
    assert page.numel() * page.element_size() == layout.page_bytes(16)


def test_config_module_does_not_import_torch():
    code = ("import sys, hostkv.config as c; c.KVLayout(1, 1, 1, 'bfloat16'); "
            "sys.exit('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_defaults_small_pool():
    cfg = HostKVConfig(num_pages=100, page_bytes=64).apply_runtime_defaults()
    assert cfg.is_resolved
    assert cfg.radix_node_capacity == 4096
    assert cfg.sequence_page_node_capacity == 9 + 100          # ceil(100 / 12) + max_sequences
    assert cfg.max_sequences == 100
    assert cfg.max_processes == 64
    assert cfg.undo_log_capacity == 16 * 100 + 64 * 100 + 65536
    assert cfg.enable_prefix_reuse is True
    assert (cfg.num_pages, cfg.page_size, cfg.page_bytes) == (100, 16, 64)


def test_defaults_large_pool():
    n = 1_000_000
    cfg = HostKVConfig(num_pages=n, page_bytes=4096).apply_runtime_defaults()
    assert cfg.radix_node_capacity == n // 2
    assert cfg.sequence_page_node_capacity == -(-n // 12) + 4096
    assert cfg.max_sequences == 4096
    assert cfg.max_processes == 64
    assert cfg.undo_log_capacity == 16 * n + 64 * 4096 + 65536


def test_explicit_values_kept():
    cfg = HostKVConfig(num_pages=100, page_bytes=64, radix_node_capacity=7,
                       sequence_page_node_capacity=9, max_sequences=3, max_processes=2,
                       undo_log_capacity=300, enable_prefix_reuse=False)
    resolved = cfg.apply_runtime_defaults()
    assert resolved == cfg
    assert resolved.is_resolved and cfg.is_resolved


def test_apply_returns_new_and_is_idempotent():
    cfg = HostKVConfig(num_pages=5000, page_size=32, kv_layout=small_layout())
    once = cfg.apply_runtime_defaults()
    assert once is not cfg
    assert not cfg.is_resolved and cfg.radix_node_capacity == 0
    assert once.apply_runtime_defaults() == once
    assert once.kv_layout == cfg.kv_layout and once.page_bytes == cfg.page_bytes
    assert hash(once) == hash(once.apply_runtime_defaults())


def test_derived_value_overflowing_int32_is_an_error():
    # 2**29 pages of one token: valid as given, but 16 * num_pages undo-log entries is not.
    cfg = HostKVConfig(num_pages=2**29, page_size=1, page_bytes=1)
    with pytest.raises(ConfigError, match="undo_log_capacity"):
        cfg.apply_runtime_defaults()
    ok = dataclasses.replace(cfg, undo_log_capacity=2**30).apply_runtime_defaults()
    assert ok.is_resolved
    assert ok.sequence_page_node_capacity == 2**29 // 12 + 1 + 4096


@pytest.mark.parametrize(
    "value, expected",
    [("0", False), ("1", True), ("true", True), ("TRUE", True), ("False", False),
     (" 1 ", True)],
)
def test_env_override(monkeypatch, value, expected):
    monkeypatch.setenv(ENV, value)
    for start in (True, False):
        cfg = HostKVConfig(num_pages=8, page_bytes=64, enable_prefix_reuse=start)
        resolved = cfg.apply_runtime_defaults()
        assert resolved.enable_prefix_reuse is expected
        assert resolved.apply_runtime_defaults() == resolved


def test_env_empty_counts_as_unset(monkeypatch):
    monkeypatch.setenv(ENV, "")
    cfg = HostKVConfig(num_pages=8, page_bytes=64, enable_prefix_reuse=False)
    assert cfg.apply_runtime_defaults().enable_prefix_reuse is False


@pytest.mark.parametrize("value", ["junk", "yes", "2", "on", "-1"])
def test_env_junk_is_config_error(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ConfigError, match=ENV) as info:
        HostKVConfig(num_pages=8, page_bytes=64).apply_runtime_defaults()
    assert repr(value) in str(info.value)


def test_env_not_read_at_construction(monkeypatch):
    monkeypatch.setenv(ENV, "junk")
    cfg = HostKVConfig(num_pages=8, page_bytes=64)
    assert cfg.enable_prefix_reuse is True


def test_frozen():
    cfg = HostKVConfig(num_pages=8, page_bytes=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_pages = 9  # type: ignore[misc]
    layout = small_layout()
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.dtype = "float32"  # type: ignore[misc]


def test_replace_revalidates():
    cfg = HostKVConfig(num_pages=8, page_bytes=64)
    with pytest.raises(ConfigError, match="page_size"):
        dataclasses.replace(cfg, page_size=3)


def test_field_order():
    assert [f.name for f in dataclasses.fields(HostKVConfig)] == [
        "num_pages", "page_size", "page_bytes", "kv_layout", "enable_prefix_reuse",
        "prefix_min_reuse_pages", "prefix_min_store_pages", "radix_node_capacity",
        "sequence_page_node_capacity", "max_sequences", "max_processes", "undo_log_capacity",
        "num_parts", "part_bytes",
    ]
    assert [f.name for f in dataclasses.fields(KVLayout)] == [
        "num_layers", "num_kv_heads", "head_dim", "dtype", "kind", "state_layers",
        "window_layers"]


def test_state_layers_are_increasing_layers_that_leave_one_kv_layer():
    """A recurrent-state model's layout names the layers whose slot holds a state: stored
    as a tuple of plain ints (equal layouts compare equal), refused unless increasing,
    inside the layout and below the header's bitmap, with one K/V layer left."""
    import numpy as np

    layout = KVLayout(4, 2, 64, "bfloat16", state_layers=[np.int64(0), 2])
    assert layout.state_layers == (0, 2) and type(layout.state_layers[0]) is int
    assert layout == KVLayout(4, 2, 64, "bfloat16", state_layers=(0, 2))
    assert layout != KVLayout(4, 2, 64, "bfloat16")
    # The slot of a state layer is a K/V layer's: pages are the same size.
    assert layout.page_bytes(16) == KVLayout(4, 2, 64, "bfloat16").page_bytes(16)
    for bad in ([2, 0], [0, 0], [-1], [4], [0, 1, 2, 3], ["0"], [0.5]):
        with pytest.raises(ConfigError, match="state_layers"):
            KVLayout(4, 2, 64, "bfloat16", state_layers=bad)
    with pytest.raises(ConfigError, match="below num_layers 2000 and 1024"):
        KVLayout(2000, 2, 64, "bfloat16", state_layers=[1024])
    assert KVLayout(2000, 2, 64, "bfloat16", state_layers=[1023]).state_layers == (1023,)


def test_window_layers_leave_the_page_for_the_window_part():
    """A sliding-window model's layout names the layers whose KV lives in window parts:
    the page holds the others (a Gemma-3 of six layers, five windowed: a sixth of the
    bytes), the part the windowed ones, each in the page's shape over its own layers;
    slot() says where each layer is. Refused unless increasing, inside the layout, none a
    state layer, with one layer left in the page."""
    import numpy as np

    full = KVLayout(6, 2, 64, "bfloat16")
    gemma = KVLayout(6, 2, 64, "bfloat16", window_layers=[np.int64(0), 1, 2, 3, 4])
    assert gemma.window_layers == (0, 1, 2, 3, 4) and type(gemma.window_layers[0]) is int
    assert gemma != full and gemma.page_layers == (5,)
    assert gemma.page_bytes(16) * 6 == full.page_bytes(16)
    assert gemma.part_bytes(16) == 5 * gemma.page_bytes(16) and full.part_bytes(16) == 0
    assert gemma.page_shape(16) == (1, 2, 16, 2, 64)
    assert gemma.part_shape(16) == (5, 2, 16, 2, 64)
    assert [gemma.slot(layer) for layer in range(6)] == [
        ("part", 0), ("part", 1), ("part", 2), ("part", 3), ("part", 4), ("page", 0)]
    mixed = KVLayout(4, 1, 576, kind="mla", state_layers=[3], window_layers=[1])
    assert mixed.page_shape(16) == (3, 16, 576) and mixed.part_shape(16) == (1, 16, 576)
    assert [mixed.slot(layer) for layer in range(4)] == [
        ("page", 0), ("part", 0), ("page", 1), ("page", 2)]
    with pytest.raises(ConfigError, match="no window part"):
        full.part_shape(16)
    with pytest.raises(ConfigError, match="not one of the layout's 6"):
        gemma.slot(6)
    for bad in ([2, 0], [0, 0], [-1], [6], [0, 1, 2, 3, 4, 5], ["0"], [3]):
        with pytest.raises(ConfigError, match="window_layers"):
            KVLayout(6, 2, 64, "bfloat16", state_layers=[3], window_layers=bad)
    # The config takes the part's bytes from the layout, and needs parts to hold them.
    config = HostKVConfig(num_pages=8, page_size=16, kv_layout=gemma, num_parts=4)
    assert (config.page_bytes, config.part_bytes) == (gemma.page_bytes(16),
                                                      gemma.part_bytes(16))
    with pytest.raises(ConfigError, match="num_parts must be > 0"):
        HostKVConfig(num_pages=8, page_size=16, kv_layout=gemma)
    with pytest.raises(ConfigError, match="gives 40960 bytes per window part"):
        HostKVConfig(num_pages=8, page_size=16, kv_layout=gemma, num_parts=4, part_bytes=64)


def test_limits_accepted_at_the_edge():
    HostKVConfig(num_pages=2**31 - 1, page_size=1, page_bytes=1)
    HostKVConfig(num_pages=2**20, page_bytes=2**26)  # exactly 2**46 bytes
    HostKVConfig(num_pages=1, page_size=65536, page_bytes=1, max_processes=4096)
    HostKVConfig(num_pages=1, page_size=1, page_bytes=1)


def test_mla_layout_holds_one_latent_vector_per_token():
    layout = KVLayout(num_layers=3, num_kv_heads=1, head_dim=576, dtype="bfloat16", kind="mla")
    assert layout.kv_planes == 1
    assert layout.token_bytes == 3 * 576 * 2
    assert layout.page_shape(16) == (3, 16, 576)
    assert layout != KVLayout(3, 1, 576, "bfloat16")          # the kind is part of a layout
    assert KVLayout(3, 1, 576, "bfloat16").page_shape(16) == (3, 2, 16, 1, 576)


def test_bad_layout_kinds_refused():
    with pytest.raises(ConfigError, match="kind must be one of mha, mla"):
        KVLayout(2, 2, 64, kind="gqa")
    with pytest.raises(ConfigError, match="num_kv_heads must be 1, got 2"):
        KVLayout(2, 2, 576, kind="mla")
