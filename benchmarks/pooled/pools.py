"""What the benchmark reads from a scheduler's KV cache: the bytes a request
truly needs (from the layer specs) and the blocks its pools hold, both modes
as :class:`PoolUsage` (docs/benchmarks.md, "Shared measurements")."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_hybrid.v1.core.pooled.usage import PoolUsage

#: Name of upstream's single pool in the results.
SHARED_POOL = "shared"


@dataclass(frozen=True)
class KVGeometry:
    """What one request really needs, from the model's layer specs (unpadded:
    ``needed/reserved`` shows padding, rounding and fragmentation)."""

    #: Bytes one token occupies summed over all attention layers.
    attn_bytes_per_token: float
    #: Bytes of one request's recurrent state summed over all state layers.
    state_bytes_per_request: int
    num_attention_layers: int
    num_state_layers: int
    #: Layers of other spec types; they are not counted in "needed".
    other_layers: tuple[str, ...] = ()

    def bytes_needed(self, num_computed_tokens: Iterable[int]) -> float:
        """Bytes the running requests with these token counts truly need."""
        counts = list(num_computed_tokens)
        return sum(counts) * self.attn_bytes_per_token + len(counts) * (
            self.state_bytes_per_request
        )

    def token_bound(self, budget_bytes: int) -> int:
        """Longest sequence one request could have if bytes were exact."""
        if self.attn_bytes_per_token <= 0:
            return 0
        free = budget_bytes - self.state_bytes_per_request
        return max(0, math.floor(free / self.attn_bytes_per_token))


def _layer_specs(kv_cache_config: Any) -> Iterator[tuple[str, Any]]:
    """(layer name, spec) of every layer of a ``KVCacheConfig``."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            yield from spec.kv_cache_specs.items()
        else:
            yield from ((name, spec) for name in group.layer_names)


def kv_geometry(kv_cache_config: Any) -> KVGeometry:
    """Per-token and per-request bytes of a ``KVCacheConfig``'s layers,
    unpadded (``real_page_size_bytes``)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    layers = list(_layer_specs(kv_cache_config))
    attention = [spec for _, spec in layers if isinstance(spec, AttentionSpec)]
    state = [spec for _, spec in layers if isinstance(spec, MambaSpec)]
    return KVGeometry(
        sum((spec.real_page_size_bytes / spec.block_size for spec in attention), 0.0),
        sum(spec.real_page_size_bytes for spec in state),
        len(attention),
        len(state),
        tuple(n for n, s in layers if not isinstance(s, (AttentionSpec, MambaSpec))),
    )


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


def pool_record(pool: PoolUsage) -> dict[str, Any]:
    """One pool in the engine description of a result file (the keys result
    files have always used, so old and new ones compare)."""
    return {
        "name": pool.pool,
        "block_bytes": pool.page_bytes,
        "num_blocks_total": pool.owned_blocks,
        "num_free": pool.owned_blocks - pool.used_blocks,
    }


def kv_layout_name(pools: Sequence[PoolUsage]) -> str:
    """ "pooled" when the scheduler has separate pools, else "single"."""
    return "pooled" if len(pools) > 1 else "single"


def coupled_evictions(scheduler: Any) -> int | None:
    """Blocks pooled mode evicted because the other pool made them useless
    (coordinated prefix-cache eviction); None without coupling."""
    from vllm_hybrid.v1.core.pooled.coordinator import arena_of

    arena = arena_of(scheduler.kv_cache_manager)
    return None if arena is None else arena.coupled_evictions()


@dataclass(frozen=True)
class KVSample:
    """Scheduler state after one engine step."""

    step: int
    running: int
    reserved_bytes: int
    needed_bytes: float

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
    )
