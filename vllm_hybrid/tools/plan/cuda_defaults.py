"""What ``vllm serve`` picks on a CUDA GPU of the size planned for.

vLLM 0.32 chooses ``max_num_seqs`` and ``max_num_batched_tokens`` from the
GPU's memory (``EngineArgs.get_batch_defaults``: 1,024 sequences and 8,192
tokens from 70 GiB up, 16,384 tokens from 160 GiB, except on A100s; 256 and
2,048 below), and the CUDA
graph capture sizes from ``max_num_seqs`` (``VllmConfig``: up to twice the
sequences, at most 512). On this host vLLM would answer for the CPU: the
batch limits are vLLM's table (checked against vLLM by a test), and the
capture sizes come from vLLM's own method with a platform that reports the
GPU. The
full CUDA graphs of those sizes are what a pooled or single-pool engine
sizes against its states (:mod:`vllm_hybrid.v1.worker.cudagraph_capacity`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_hybrid.tools.plan.config import current_platform_as, platform_class
from vllm_hybrid.tools.plan.request import PlanRequest

if TYPE_CHECKING:
    from vllm.config import VllmConfig

GiB = 2**30

#: Device name the stand-in reports: vLLM keeps A100s at the small defaults,
#: every other GPU is judged by its memory alone.
DEVICE_NAME = "NVIDIA GPU"


@dataclass(frozen=True)
class ServeDefaults:
    """``vllm serve``'s batch limits for one GPU size."""

    max_num_seqs: int
    max_num_batched_tokens: int


def cuda_platform(backend: type, align: Any, gpu_memory_gib: float | None) -> type:
    """The planner's CUDA stand-in platform reporting a GPU of that memory
    (none given: a GPU whose memory vLLM could not read, which gets vLLM's
    small defaults)."""
    memory = int(gpu_memory_gib * GiB) if gpu_memory_gib else 0
    base = platform_class("cuda", backend, align)
    return type(
        base.__name__,
        (base,),
        {
            "get_device_total_memory": classmethod(lambda cls, device_id=0: memory),
            "get_device_name": classmethod(lambda cls, device_id=0: DEVICE_NAME),
        },
    )


#: ``vllm serve``'s batch limits by GPU memory, largest first: (at least this
#: many GiB, max_num_seqs, max_num_batched_tokens). vLLM 0.32's
#: ``EngineArgs.get_batch_defaults`` for the OpenAI server on CUDA (A100s
#: keep the last row at any size); ``tests/tools/test_plan_defaults.py``
#: checks every row against it.
SERVE_BATCH_DEFAULTS: tuple[tuple[float, int, int], ...] = (
    (160, 1024, 16384),
    (70, 1024, 8192),
    (0, 256, 2048),
)


def serve_defaults(gpu_memory_gib: float | None) -> ServeDefaults:
    """``max_num_seqs`` and ``max_num_batched_tokens`` of ``vllm serve`` on
    a CUDA GPU of this memory (None: one vLLM cannot read, the last row)."""
    memory = gpu_memory_gib or 0
    for at_least, seqs, tokens in SERVE_BATCH_DEFAULTS:
        if memory >= at_least:
            return ServeDefaults(seqs, tokens)
    raise AssertionError("the last row covers every size")


def set_cuda_graph_sizes(vllm_config: VllmConfig, gpu_memory_gib: float | None) -> None:
    """Fill in the CUDA graph capture sizes a CUDA host computes.

    vLLM derives them in ``VllmConfig`` when it is built; on this host the
    CPU platform ran no graphs, so none were computed. Sizes the user set
    (``-cc.cudagraph_capture_sizes``) are kept as they are.
    """
    compilation = vllm_config.compilation_config
    if compilation.cudagraph_capture_sizes:
        return
    compilation.cudagraph_capture_sizes = None
    platform = cuda_platform(object, None, gpu_memory_gib)
    with current_platform_as(platform()):
        vllm_config._set_cudagraph_sizes()


def with_serve_defaults(request: PlanRequest) -> PlanRequest:
    """``request`` with the batch limits ``vllm serve`` picks on its GPU
    where the user left them open (the CPU engine's defaults are not a CUDA
    host's)."""
    defaults = serve_defaults(request.gpu_memory_gib)
    return dataclasses.replace(
        request,
        max_num_seqs=request.max_num_seqs or defaults.max_num_seqs,
        max_num_batched_tokens=(
            request.max_num_batched_tokens or defaults.max_num_batched_tokens
        ),
    )
