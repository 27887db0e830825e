"""What the benchmark reads from a scheduler's KV cache: the blocks its pools
hold, both modes as :class:`PoolUsage`, against the bytes its requests truly
need (:class:`~vllm_hybrid.tools.plan.geometry.KVGeometry`; docs/benchmarks.md,
"Shared measurements")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_hybrid.tools.plan.geometry import KVGeometry
from vllm_hybrid.v1.core.pooled.usage import PoolUsage

#: Name of upstream's single pool in the results.
SHARED_POOL = "shared"


def kv_pools(scheduler: Any) -> list[PoolUsage]:
    """The block pools of a scheduler and how many blocks each owns (never
    a null block) and uses (evictable cached blocks count as free)."""
    from vllm_hybrid.v1.core.pooled.capacity import shared_block_bytes
    from vllm_hybrid.v1.core.pooled.coordinator import arena_of

    arena = arena_of(scheduler.kv_cache_manager)
    if arena is not None:
        return list(arena.usage().pools)
    pool = scheduler.kv_cache_manager.block_pool
    owned = pool.num_gpu_blocks - 1
    return [
        PoolUsage(
            SHARED_POOL,
            shared_block_bytes(scheduler.kv_cache_config),
            owned,
            owned - pool.get_num_free_blocks(),
        )
    ]


@dataclass(frozen=True)
class KVSample:
    """Scheduler state after one engine step."""

    step: int
    running: int
    reserved_bytes: int
    needed_bytes: float
    #: requests waiting (never started, or preempted) after the step
    waiting: int = 0

    @property
    def needed_over_reserved(self) -> float | None:
        if self.reserved_bytes <= 0:
            return None
        return self.needed_bytes / self.reserved_bytes


def sample_kv(scheduler: Any, geometry: KVGeometry, step: int) -> KVSample:
    """Needed vs reserved bytes of the requests running now."""
    running = list(scheduler.running)
    return KVSample(
        step=step,
        running=len(running),
        reserved_bytes=sum(p.used_bytes for p in kv_pools(scheduler)),
        needed_bytes=geometry.bytes_needed(r.num_computed_tokens for r in running),
        waiting=len(scheduler.waiting),
    )
