"""The connector's settings: the keys of vLLM's ``kv_connector_extra_config``."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from hostkv._units import parse_size
from hostkv._validate import is_int, is_real, number
from hostkv.errors import ConfigError
from hostkv.remote.config import RemoteConfig

__all__ = ["HostKVSettings"]


@dataclasses.dataclass(frozen=True)
class HostKVSettings:
    """The connector's keys in ``kv_connector_extra_config``, with their defaults.

    Attributes:
        segment: The segment's name (required); the first engine creates it.
        size: The pool's size when this engine creates the segment: bytes, or a string
            such as ``"8GiB"``. Ignored when ``num_pages`` is set or the segment exists.
        num_pages: The pool's size in pages (one vLLM block of every layer each), 0: use
            ``size``.
        lock_timeout: Seconds a serving-path call waits for the segment's lock before it
            gives up (a miss, or a skipped save).
        ready_timeout: Seconds to wait for a segment that another engine is creating.
        namespace: Extra text mixed into every request's namespace: engines with other
            values never share pages (the engine's identity, each request's cache_salt,
            LoRA adapter and multimodal items are always mixed in: hostkv.vllm.identity).
        max_processes: Lease slots when this engine creates the segment (0: hostkv's
            default, 64): each engine takes one per process (its scheduler and each
            tensor-parallel worker); a remote tier shares its process's.
        remote: The remote tier shared by every host (key ``remote``: a URL such as
            ``redis://host:6379/0`` or ``redis+cluster://h1:7000,h2:7000``), None: off.
            Keys ``remote_<field>`` set the other RemoteConfig fields (``remote_key_prefix``,
            ``remote_ttl_seconds``, ``remote_socket_timeout``, ``remote_connect_timeout``,
            ``remote_max_bytes_in_flight``, ...).
        remote_wait: Seconds a request whose prompt goes beyond the host's cache waits
            for the remote tier's answer (vLLM schedules other requests meanwhile); past
            it the request goes on without, and what arrives later serves later requests.
            0: never wait (the lookup still runs, for the requests that follow).
        replace_incompatible: What an engine does with a segment of another page layout
            or hostkv version that no live process holds (an operator changed the model,
            or upgraded hostkv): True unlinks it and creates its own (logged); False
            refuses to start. A segment that live engines hold is always refused.
        async_saves: True: saves run beside the engine's next steps (on a GPU, a side
            stream; on a CPU, a copy thread per worker) and are confirmed to the scheduler
            at a later step; vLLM keeps a finished request's blocks until its last save is
            over. False: a step's saves are copied before the step ends. None (the
            default): True on a GPU, False on a CPU, where the copy thread only takes
            turns with the forward on the same cores (measured slower).
        window_parts: True: a model with sliding-window or chunked-local layers beside
            others (vLLM's hybrid manager on) keeps those layers' KV in the pages' window
            parts, not in the pages, and a hit needs it only for the pages its window
            reaches (``hostkv.vllm.window``): a page costs the other layers' bytes, a
            part the windowed ones'. Every engine of a segment must agree (it is the
            segment's layout). False (the default): every layer in the page.
        window_part_fraction: Window parts per page when this engine creates the segment
            with ``window_parts``, in (0, 1]: ``size`` is shared so, and the pages whose
            parts were evicted (least recently used first) keep their other layers.
    """

    segment: str
    size: int = 1 << 30
    num_pages: int = 0
    lock_timeout: float = 1.0
    ready_timeout: float = 30.0
    namespace: str = ""
    max_processes: int = 0
    remote: Optional[RemoteConfig] = None
    remote_wait: float = 0.5
    replace_incompatible: bool = True
    async_saves: Optional[bool] = None
    window_parts: bool = False
    window_part_fraction: float = 0.25

    @classmethod
    def from_extra_config(cls, extra: Optional[Dict[str, Any]]) -> "HostKVSettings":
        """Reads and checks ``kv_connector_extra_config``.

        Raises:
            ValueError: a missing segment, an unknown key or a bad value (named); a bad
                remote URL or setting is a ConfigError (a ValueError) naming it.
        """
        extra = dict(extra or {})
        remote_fields = {f"remote_{field.name}": field.name
                         for field in dataclasses.fields(RemoteConfig) if field.name != "url"}
        known = {field.name for field in dataclasses.fields(cls)} | set(remote_fields)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"hostkv: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(known)}")
        if not isinstance(extra.get("segment"), str) or not extra["segment"]:
            raise ValueError("hostkv: kv_connector_extra_config needs 'segment': the name "
                             "of the shared segment")
        values: Dict[str, Any] = {"segment": extra["segment"]}
        if "size" in extra:
            values["size"] = parse_size(extra["size"])
        for key in ("num_pages", "max_processes"):
            if key in extra:
                value = extra[key]
                if not is_int(value) or value < 0:
                    raise ValueError(f"hostkv: {key} must be an integer >= 0, got {value!r}")
                values[key] = int(value)
        for key in ("lock_timeout", "ready_timeout"):
            if key in extra:
                value = extra[key]
                if not is_real(value) or value <= 0:
                    raise ValueError(f"hostkv: {key} must be seconds > 0, got {value!r}")
                values[key] = float(value)
        if "namespace" in extra:
            values["namespace"] = str(extra["namespace"])
        if "window_part_fraction" in extra:
            values["window_part_fraction"] = float(number(
                extra["window_part_fraction"], "hostkv: window_part_fraction", 0, 1, False,
                ValueError))
            if values["window_part_fraction"] <= 0:
                raise ValueError(f"hostkv: window_part_fraction must be in (0, 1], got "
                                 f"{extra['window_part_fraction']!r}")
        for key in ("replace_incompatible", "async_saves", "window_parts"):
            if key in extra:
                if not isinstance(extra[key], bool):
                    raise ValueError(f"hostkv: {key} must be true or false, got "
                                     f"{extra[key]!r}")
                values[key] = extra[key]
        url = extra.get("remote")
        options = {field: extra[key] for key, field in remote_fields.items() if key in extra}
        if url is None or url == "":
            orphans = sorted(set(extra) & (set(remote_fields) | {"remote_wait"}))
            if orphans:
                raise ConfigError(f"hostkv: {orphans} set without 'remote' (the remote "
                                  "tier's URL)")
        else:
            # RemoteConfig checks the URL and every value, naming it (the password masked).
            try:
                values["remote"] = RemoteConfig(url, **options)
            except ConfigError as exc:
                raise ConfigError(f"hostkv: kv_connector_extra_config 'remote': {exc}") from None
            if "remote_wait" in extra:
                values["remote_wait"] = float(number(
                    extra["remote_wait"], "hostkv: remote_wait (seconds)", 0, 600, False,
                    ConfigError))
        return cls(**values)

