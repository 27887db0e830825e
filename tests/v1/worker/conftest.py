"""Fixtures of the CUDA start-up tier: the checkpoint directory and the CUDA
configs built from it (once per session; tests deep-copy what they change)."""

from __future__ import annotations

import copy

import pytest
from cuda_startup import cuda_config, cuda_request, write_qwen36_fp8


@pytest.fixture(scope="session")
def qwen36_dir(tmp_path_factory):
    """A Qwen3.6-35B-A3B-FP8-shaped ``config.json``, no weights."""
    return write_qwen36_fp8(tmp_path_factory.mktemp("qwen3.6-35b-a3b-fp8"))


@pytest.fixture(scope="session")
def cuda_configs(qwen36_dir):
    """``cuda_configs(budget, block_size, kv_cache_dtype) -> (request, config)``:
    the request and a private copy of the CUDA ``VllmConfig`` for it."""
    cache: dict[tuple, tuple] = {}

    def get(budget: int, block_size: int | None, kv_cache_dtype: str = "auto"):
        key = (budget, block_size, kv_cache_dtype)
        if key not in cache:
            request = cuda_request(
                qwen36_dir,
                budget=budget,
                block_size=block_size,
                kv_cache_dtype=kv_cache_dtype,
            )
            cache[key] = (request, cuda_config(request))
        request, config = cache[key]
        return request, copy.deepcopy(config)

    return get
