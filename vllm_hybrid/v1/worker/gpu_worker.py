"""GPU worker of the overlay: sizes the routed-experts store.

vLLM reads ``aux_output_config.max_bytes`` when the model runner builds the
AuxOutput connector inside ``initialize_from_config``, and only when it is
unset derives a default from the scheduler block size. Setting it first, from
the attention pool (:func:`~vllm_hybrid.v1.worker.routed_experts.
routed_experts_store_bytes`), needs no patch: select this worker with
``--worker-cls vllm_hybrid.v1.worker.gpu_worker.HybridWorker``. A value the
user sets (``--aux-output-config '{"max_bytes": N}'``) is left alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.worker.gpu_worker import Worker

from vllm_hybrid.v1.worker.routed_experts import apply_routed_experts_store_bytes

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


class RoutedExpertsStoreSizing:
    """Worker mixin: size the routed-experts store before the runner reads it."""

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        apply_routed_experts_store_bytes(self.vllm_config, kv_cache_config)
        super().initialize_from_config(kv_cache_config)  # type: ignore[misc]


class HybridWorker(RoutedExpertsStoreSizing, Worker):
    """vLLM's GPU ``Worker`` with the routed-experts store sized by the overlay."""
