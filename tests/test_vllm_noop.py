"""hostkv.vllm.noop.NoOpConnector, the control for measuring a connector: a real vLLM
connector class (vLLM's factory loads it by name and module path, nothing is left abstract)
that matches nothing and copies nothing. That it runs inside a real engine is checked by
tests/test_vllm_overhead.py (examples/vllm_shared_cache.py --overhead)."""

from __future__ import annotations

import importlib.util
import types
import warnings

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed: ./scripts/test.sh installs it (see README)",
                allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def _imported():
    """vLLM and torch warn of deprecations on import (the suite makes warnings errors)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm.config  # noqa: F401
        import vllm.distributed.kv_transfer.kv_connector.factory  # noqa: F401

        import hostkv.vllm.noop  # noqa: F401


def _config():
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(kv_connector="NoOpConnector",
                                kv_connector_module_path="hostkv.vllm.noop",
                                kv_role="kv_both")
    # The base class reads only kv_transfer_config; the no-op connector nothing else.
    return types.SimpleNamespace(kv_transfer_config=transfer), transfer


def test_vllm_factory_loads_it_by_name_and_module_path():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from hostkv.vllm.noop import NoOpConnector

    _, transfer = _config()
    cls = KVConnectorFactory.get_connector_class(transfer)
    assert cls is NoOpConnector
    assert issubclass(cls, KVConnectorBase_V1)
    assert not getattr(cls, "__abstractmethods__", None)   # every abstract method is there


@pytest.mark.parametrize("role_name", ["SCHEDULER", "WORKER"])
def test_it_matches_nothing_and_copies_nothing(role_name):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorRole,
    )

    from hostkv.vllm.noop import NoOpConnector

    config, _ = _config()
    role = getattr(KVConnectorRole, role_name)
    # Nothing it is given is ever read: any request, block list or tensor would do.
    conn = NoOpConnector(vllm_config=config, role=role, kv_cache_config=None)
    assert conn.role == role
    assert conn.requires_kv_delivery is False            # as hostkv's: a cache

    # Scheduler side: 0 tokens beyond vLLM's own hit, however many it has.
    for computed in (0, 32, 4096):
        assert conn.get_num_new_matched_tokens(object(), computed) == (0, False)
    assert conn.update_state_after_alloc(object(), object(), 0) is None
    meta = conn.build_connector_meta(object())
    assert isinstance(meta, KVConnectorMetadata)
    assert conn.request_finished(object(), [1, 2, 3]) == (False, None)
    assert conn.update_connector_output(object()) is None
    assert list(conn.take_events()) == []

    # Worker side, as the model runner drives it around a forward.
    conn.register_kv_caches({})
    conn.bind_connector_metadata(meta)
    assert conn.start_load_kv(object()) is None
    assert conn.wait_for_layer_load("model.layers.0.self_attn.attn") is None
    assert conn.save_kv_layer("model.layers.0.self_attn.attn", object(), None) is None
    assert conn.wait_for_save() is None
    conn.clear_connector_metadata()
    assert conn.get_block_ids_with_load_errors() == set()
    assert conn.build_connector_worker_meta() is None
    assert conn.get_kv_connector_stats() is None
    assert conn.shutdown() is None
