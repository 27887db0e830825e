"""Replacements of upstream's ``vllm.v1.core.kv_cache_utils`` entry points.

Thin dispatchers: pooled plans go to :mod:`vllm_hybrid.v1.core.pooled`, the
single shared pool of other hybrid plans to
:mod:`vllm_hybrid.v1.core.page_unification`,
:mod:`vllm_hybrid.v1.core.token_capacity` and
:mod:`vllm_hybrid.v1.core.pooled.capacity`, and everything else to upstream's
function unchanged. The patch registry (:mod:`vllm_hybrid.patches.registry`)
installs them and holds their targets; for models without state groups they
return exactly what upstream returns.
"""

from __future__ import annotations

import dataclasses
from contextvars import ContextVar
from typing import TYPE_CHECKING

import vllm.v1.core.kv_cache_utils as _upstream_utils
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec

from vllm_hybrid.config.hybrid_kv import HybridKVOptions, PageUnificationLimits
from vllm_hybrid.logger import init_logger
from vllm_hybrid.patches.registry import repair, upstream_of
from vllm_hybrid.v1.core.page_unification import unify_page_sizes
from vllm_hybrid.v1.core.pooled.capacity import (
    group_blocks_per_request,
    pooled_capacity,
    shared_pool_token_capacity,
)
from vllm_hybrid.v1.core.pooled.engine import (
    plan_pooled_configs,
    update_pooled_capacity,
)
from vllm_hybrid.v1.core.pooled.policy.steps import state_checkpoint_block
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig
from vllm_hybrid.v1.core.sched.async_scheduler import PooledAsyncScheduler
from vllm_hybrid.v1.core.sched.scheduler import (
    PooledScheduler,
    PooledSchedulerMixin,
)
from vllm_hybrid.v1.core.token_capacity import split_token_groups
from vllm_hybrid.v1.core.turn_ends import mark_turn_end_retention

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

#: The config of the KV cache planning in progress. Upstream calls the page
#: unification without the config; :func:`get_kv_cache_groups` publishes it
#: here so that ``--additional-config`` reaches the limits.
_planning_config: ContextVar[VllmConfig | None] = ContextVar(
    "vllm_hybrid_planning_config", default=None
)


def _current_vllm_config() -> VllmConfig | None:
    config = _planning_config.get()
    if config is not None:
        return config
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def page_unification_limits() -> PageUnificationLimits:
    """The limits of the planning in progress (``--additional-config``, else
    the defaults), with the engine's ``max_model_len``
    as the bound on block growth."""
    config = _current_vllm_config()
    limits = HybridKVOptions.from_vllm_config(config).page_limits
    model_config = getattr(config, "model_config", None)
    max_model_len = getattr(model_config, "max_model_len", None)
    if isinstance(max_model_len, int) and max_model_len > 0:
        limits = dataclasses.replace(limits, max_block_tokens=max_model_len)
    return limits


# -- page sizes ---------------------------------------------------------------


def get_kv_cache_groups(
    vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec]
) -> list[KVCacheGroupSpec]:
    """Upstream's grouping, with ``vllm_config`` visible to the unification
    (which upstream calls with the specs alone) for the whole call."""
    token = _planning_config.set(vllm_config)
    try:
        return upstream_of(__name__, "get_kv_cache_groups")(vllm_config, kv_cache_spec)
    finally:
        _planning_config.reset(token)


def unify_kv_cache_spec_page_size(
    kv_cache_spec: dict[str, KVCacheSpec],
    limits: PageUnificationLimits | None = None,
) -> dict[str, KVCacheSpec]:
    """Upstream's unification where pages divide, else LCM pages with only
    state pages padded (:func:`~vllm_hybrid.v1.core.page_unification.
    unify_page_sizes`)."""
    return unify_page_sizes(
        kv_cache_spec,
        page_unification_limits if limits is None else (lambda: limits),
        upstream_of(__name__, "unify_kv_cache_spec_page_size"),
    )


# -- plans ----------------------------------------------------------------


def select_scheduler(
    vllm_config: VllmConfig, kv_cache_config: PooledKVCacheConfig
) -> None:
    """Make the engine core build :class:`PooledScheduler` (or its async twin)
    for a pooled plan: it publishes per-pool usage once per step and ends
    prefill chunks on state checkpoint edges (when the state block is longer
    than the attention block) and at prefill checkpoints.

    Runs in the engine-core process after KV planning, before the scheduler
    class is resolved. A scheduler class the user chose is kept; a warning
    says what it misses.
    """
    scheduler_config = vllm_config.scheduler_config
    if scheduler_config.scheduler_cls is None:
        scheduler_config.scheduler_cls = (
            PooledAsyncScheduler
            if scheduler_config.async_scheduling
            else PooledScheduler
        )
        return
    chosen = scheduler_config.scheduler_cls
    if isinstance(chosen, type) and issubclass(chosen, PooledSchedulerMixin):
        return
    block = state_checkpoint_block(
        kv_cache_config, vllm_config.cache_config.mamba_cache_mode
    )
    if block is not None:
        logger.warning(
            "vllm-hybrid pooled KV mode: --scheduler-cls %s ends prefill chunks "
            "on attention block edges, so state checkpoints every %d tokens "
            "(--mamba-block-size) are written only where a chunk happens to end "
            "and prefix hits are lost; leave --scheduler-cls unset, or set "
            "--mamba-block-size to the attention block",
            chosen,
            block,
        )
    interval = getattr(kv_cache_config, "prefill_checkpoint_interval", 0)
    if interval:
        logger.warning(
            "vllm-hybrid pooled KV mode: --scheduler-cls %s does not end prefill "
            "chunks at prefill checkpoints (every %d tokens), so a shared prefix "
            "hits only from its second reuse on; leave --scheduler-cls unset",
            chosen,
            interval,
        )


