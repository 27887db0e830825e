"""Where pooled mode applies: hybrid models, minus the features it lacks
(docs/pooled-mode.md, "Scope guard"). The only place that decides, so that
every process reaches the same answer for one ``VllmConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_hybrid.config.hybrid_kv import HybridKVOptions
from vllm_hybrid.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


@dataclass(frozen=True)
class PooledDecision:
    """Whether pooled mode applies, and if not, why (for the one log line)."""

    enabled: bool
    reason: str


def _unsupported_feature(vllm_config: VllmConfig) -> str | None:
    """The first feature pooled mode does not support yet, or None."""
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    checks: list[tuple[bool, str]] = [
        (vllm_config.kv_transfer_config is not None, "KV connectors/transfer"),
        (
            getattr(vllm_config.attention_config, "hisparse_config", None) is not None,
            "HiSparse",
        ),
        (
            getattr(parallel, "decode_context_parallel_size", 1) > 1,
            "decode context parallel",
        ),
        (
            getattr(parallel, "prefill_context_parallel_size", 1) > 1,
            "prefill context parallel",
        ),
        (
            _unpooled_drafts(vllm_config),
            "speculative decoding with a separate draft model (draft_model)",
        ),
        (cache.num_gpu_blocks_override is not None, "num_gpu_blocks_override"),
        (
            _adaptive_verification(vllm_config),
            "adaptive speculative verification",
        ),
    ]
    for unsupported, name in checks:
        if unsupported:
            return name
    return None


#: Speculative methods pooled mode plans: their draft layers, if any, are
#: attention layers that join the token pool.
POOLED_DRAFT_METHODS = frozenset({"ngram", "mtp", "eagle"})


def _unpooled_drafts(vllm_config: VllmConfig) -> bool:
    spec = vllm_config.speculative_config
    return spec is not None and spec.method not in POOLED_DRAFT_METHODS


def _adaptive_verification(vllm_config: VllmConfig) -> bool:
    """Model Runner V2 profiles adaptive verification on dummy block ids
    that wrap at the token pool's ``num_blocks``: past the state pool."""
    spec = vllm_config.speculative_config
    return spec is not None and bool(
        getattr(spec, "enable_adaptive_verification", False)
    )


_logged_fallbacks: set[str] = set()


def pooled_mode_decision(vllm_config: VllmConfig) -> PooledDecision:
    """Decide pooled mode for this config; a feature it lacks is logged
    once and leaves upstream's single pool."""
    model_config = vllm_config.model_config
    if model_config is None or not getattr(model_config, "is_hybrid", False):
        return PooledDecision(False, "not a hybrid model")
    options = HybridKVOptions.from_vllm_config(vllm_config)
    if not options.pooled:
        return PooledDecision(False, "disabled by --additional-config")
    feature = _unsupported_feature(vllm_config)
    if feature is not None:
        if feature not in _logged_fallbacks:
            _logged_fallbacks.add(feature)
            logger.info(
                "vllm-hybrid pooled KV mode does not support %s yet; using "
                "upstream's single shared KV pool for this engine",
                feature,
            )
        return PooledDecision(False, f"unsupported: {feature}")
    return PooledDecision(True, "hybrid model")
