"""The routed-experts store on the CUDA start-up path, with vLLM's own worker
class: a plain ``vllm serve --enable-return-routed-experts`` gets the store
sized from the attention pool's token slots, not from the scheduler block
size (the LCM of every group's block size)."""

from __future__ import annotations

import pytest
from cuda_startup import (
    MiB,
    backend_class,
    initialize_worker,
    plan_engine_core,
    start_worker,
)
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

BUDGET = 256 * MiB
#: Qwen3.6-35B-A3B routes each token through 8 of 256 experts in each of its
#: 40 MoE layers; an expert id fits one byte.
ROUTING_BYTES_PER_TOKEN = 40 * 8 * 1


@pytest.fixture(scope="module")
def routed(cuda_configs):
    request, config = cuda_configs(BUDGET, 16)
    # --enable-return-routed-experts (vLLM refuses it at config time off
    # Model Runner V2, which this CPU host does not run)
    config.aux_output_config.enable_return_routed_experts = True
    # --mamba-block-size 64: a state checkpoint every 4 attention blocks, so
    # the scheduler block (the groups' LCM) is 64 tokens
    config.cache_config.mamba_block_size = 64
    startup = start_worker(request, backend_class("FLASH_ATTN"), base=config)
    core = plan_engine_core(startup)
    (worker_config,) = core.worker_configs
    return startup.vllm_config, worker_config


def test_vllms_worker_sizes_the_store_from_the_token_pool(routed):
    vllm_config, worker_config = routed
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(
        worker_config, vllm_config
    )
    assert (scheduler_block, hash_block) == (64, 16)
    runner = initialize_worker(vllm_config, worker_config)
    # one 16-token attention block per id of the arena's token id space
    slots = worker_config.num_blocks * 16
    assert runner.store_bytes == [slots * ROUTING_BYTES_PER_TOKEN]
    # upstream's default, num_blocks scheduler blocks, is four times that
    upstream = worker_config.num_blocks * scheduler_block * ROUTING_BYTES_PER_TOKEN
    assert upstream == 4 * runner.store_bytes[0]


def test_a_size_the_user_set_is_kept(routed):
    vllm_config, worker_config = routed
    vllm_config.aux_output_config.max_bytes = 4 * MiB
    try:
        runner = initialize_worker(vllm_config, worker_config)
    finally:
        vllm_config.aux_output_config.max_bytes = None
    assert runner.store_bytes == [4 * MiB]
