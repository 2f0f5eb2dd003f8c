"""What a KV page's bytes depend on besides its token ids: the key's namespace, or a bypass.

hostkv's radix tree keys a page by (token ids, namespace), so everything else that changes
a byte of a request's KV must be in its namespace, or the request must not use hostkv:

- The engine (:func:`engine_identity`, once at the scheduler's start): the model's name and
  revision, a fingerprint of its checkpoint as it is on disk (:func:`checkpoint_fingerprint`),
  the HF config as vLLM loads it (``hf_overrides`` and RoPE scaling applied; read again,
  :func:`hf_config_as_loaded`, since model code changes the live one), ``hf_overrides``
  itself, the generation config vLLM reads (``generation_config``, the checkpoint's
  ``generation_config.json``, ``override_generation_config``: Llama 4's model code takes
  ``attn_temperature_tuning`` from it, which scales its queries), dtype, KV-cache dtype,
  quantization, ``max_model_len`` (vLLM's LongRoPE picks its factors by it, Llama 4 its
  temperature tuning), load format, model implementation, the model's code (the remote
  code's ``code_revision``, ``model_class_overrides``), ``disable_sliding_window``, the
  page layout (with, for a model with recurrent state, its layout, and the
  tensor-parallel degree where the state is kept per degree) and the ``namespace``
  setting. The segment outlives engines: a new
  checkpoint at the same path must never read the old one's KV.
- The request (:class:`RequestIdentity`): its ``cache_salt``, its LoRA adapter (name, path
  and a fingerprint of the adapter's files) and its multimodal items (each one's identifier,
  vLLM's hash of the item, with its placeholder's position).

Fingerprints of files are stat-based (names, sizes, modification times) plus the content of
the small config files: start-up never reads gigabytes of weights. A checkpoint rewritten in
place gets new modification times; one restored with its old times (``cp -p``, ``rsync -t``
of other weights of the same sizes) is not detected (docs/vllm.md, "Namespaces").

Requests with prompt embeddings bypass hostkv (:func:`bypass_cause`): vLLM gives them the
token ids 0 at every embedded position, and the namespace of a request is one value for its
whole sequence, so the only exact key would be a hash of all the embeddings, which only an
identical prompt would ever match.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import TYPE_CHECKING, Any, Dict, Iterable, Optional, Set, Tuple

from hostkv.vllm.metrics import Counters

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

    from hostkv.config import KVLayout

__all__ = ["RequestIdentity", "bypass_cause", "checkpoint_fingerprint", "engine_identity",
           "fields_digest", "files_fingerprint", "hf_config_as_loaded", "multimodal_key"]

logger = logging.getLogger("hostkv.vllm")

# The version of what goes into a namespace: a change makes every old page unreachable
# (never misread) for engines of the new version. 5: engines before it saved pages with
# speculative decoding on (draft tokens' KV) and keyed no model code (code_revision,
# model_class_overrides, disable_sliding_window), so their pages may not be the KV of
# their key.
_VERSION = b"hostkv-vllm-5"
# Files whose content, not only their size and time, goes into a fingerprint: small, and
# what decides how the weights are read.
_CONFIG_FILES = ("config.json", "adapter_config.json", "params.json",
                 "quantize_config.json", "hf_quant_config.json", "generation_config.json")
# A directory with more files than this is fingerprinted by its first ones (sorted): a
# model directory has tens, a cache directory mistaken for one must not stall the start.
_MAX_FILES = 10000
_MAX_CONFIG_BYTES = 1 << 20


def fields_digest(*fields: Any) -> bytes:
    """A 32-byte digest of the fields, each length-prefixed: no field's text can stand for
    another's boundary (a cache salt holding ``"\\0lora\\0"`` never equals a salt and an
    adapter)."""
    digest = hashlib.blake2b(digest_size=32)
    for value in fields:
        data = value if isinstance(value, bytes) else str(value).encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.digest()


def _walk(root: str) -> Iterable[Tuple[str, str]]:
    """(relative path, full path) of the files under root, sorted; hidden directories
    (.git, .cache) skipped. Links to files are followed by the stat (an HF snapshot's
    files are links to its blobs); links to directories are not, so no cycle is walked."""
    count = 0
    for parent, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            full = os.path.join(parent, name)
            yield os.path.relpath(full, root), full
            count += 1
            if count >= _MAX_FILES:
                return


def files_fingerprint(path: str, times: bool = True) -> bytes:
    """A fingerprint of the files at path (a directory or one file): each file's name, size
    and (with ``times``) modification time (ns), and the content of its config files.
    Stat-based: it never reads the weights. A path that does not exist gives the digest of
    its name alone."""
    fields: list = [b"files"]
    if os.path.isdir(path):
        entries = list(_walk(path))
    elif os.path.isfile(path):
        entries = [(os.path.basename(path), path)]
    else:
        return fields_digest(b"missing", path)
    for rel, full in entries:
        try:
            st = os.stat(full)             # through symlinks: an HF snapshot's blobs
        except OSError:
            continue
        fields += [rel, st.st_size, st.st_mtime_ns if times else 0]
        if os.path.basename(rel) in _CONFIG_FILES and st.st_size <= _MAX_CONFIG_BYTES:
            try:
                with open(full, "rb") as f:
                    fields.append(f.read())
            except OSError:
                pass
    return fields_digest(*fields)


def _hub_snapshot(repo_id: str, revision: Optional[str]) -> Optional[str]:
    """The local snapshot directory of a hub model (its name is the commit vLLM loaded),
    without any download; None if there is none."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id=repo_id, revision=revision, local_files_only=True)
    except Exception:                     # noqa: BLE001 - not a hub id, or not cached
        return None


