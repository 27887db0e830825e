"""Pooled mode on a CUDA device, in one cheap engine (skipped without one).

The tiny qwen3_5 (6 GDN + 2 attention layers) at a 64 MiB KV budget, 16-token
blocks, eager: every layer's cache must be a view of one CUDA allocation of
exactly the planned arena, and greedy decoding must give the same tokens
when the same prompts run again against what the first pass cached. The
kernels' conformance on CUDA and the comparison with upstream's engine are
the device run's (scripts/gpu, tests/kernels) and tests/gpu/test_modes_agree.py.
"""

from __future__ import annotations

import pytest
import torch
from engine_utils import engine_core, with_engine

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

MiB = 2**20
BUDGET = 64 * MiB
PREFIX = list(range(7, 7 + 96))
PROMPTS = [{"prompt_token_ids": PREFIX + tail} for tail in ([3, 5], [4, 6, 9])]
TOKENS = 8


def layer_caches(llm) -> list[torch.Tensor]:
    """Every tensor a layer of the in-process worker binds as its cache."""
    worker = engine_core(llm).model_executor.driver_worker.worker
    context = worker.vllm_config.compilation_config.static_forward_context
    found = []
    for layer in context.values():
        stack = [getattr(layer, "kv_cache", None)]
        while stack:
            item = stack.pop()
            if isinstance(item, (list, tuple)):
                stack.extend(item)
            elif isinstance(item, torch.Tensor):
                found.append(item)
    return found


def run(llm) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    passes = [llm.generate(PROMPTS, params, use_tqdm=False) for _ in range(2)]
    caches = layer_caches(llm)
    config = engine_core(llm).scheduler.kv_cache_config
    return {
        "arena_bytes": getattr(config, "arena_bytes", None),
        "storages": {t.untyped_storage().data_ptr() for t in caches},
        "storage_bytes": {t.untyped_storage().nbytes() for t in caches},
        "devices": {t.device.type for t in caches},
        "caches": len(caches),
        "tokens": [[list(o.outputs[0].token_ids) for o in p] for p in passes],
    }


@pytest.fixture(scope="module")
def pooled(tiny_model_dir):
    kwargs = dict(
        kv_cache_memory_bytes=BUDGET,
        max_model_len=2048,
        block_size=16,
        enable_prefix_caching=True,
    )
    return with_engine(str(tiny_model_dir("qwen3_5")), True, kwargs, run)


def test_every_layer_cache_is_a_view_of_one_cuda_arena(pooled):
    assert pooled["arena_bytes"] == BUDGET
    # 6 GDN layers x (conv, SSM state) + 2 attention layers
    assert pooled["caches"] == 14
    assert len(pooled["storages"]) == 1
    assert pooled["storage_bytes"] == {BUDGET}
    assert pooled["devices"] == {"cuda"}


def test_greedy_tokens_repeat_over_the_cached_prefix(pooled):
    first, again = pooled["tokens"]
    assert [len(t) for t in first] == [TOKENS, TOKENS]
    assert again == first
