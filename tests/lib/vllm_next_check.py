"""Run in a child whose ``vllm`` is 0.33's Python sources (tests/test_vllm_next.py): checks
hostkv's connector class against that release's ``KVConnectorBase_V1`` and its sleep-mode
refusal, prints what it imported, and exits non-zero on the first mismatch.

Imports only; no engine starts and nothing needs CUDA.
"""

from __future__ import annotations

import inspect
import sys
import types


def kind(cls, name):
    """How a class holds an attribute: classmethod, staticmethod, property or function."""
    for klass in cls.__mro__:
        if name in vars(klass):
            value = vars(klass)[name]
            return type(value).__name__ if isinstance(
                value, (classmethod, staticmethod, property)) else "function"
    return None


def main() -> int:
    import vllm
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from hostkv.vllm.connector import HostKVConnector

    print("vllm", vllm.__version__, "from", vllm.__file__)
    assert vllm.__version__.startswith("0.33."), vllm.__version__
    assert issubclass(HostKVConnector, KVConnectorBase_V1)
    assert not HostKVConnector.__abstractmethods__, HostKVConnector.__abstractmethods__
    # Every hook the base declares that hostkv overrides: held the same way (a classmethod
    # stays one: 0.33 calls supports_sleep_mode on the class), and callable as the base's
    # signature says vLLM calls it.
    checked = []
    for name, value in vars(KVConnectorBase_V1).items():
        if (name.startswith("_") or name not in vars(HostKVConnector)
                or not isinstance(value, (classmethod, staticmethod, property,
                                          types.FunctionType))):
            continue
        base_kind, ours = kind(KVConnectorBase_V1, name), kind(HostKVConnector, name)
        assert base_kind == ours, f"{name}: the base has a {base_kind}, hostkv a {ours}"
        if ours == "property":
            continue
        base_sig = inspect.signature(getattr(KVConnectorBase_V1, name))
        our_sig = inspect.signature(getattr(HostKVConnector, name))
        args = [p.name for p in base_sig.parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if ours == "function":
            args = args[1:]                                  # self
        try:
            our_sig.bind(*(["self"] if ours == "function" else []), *args)
        except TypeError as exc:
            raise AssertionError(f"{name}{our_sig} cannot be called as {name}{base_sig}: "
                                 f"{exc}") from None
        checked.append(name)
    print("hooks checked against the 0.33 base:", ", ".join(sorted(checked)))
    for name in ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"):
        assert name in checked, name

    config = KVTransferConfig(kv_connector="HostKVConnector",
                              kv_connector_module_path="hostkv.vllm.connector",
                              kv_role="kv_both")
    assert HostKVConnector.supports_sleep_mode(config) is False
    # What VllmConfig does with sleep mode on: a clean refusal, naming the connector.
    stand_in = types.SimpleNamespace(kv_transfer_config=config,
                                     model_config=types.SimpleNamespace(enable_sleep_mode=True))
    try:
        VllmConfig._verify_kv_transfer_compat(stand_in)
    except ValueError as exc:
        assert "HostKVConnector does not support sleep mode" in str(exc), exc
        print("sleep mode refused:", exc)
    else:
        raise AssertionError("VllmConfig accepted sleep mode with hostkv")
    # 0.33 calls unregister_kv_caches() and restore_kv_caches() without arguments.
    connector = HostKVConnector.__new__(HostKVConnector)
    connector._worker = None
    connector._registered = None
    connector.unregister_kv_caches()
    connector.restore_kv_caches()
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
