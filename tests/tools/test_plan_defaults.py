"""The planner's CUDA defaults are vLLM 0.32's own.

``vllm-hybrid plan`` answers bad input before importing vLLM, so the
defaults it needs early are written down
(:data:`~vllm_hybrid.tools.plan.request.VLLM_GPU_MEMORY_UTILIZATION`,
:data:`~vllm_hybrid.tools.plan.cuda_defaults.SERVE_BATCH_DEFAULTS`); these
tests ask the installed vLLM for the same numbers.
"""

from __future__ import annotations

import pytest

from vllm_hybrid.tools.plan.cuda_defaults import (
    DEVICE_NAME,
    cuda_platform,
    serve_defaults,
)
from vllm_hybrid.tools.plan.request import VLLM_GPU_MEMORY_UTILIZATION


def test_gpu_memory_utilization_is_vllms_default():
    from vllm.config.cache import CacheConfig

    assert CacheConfig().gpu_memory_utilization == VLLM_GPU_MEMORY_UTILIZATION


@pytest.mark.parametrize(
    ("gpu_gib", "name", "seqs", "tokens"),
    [
        (24, DEVICE_NAME, 256, 2048),
        (48, DEVICE_NAME, 256, 2048),
        (69.9, DEVICE_NAME, 256, 2048),
        (80, DEVICE_NAME, 1024, 8192),
        (141, DEVICE_NAME, 1024, 8192),
        (192, DEVICE_NAME, 1024, 16384),
        # vLLM keeps A100s at the small defaults whatever their memory
        (80, "NVIDIA A100-SXM4-80GB", 256, 2048),
    ],
)
def test_serve_batch_defaults_are_vllms(monkeypatch, gpu_gib, name, seqs, tokens):
    import vllm.engine.arg_utils as arg_utils
    from vllm.usage.usage_lib import UsageContext

    platform = cuda_platform(object, None, gpu_gib)
    if name != DEVICE_NAME:
        platform.get_device_name = classmethod(lambda cls, device_id=0: name)
    # get_batch_defaults reads the platform bound in its module at import
    monkeypatch.setattr(arg_utils, "current_platform", platform())
    batch_tokens, max_seqs = arg_utils.EngineArgs.get_batch_defaults(world_size=1)
    server = UsageContext.OPENAI_API_SERVER
    assert (max_seqs[server], batch_tokens[server]) == (seqs, tokens)
    if name == DEVICE_NAME:
        defaults = serve_defaults(gpu_gib)
        assert (defaults.max_num_seqs, defaults.max_num_batched_tokens) == (
            seqs,
            tokens,
        )


def test_unknown_gpu_gets_the_small_defaults():
    defaults = serve_defaults(None)
    assert (defaults.max_num_seqs, defaults.max_num_batched_tokens) == (256, 2048)
