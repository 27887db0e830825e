"""CPU worker of the overlay: the routed-experts store sizing of the GPU one.

Only useful with ``VLLM_USE_V2_MODEL_RUNNER=1``: vLLM 0.32 accepts
``enable_return_routed_experts`` only with Model Runner V2, and the CPU
platform runs the V1 runner unless told otherwise. Select with
``--worker-cls vllm_hybrid.v1.worker.cpu_worker.HybridCPUWorker``.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_worker import CPUWorker

from vllm_hybrid.v1.worker.gpu_worker import RoutedExpertsStoreSizing


class HybridCPUWorker(RoutedExpertsStoreSizing, CPUWorker):
    """vLLM's ``CPUWorker`` with the routed-experts store sized by the overlay."""
