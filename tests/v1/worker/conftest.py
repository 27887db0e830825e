"""Fixtures of the CUDA start-up tier: the checkpoint directory and the CUDA
configs built from it (once per session or module; tests deep-copy what they
change)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from cuda_startup import (
    backend_class,
    cuda_config,
    cuda_request,
    current_platform_as,
    write_qwen36_fp8,
)

from vllm_hybrid.tools.plan.config import platform_class


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


@pytest.fixture(scope="module")
def graph_configs(qwen36_dir):
    """``graph_configs(max_num_seqs, max_capture) -> (request, config)``: the
    CUDA config with the capture sizes a CUDA host computes (on this host
    vLLM computed none: the CPU platform runs no graphs)."""
    done: dict[tuple, tuple] = {}

    def get(max_num_seqs: int, max_capture: int | None):
        key = (max_num_seqs, max_capture)
        if key not in done:
            request = dataclasses.replace(
                cuda_request(qwen36_dir, budget=2**30, block_size=None),
                max_num_seqs=max_num_seqs,
            )
            config = cuda_config(request)
            compilation = config.compilation_config
            compilation.cudagraph_capture_sizes = None
            compilation.max_cudagraph_capture_size = max_capture
            platform = platform_class("cuda", backend_class("FLASH_ATTN"), None)
            with current_platform_as(platform()):
                config._set_cudagraph_sizes()
            done[key] = (request, config)
        request, config = done[key]
        return request, copy.deepcopy(config)

    return get
