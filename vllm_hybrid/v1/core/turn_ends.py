"""Turn-end checkpoints on the single shared pool (pooled mode off).

The retention mixin (:mod:`vllm_hybrid.v1.core.pooled.retention`) keeps each
request's latest decode checkpoint; here it runs on upstream's hybrid
coordinator, built by the coordinator factory
(:mod:`vllm_hybrid.v1.core.kv_cache_coordinator`) where the plan has an
align-mode state group and ``hybrid_kv.retain_turn_ends`` is on.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

from vllm_hybrid.v1.core.pooled.policy.positions import CheckpointPolicy
from vllm_hybrid.v1.core.pooled.retention import TurnEndRetentionMixin

#: Attribute carrying ``hybrid_kv.retain_turn_ends`` on a single-pool
#: ``KVCacheConfig`` from the planning step to the scheduler's coordinator.
RETAIN_ATTRIBUTE = "retain_turn_ends"


def has_align_state_groups(kv_cache_config: KVCacheConfig) -> bool:
    """Whether the config has an align-mode state (Mamba) group next to other
    groups: the only groups that leave decode checkpoints behind. With a
    state cached at every block edge (``all``) or none cached (``none``)
    there is no turn end to keep, and upstream's coordinator serves."""
    groups = kv_cache_config.kv_cache_groups
    return len(groups) > 1 and any(
        isinstance(g.kv_cache_spec, MambaSpec)
        and g.kv_cache_spec.mamba_cache_mode == "align"
        for g in groups
    )


def mark_turn_end_retention(kv_cache_config: KVCacheConfig, retain: bool) -> None:
    """Record the option on a hybrid single-pool config (registry:
    ADDED_ATTRIBUTES); other configs are left exactly as upstream made them."""
    if has_align_state_groups(kv_cache_config):
        setattr(kv_cache_config, RETAIN_ATTRIBUTE, retain)


class TurnEndHybridKVCacheCoordinator(TurnEndRetentionMixin, HybridKVCacheCoordinator):
    """Single shared pool, prefix caching on: upstream's hybrid coordinator
    keeping turn-end checkpoints. Built only when the option is on (the
    factory reads :data:`RETAIN_ATTRIBUTE`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_turn_ends(CheckpointPolicy.of(True))
