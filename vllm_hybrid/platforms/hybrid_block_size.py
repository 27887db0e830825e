"""Block sizes for hybrid models without inflation when pooled mode is on.

Upstream's ``Platform._align_hybrid_block_size`` raises the attention block
until one attention page is at least one state page, then pads the state page
to equal it, because every group shares one pool with one page size. Pooled
mode gives each page kind its own pool, so attention keeps the backend's (or
the user's) block size and state pages keep their exact size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_hybrid.logger import init_logger
from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.v1.core.pooled.scope import pooled_mode_decision
from vllm_hybrid.v1.worker.pooled_views import check_kernel_blocks

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backend import AttentionBackend

logger = init_logger(__name__)


def _align_hybrid_block_size(
    cls, vllm_config: VllmConfig, backend_cls: type[AttentionBackend]
) -> None:
    decision = pooled_mode_decision(vllm_config)
    if not decision.enabled:
        upstream_of(__name__, "align_hybrid_block_size").__func__(
            cls, vllm_config, backend_cls
        )
        return
    cache_config = vllm_config.cache_config
    # Before specs, profiling and allocation: pooled token blocks are never
    # split into kernel blocks, so the backends must run this block as it is.
    backends = cls._find_non_ssm_backends(vllm_config) or [backend_cls]
    check_kernel_blocks(vllm_config, backends)
    if cache_config.mamba_cache_mode == "align":
        cache_config.mamba_block_size = checkpoint_interval(
            cache_config.block_size, cache_config.mamba_block_size
        )
    cache_config.mamba_page_size_padded = None
    logger.info_once(
        "vllm-hybrid pooled KV mode: attention keeps its natural block of %d "
        "tokens; state pages are not padded",
        cache_config.block_size,
    )


def checkpoint_interval(block_size: int, requested: int | None) -> int:
    """Tokens between state checkpoints in align mode (``mamba_block_size``).

    Default: the attention block, as upstream does after its alignment (the
    block is just not inflated here); values at or below the block count as
    unset. ``--mamba-block-size`` may ask for a larger multiple of it:
    checkpoints (one state page each) then come every that many tokens, and
    prefix hits land on its multiples. Upstream plans group
    block sizes that differ (scheduler block = their LCM, hashes at their
    GCD); a multiple keeps that LCM equal to the interval.
    """
    if requested is None or requested <= block_size:
        # unset, or a value a config hook copied from an earlier (smaller)
        # block size before the platform chose the final one
        return block_size
    if requested % block_size:
        raise ValueError(
            f"--mamba-block-size {requested} must be a multiple of the attention "
            f"block size {block_size} in vllm-hybrid's pooled mode (state "
            f"checkpoints sit on attention block edges); use "
            f"{requested // block_size * block_size} or "
            f"{-(-requested // block_size) * block_size}, or leave it unset for "
            f"{block_size}"
        )
    return requested


def early_interval_error(vllm_config: VllmConfig) -> str | None:
    """The :func:`checkpoint_interval` error for ``vllm_config``, found where
    the engine's configuration is made, or None.

    The platform hook above runs in the workers, after the model load, where
    an error ends in one traceback per process. The block size is final in the
    front-end only when the user set it or the platform is the CPU (its
    attention keeps its block); otherwise the workers decide, as before.
    """
    from vllm.platforms import current_platform

    cache_config = vllm_config.cache_config
    if cache_config.mamba_cache_mode != "align" or not cache_config.block_size:
        return None
    if not (
        getattr(cache_config, "user_specified_block_size", False)
        or current_platform.is_cpu()
    ):
        return None
    if not pooled_mode_decision(vllm_config).enabled:
        return None
    try:
        checkpoint_interval(cache_config.block_size, cache_config.mamba_block_size)
    except ValueError as exc:
        return str(exc)
    return None


def _align_heterogeneous_kv_block_size(
    cls, vllm_config: VllmConfig, backend_cls: type[AttentionBackend]
) -> None:
    """Upstream raises the attention block until a quantized page covers a
    native-dtype skip layer's page and pads the skip pages to it (one pool,
    one page). Pooled mode puts each layer's own page into the token block,
    so every layer keeps its natural page and the block size stays."""
    if not pooled_mode_decision(vllm_config).enabled:
        upstream_of(__name__, "align_heterogeneous_kv_block_size").__func__(
            cls, vllm_config, backend_cls
        )
        return
    vllm_config.cache_config.skip_page_size_padded = None
    logger.info_once(
        "vllm-hybrid pooled KV mode: KV cache skip layers keep their native "
        "page next to the %s layers in one token block of %d tokens",
        vllm_config.cache_config.cache_dtype,
        vllm_config.cache_config.block_size,
    )


align_hybrid_block_size = classmethod(_align_hybrid_block_size)
align_heterogeneous_kv_block_size = classmethod(_align_heterogeneous_kv_block_size)