def checkpoint_fingerprint(model: str, revision: Optional[str] = None) -> bytes:
    """A fingerprint of the checkpoint vLLM loaded: for a local path, its files
    (:func:`files_fingerprint`); for a hub id, the resolved snapshot (its directory names the
    commit) and its files; else the name and revision alone."""
    if os.path.exists(model):
        return fields_digest(b"local", os.path.realpath(model), files_fingerprint(model))
    snapshot = _hub_snapshot(model, revision)
    if snapshot is not None:
        # The snapshot's directory is named by the commit, which fixes its content: the
        # cache's location and the files' times differ from host to host (each downloaded
        # its own copy), and hosts must agree to share pages through a remote tier.
        return fields_digest(b"hub", model, os.path.basename(os.path.normpath(snapshot)),
                             files_fingerprint(snapshot, times=False))
    return fields_digest(b"name", model, revision or "")


def _stable(value: Any) -> str:
    """A text of a config value that is the same in every process (a callable by name, not
    by address)."""
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value)}"
    try:
        return json.dumps(value, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        return repr(value)


def _hf_config_text(hf_config: Any) -> str:
    if hf_config is None:
        return ""
    try:
        return hf_config.to_json_string(use_diff=False)
    except Exception:                     # noqa: BLE001 - a custom config: its dict
        try:
            return _stable(hf_config.to_dict())
        except Exception:                 # noqa: BLE001
            return repr(hf_config)


def hf_config_as_loaded(model_config: Any) -> Any:
    """The model's HF config as vLLM's ``get_config`` gives it to ``ModelConfig``, read
    again from its files with the same arguments and overrides.

    The live ``model_config.hf_config`` is not the same in every process: model code and
    vLLM's layers change it where the model is built (Llama 4 sets
    ``attn_temperature_tuning``, vLLM's RoPE adds ``partial_rotary_factor`` to Falcon-H1's
    ``rope_parameters``), and the model is built in the scheduler's process only for a
    single-process engine. Hashing the live config would give engines of one model other
    namespaces by process layout. What those changes are made from is in the identity
    anyway. Falls back to the live config (logged) if vLLM's reader fails here."""
    try:
        from vllm.transformers_utils.config import get_config

        overrides = getattr(model_config, "hf_overrides", None) or {}
        if callable(overrides):
            flat, function, nested = {}, overrides, {}
        else:
            # As ModelConfig splits them: flat values go to get_config, dicts are applied
            # to the loaded config (nested configs updated, other dicts set).
            flat = {k: v for k, v in overrides.items() if not isinstance(v, dict)}
            nested = {k: v for k, v in overrides.items() if isinstance(v, dict)}
            function = None
        config = get_config(
            model_config.hf_config_path or model_config.model,
            model_config.trust_remote_code,
            getattr(model_config, "_hf_config_revision", None) or model_config.revision,
            model_config.code_revision, model_config.config_format,
            hf_overrides_kw=flat, hf_overrides_fn=function,
            token=getattr(model_config, "hf_token", None))
        if nested:
            model_config._apply_dict_overrides(config, nested)
        return config
    except Exception as error:            # noqa: BLE001 - a vLLM that reads configs otherwise
        logger.warning("hostkv: could not read the model's HF config again (%s: %s); the "
                       "namespace takes the live one, which model code may have changed, "
                       "so engines of this model in other process layouts may not share "
                       "pages (never a wrong load)", type(error).__name__, error)
        return getattr(model_config, "hf_config", None)


def _model_code(model: Any) -> Tuple[Any, ...]:
    """The engine identity's fields for the model's code beyond its checkpoint: remote code
    of another revision, another class for its architecture, or sliding windows turned off
    compute other KV from the same weights. None of them set (vLLM's defaults): no field,
    so an engine's identity does not change when vLLM adds such settings with defaults."""
    code_revision = getattr(model, "code_revision", None) or ""
    class_overrides = getattr(model, "model_class_overrides", None) or {}
    no_window = bool(getattr(model, "disable_sliding_window", False))
    if not (code_revision or class_overrides or no_window):
        return ()
    return b"model code", code_revision, _stable(class_overrides), str(no_window)


def engine_identity(vllm_config: "VllmConfig", layout: "KVLayout", namespace: str,
                    parts: str = "", hf_config: Any = None) -> bytes:
    """The engine's part of every namespace: every engine-wide input to a KV byte (the
    module docstring lists them), and ``parts``, what a page holds beyond the canonical
    K/V (``EngineKV.parts_description``: recurrent state, whole, or each rank's shard where
    hostkv knows no split, which names the tensor-parallel degree). Otherwise deliberately
    left out: the attention backend and the tensor-parallel degree (pages are canonical:
    engines of any share them). ``hf_config``: the HF config to hash, the live one if None;
    the connector passes :func:`hf_config_as_loaded`'s, the same in every process."""
    model = vllm_config.model_config
    cache = getattr(vllm_config, "cache_config", None)
    load = getattr(vllm_config, "load_config", None)
    name = str(model.model)
    revision = getattr(model, "revision", None)
    # "auto" (the checkpoint's generation_config.json, in its fingerprint), "vllm" (none),
    # or a directory of its own.
    generation = str(getattr(model, "generation_config", "auto"))
    return fields_digest(
        _VERSION, name, revision or "",
        checkpoint_fingerprint(name, revision),
        _hf_config_text(hf_config if hf_config is not None
                        else getattr(model, "hf_config", None)),
        _stable(getattr(model, "hf_overrides", None)),
        generation,
        files_fingerprint(generation) if os.path.isdir(generation) else b"",
        _stable(getattr(model, "override_generation_config", None)),
        str(getattr(model, "dtype", "")),
        str(getattr(cache, "cache_dtype", "")),
        str(getattr(model, "quantization", None)),
        _stable(getattr(model, "quantization_config", None)),
        str(getattr(model, "max_model_len", "")),
        str(getattr(load, "load_format", "")),
        str(getattr(model, "model_impl", "")),
        *_model_code(model),
        layout.kind, layout.dtype, layout.num_layers, layout.num_kv_heads, layout.head_dim,
        namespace, *((b"parts", parts) if parts else ()))


def bypass_cause(request: "Request") -> Optional[str]:
    """Why the request must not use hostkv (no lookup, no save), or None."""
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    for feature in getattr(request, "mm_features", None) or ():
        if not getattr(feature, "identifier", None):
            return "a multimodal item without an identifier"
    return None


def multimodal_key(request: "Request") -> bytes:
    """The request's multimodal items as key bytes (empty without any): each item's
    identifier (vLLM's hash of its data and processing) and placeholder range. Two requests
    share a namespace only with the same items at the same positions, so any common token
    prefix holds the same KV; a request that adds an item shares nothing with one that
    has fewer."""
    features = getattr(request, "mm_features", None)
    if not features:
        return b""
    fields: list = [b"mm"]
    for feature in features:
        position = feature.mm_position
        fields += [getattr(feature, "modality", ""), feature.identifier, position.offset,
                   position.length]
        mask = getattr(position, "is_embed", None)
        if mask is not None:
            fields.append(mask.cpu().numpy().astype(bool).tobytes())
    return fields_digest(*fields)


class RequestIdentity:
    """The request's part of its namespace (adapters fingerprinted once per path), and the
    bypasses, counted and logged once per cause."""

    def __init__(self, counters: Counters) -> None:
        """counters: where ``bypassed_requests`` is counted."""
        self.counters = counters
        self.adapters: Dict[str, bytes] = {}
        self.logged: Set[str] = set()

    def adapter_key(self, lora: Optional["LoRARequest"]) -> Optional[bytes]:
        """The adapter's name, path and a fingerprint of its files (taken the first time
        the path is seen: vLLM, too, loads an adapter once per id; a new adapter gets a new
        path). None without an adapter. The int id is left out: it is one engine's handle,
        and vLLM's own prefix cache keys adapters by name and path."""
        if lora is None:
            return None
        path = str(getattr(lora, "lora_path", "") or "")
        fingerprint = self.adapters.get(path)
        if fingerprint is None:
            fingerprint = checkpoint_fingerprint(path) if path else b""
            self.adapters[path] = fingerprint
        return fields_digest(b"lora", lora.lora_name, path, fingerprint)

    def bypassed(self, request: "Request", cause: str) -> None:
        """Counts a request that bypasses hostkv (once: not again when a preempted request
        resumes) and logs the first of each cause."""
        if getattr(request, "num_preemptions", 0) == 0:
            self.counters.add("bypassed_requests", 1)
        if cause not in self.logged:
            self.logged.add(cause)
            logger.warning("hostkv: requests with %s bypass the cache (not looked up, not "
                           "saved: their token ids do not say what their KV is); logged "
                           "once, counted as bypassed_requests", cause)
