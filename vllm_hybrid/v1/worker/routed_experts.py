"""Size of the routed-experts store of the AuxOutput connector.

The store keeps one object per hash block of routing so that a prefix-cache
hit can replay the routing of its tokens. Upstream sizes it from the
scheduler block size, the LCM of every group's block size, which state groups
can inflate far beyond the token slots that exist; here it covers exactly the
token slots of the attention groups. The registry's replacement of
``Worker.initialize_from_config`` (which ``CPUWorker`` inherits) sets the size
before the model runner builds the connector, so a plain ``vllm serve`` gets it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import vllm.v1.core.kv_cache_utils as _upstream_utils
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import KVCacheConfig

from vllm_hybrid.logger import init_logger
from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.v1.core.token_capacity import token_capacity_kv_cache_groups

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_worker import Worker

logger = init_logger(__name__)


def routed_experts_bytes_per_token(vllm_config: VllmConfig) -> int:
    """Host bytes of one token's routing: layers x top-k x expert id size.

    Same shape as the capturer's snapshot; ids are one byte up to 256
    experts and two beyond, as ``RoutedExpertsCapturer`` stores them.
    """
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        _get_routed_experts_shape,
    )

    num_layers, num_experts, top_k = _get_routed_experts_shape(vllm_config)
    id_bytes = 1 if num_experts <= 256 else 2
    return num_layers * top_k * id_bytes


def token_slots(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """Token slots the token groups can address in the shared pool.

    ``num_blocks`` times the largest token span of a token-group block (DCP
    included), i.e. the slot address space of attention. State groups do not
    hold tokens, so their block sizes (which make the scheduler block size,
    an LCM, arbitrarily large) play no part.
    """
    token_groups = token_capacity_kv_cache_groups(vllm_config, kv_cache_config)
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    spans = [
        _upstream_utils.resolve_dcp_kv_block_size(g.kv_cache_spec, dcp)
        for g in token_groups
    ]
    block_span = max(spans, default=vllm_config.cache_config.block_size)
    return kv_cache_config.num_blocks * block_span


def routed_experts_store_bytes(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> int:
    """Default capacity of the routed-experts store for ``kv_cache_config``.

    The store keeps one object per hash block of routing, so that a prefix
    cache hit can replay the routing of its tokens; it therefore has to cover
    every token the attention pool can cache: :func:`token_slots` rounded up
    to whole hash blocks. Upstream uses ``num_blocks`` times the scheduler
    block size instead, which is the same for models whose groups share one
    block size and larger, up to orders of magnitude, when state groups have
    other block sizes.
    """
    _, hash_block_size = _upstream_utils.resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    num_objects = cdiv(token_slots(vllm_config, kv_cache_config), hash_block_size)
    return num_objects * hash_block_size * routed_experts_bytes_per_token(vllm_config)


def apply_routed_experts_store_bytes(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> int | None:
    """Set ``aux_output_config.max_bytes`` unless the user did; return it.

    Must run before the model runner builds the AuxOutput connector, which
    reads the setting once (``initialize_kv_cache``). Does nothing when
    routed-experts capture is off.
    """
    aux_config = vllm_config.aux_output_config
    if not aux_config.enable_return_routed_experts:
        return aux_config.max_bytes
    if aux_config.max_bytes is not None:
        return aux_config.max_bytes
    max_bytes = routed_experts_store_bytes(vllm_config, kv_cache_config)
    aux_config.max_bytes = max_bytes
    logger.info_once(
        "vllm-hybrid: routed-experts store sized to %s B for %s token slots "
        "of the attention pool.",
        f"{max_bytes:,}",
        f"{token_slots(vllm_config, kv_cache_config):,}",
    )
    return max_bytes


def initialize_from_config(self: Worker, kv_cache_config: KVCacheConfig) -> None:
    """Upstream's ``Worker.initialize_from_config``, with the routed-experts
    store sized from the token groups first: the model runner reads the size
    once, when it builds the AuxOutput connector inside this method."""
    apply_routed_experts_store_bytes(self.vllm_config, kv_cache_config)
    upstream_of(__name__, "initialize_from_config")(self, kv_cache_config)