def get_kv_cache_configs(
    vllm_config: VllmConfig,
    kv_cache_specs: list[dict[str, KVCacheSpec]],
    available_memory: list[int],
) -> list[KVCacheConfig]:
    """Upstream's ``get_kv_cache_configs``, pooled for hybrid models.

    The engine core calls this through its own by-name binding at every
    engine start, which survives a reload of ``kv_cache_utils``; so this is
    where patches lost to a reload are found and bound again.
    """
    repair()
    pooled = plan_pooled_configs(vllm_config, kv_cache_specs, available_memory)
    if pooled is not None:
        select_scheduler(vllm_config, pooled[0])
        return pooled
    configs = upstream_of(__name__, "get_kv_cache_configs")(
        vllm_config, kv_cache_specs, available_memory
    )
    retain = HybridKVOptions.from_vllm_config(vllm_config).retain_turn_ends
    for config in configs:
        mark_turn_end_retention(config, retain)
    return configs


# -- capacity -------------------------------------------------------------


def kv_cache_token_capacity(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> int:
    """Tokens one request can hold in the shared pool of a hybrid model
    (:func:`~vllm_hybrid.v1.core.pooled.capacity.shared_pool_token_capacity`).

    Models without state groups (and HiSparse configs) keep upstream's
    figure, ``max_concurrency * max_model_len``; a config without groups has
    no capacity.
    """
    split = split_token_groups(vllm_config, kv_cache_config)
    if split is not None:
        return shared_pool_token_capacity(vllm_config, kv_cache_config, split)
    if not kv_cache_config.kv_cache_groups:
        return 0
    return upstream_of(__name__, "get_kv_cache_capacity")(vllm_config, kv_cache_config)[
        0
    ]


def get_kv_cache_capacity(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[int, float]:
    """``(token capacity, max concurrency)`` of a KV cache config.

    Pooled plans: the token pool's capacity and both pools' concurrency.
    Other hybrid plans: :func:`kv_cache_token_capacity` and upstream's
    concurrency over every group. Models without state groups: upstream's.
    """
    if isinstance(kv_cache_config, PooledKVCacheConfig):
        capacity = pooled_capacity(
            kv_cache_config, vllm_config.model_config.max_model_len
        )
        return capacity.token_capacity, capacity.max_concurrency
    if split_token_groups(vllm_config, kv_cache_config) is None:
        return upstream_of(__name__, "get_kv_cache_capacity")(
            vllm_config, kv_cache_config
        )
    max_concurrency = _upstream_utils.get_max_concurrency_for_kv_cache_config(
        vllm_config, kv_cache_config
    )
    return kv_cache_token_capacity(vllm_config, kv_cache_config), max_concurrency


def update_kv_cache_capacity(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> None:
    """Store and log the KV cache capacity, counting only token groups.

    Sets ``cache_config.kv_cache_size_tokens`` and
    ``kv_cache_max_concurrency`` like upstream; for hybrid models the log line
    says that the tokens are those of the groups that grow with the sequence.
    """
    if isinstance(kv_cache_config, PooledKVCacheConfig):
        device = _upstream_utils._kv_cache_device_name(vllm_config)
        update_pooled_capacity(vllm_config, kv_cache_config, device)
        return
    split = split_token_groups(vllm_config, kv_cache_config)
    if split is None:
        upstream_of(__name__, "update_kv_cache_capacity")(vllm_config, kv_cache_config)
        return
    token_groups, others = split
    num_tokens, max_concurrency = get_kv_cache_capacity(vllm_config, kv_cache_config)
    cache_config = vllm_config.cache_config
    cache_config.kv_cache_size_tokens = num_tokens
    cache_config.kv_cache_max_concurrency = max_concurrency
    logger.info_once(
        "%s KV cache size: %s tokens (counting only the %d of %d KV cache "
        "groups whose memory grows with sequence length; the other groups "
        "hold %d block(s) per request from the same pool), Maximum "
        "concurrency for %s tokens per request: %.2fx",
        _upstream_utils._kv_cache_device_name(vllm_config),
        f"{num_tokens:,}",
        len(token_groups),
        len(kv_cache_config.kv_cache_groups),
        group_blocks_per_request(vllm_config, others),
        f"{vllm_config.model_config.max_model_len:,}",
        max_concurrency,
    )
