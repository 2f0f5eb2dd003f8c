"""HostKVConnector: vLLM's V1 KV-connector API over a hostkv segment.

Several vLLM engines on one host share one cache of KV pages in shared memory, with no
server process: every engine's scheduler and worker processes attach the segment. Load it
with::

    --kv-transfer-config '{"kv_connector": "HostKVConnector",
                           "kv_connector_module_path": "hostkv.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"segment": "NAME"}}'

A hostkv page is one vLLM block (page_size = block_size) of every layer, in hostkv's
canonical layout (``KVLayout``: the model's total KV heads, or one latent vector per token
for MLA), whatever attention backend and tensor-parallel degree the engine runs: engines of
either share pages. Each tensor-parallel rank copies its heads' slice of a page; the
scheduler commits a page only after every rank confirmed its save.

The package, one job a module: ``settings`` (the extra-config keys), ``identity`` (what a
request's key holds, or why it bypasses hostkv), ``layout`` (vLLM's KV-cache spec as pages;
opening, or replacing, the segment), ``scheduler`` (lookups, borrows, commits), ``worker``
(the copies, through ``hostkv.copy_engine``), ``metadata`` (what they tell each other),
``metrics`` (counters, stats, Prometheus), ``connector`` (the facade vLLM loads).

How a request flows (the scheduler side runs in vLLM's engine-core process):

1. ``get_num_new_matched_tokens``: a pure lookup (``match_prefix``) of the request's tokens;
   what lies beyond vLLM's own (local) hit is offered as external tokens.
2. ``update_state_after_alloc``: the request becomes a hostkv sequence
   (``allocate_pages_for_sequences_with_prefix``): it borrows the cached prefix, so no
   process can evict it before it is loaded, and gets private pages for the rest. If the
   borrow found less than was promised (another engine evicted pages in between), the
   missing blocks are reported to vLLM through ``get_block_ids_with_load_errors`` and vLLM
   recomputes them: a page is loaded only if it was verified and held.
3. ``build_connector_meta``: per step, which pages to load into which blocks, and which
   newly computed blocks (prompt or decode) to save into which private pages.
4. The workers copy (``start_load_kv`` before the forward, ``wait_for_save`` after it),
   one strided copy per layer straight between blocks and pages, and report each step
   back with their rank (``build_connector_worker_meta``).
5. ``update_connector_output``: the scheduler commits the pages whose save every rank
   confirmed (only then do other engines see them) and releases finished requests.

Across hosts (``"remote": URL`` in the extra config): the scheduler runs a
``hostkv.remote.RemoteTier`` over its segment. In step 1, a prompt that goes beyond what the
host holds starts a lookup of the rest on the tier's fetch thread, and the answer is None
(vLLM's "ask again later": the request waits, others are scheduled) until the fetched pages
are in the host's segment, the lookup failed, or ``remote_wait`` passed; then the lookup
above runs, and the pages are borrowed and loaded like any others (never wrong KV: the tier
checks each value's tokens, layout and checksum before inserting it, and a page is loaded
only if it is held). In step 5, the pages committed are queued to the tier's writer
(write-through on commit). Remote keys use the request's namespace (``identity``: the
model and its checkpoint's fingerprint, layout, salt, LoRA adapter, multimodal items,
``namespace``), so they separate exactly as the host's pages do.

Fail open: no error of the cache (a lock timeout, a full pool, a corrupt or missing
segment) leaves a connector method on the serving path; it becomes a miss or a skipped
save, counted in the stats and logged once per cause; a remote tier down or slow costs a
request at most ``remote_wait`` (nothing once its circuit breaker is open), counted too.
Engine start-up (a bad config or remote URL, a KV cache hostkv cannot map, a segment of
another layout that live engines hold) does raise, with an error that says what it saw. A
segment of another layout or hostkv version that no live process holds is replaced
(logged), unless ``replace_incompatible`` is false.

Only vLLM processes import this module; ``import hostkv`` never needs vLLM or torch.
"""

from hostkv._units import parse_size
from hostkv.vllm.connector import HostKVConnector
from hostkv.vllm.layout import EngineKV, describe_layout, engine_kv, open_segment
from hostkv.vllm.metadata import HostKVConnectorMetadata, HostKVWorkerMetadata
from hostkv.vllm.metrics import HostKVConnectorStats, HostKVPromMetrics
from hostkv.vllm.settings import HostKVSettings

__all__ = [
    "EngineKV",
    "HostKVConnector",
    "HostKVConnectorMetadata",
    "HostKVConnectorStats",
    "HostKVPromMetrics",
    "HostKVSettings",
    "HostKVWorkerMetadata",
    "describe_layout",
    "engine_kv",
    "open_segment",
    "parse_size",
]
