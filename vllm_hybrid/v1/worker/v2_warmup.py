"""Model Runner V2's start-up kernel warm-up on a pooled KV cache.

Before CUDA-graph capture, V2 runs a few scheduler-shaped steps to compile its
kernels (``vllm/v1/worker/gpu/warmup.py``). It builds the ``SchedulerOutput``
of those steps itself: it sizes the number of warm-up requests by the one
``kv_cache_config.num_blocks``, and hands out block ids for every KV cache
group from one counter. In pooled mode ``num_blocks`` is the token pool's id
space and each group's ids are local to its pool: for Qwen3.6-35B-A3B at
256 MiB that is 128 warm-up requests and state ids up to about 256 where the
state pool's view has 4 blocks, so the warm-up would write GDN states outside
the arena before the first request.

:func:`warmup_kernels_pooled` keeps upstream's steps (which requests, which
tokens, which decode shapes) and replaces only their ids and their number:

* the number of requests is the most whose blocks fit every pool, each pool
  counted on the ids it owns at the arena's initial boundary
  (:func:`warmup_request_limit`);
* every block id upstream hands out is replaced, group by group, by the next
  id of that group's pool (:class:`PooledWarmupIds`), so each block table
  row holds ids of its own pool, rows never share a block, and no token
  block overlaps a state block.

Configs that are not pooled go to upstream's function unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_hybrid.logger import init_logger
from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

logger = init_logger(__name__)


class PooledWarmupError(RuntimeError):
    """Upstream's warm-up asked for more blocks of a pool than it owns."""


def owned_ids(config: PooledKVCacheConfig) -> dict[PoolKind, range]:
    """The ids each pool owns at the arena's initial boundary: the only
    boundary a worker knows before the first request, and the one the
    scheduler's arena starts at."""
    layout = config.layout
    floor = layout.initial_state_floor
    return {
        PoolKind.TOKEN: layout.token_ids_at(floor),
        PoolKind.STATE: layout.state_ids_at(floor),
    }


def warmup_request_limit(
    config: PooledKVCacheConfig, blocks_per_request: Sequence[int]
) -> int:
    """Most warm-up requests whose blocks fit every pool at once.

    ``blocks_per_request[g]`` is what one request holds of group ``g`` at its
    largest; groups of one pool draw on its ids together. 0 when one
    request does not fit.
    """
    owned = owned_ids(config)
    need = dict.fromkeys(owned, 0)
    for group_id, blocks in enumerate(blocks_per_request):
        need[config.pool_of_group(group_id).kind] += blocks
    return min(len(owned[kind]) // n for kind, n in need.items() if n > 0)


@dataclass
class PooledWarmupIds:
    """Upstream's warm-up block ids, renumbered per pool.

    Upstream never hands out an id twice, so each (group, upstream id) gets
    the next free id of the group's pool the first time it is seen, and the
    same id every later time.
    """

    config: PooledKVCacheConfig
    _next: dict[PoolKind, int] = field(init=False)
    _end: dict[PoolKind, int] = field(init=False)
    _seen: list[dict[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        owned = owned_ids(self.config)
        self._next = {kind: ids.start for kind, ids in owned.items()}
        self._end = {kind: ids.stop for kind, ids in owned.items()}
        self._seen = [{} for _ in self.config.kv_cache_groups]

    def pool_ids(self, group_id: int, upstream_ids: Sequence[int]) -> list[int]:
        """Pool-local ids for the ids upstream gave group ``group_id``."""
        kind = self.config.pool_of_group(group_id).kind
        seen = self._seen[group_id]
        ids = []
        for upstream_id in upstream_ids:
            if upstream_id not in seen:
                if self._next[kind] >= self._end[kind]:
                    raise PooledWarmupError(
                        f"Model Runner V2's warm-up needs more {kind} blocks "
                        f"than the {kind} pool owns at its initial boundary "
                        f"(ids up to {self._end[kind] - 1})"
                    )
                seen[upstream_id] = self._next[kind]
                self._next[kind] += 1
            ids.append(seen[upstream_id])
        return ids

    def _per_group(self, block_ids: Sequence[Sequence[int]]) -> tuple[list[int], ...]:
        return tuple(self.pool_ids(g, ids) for g, ids in enumerate(block_ids))

    def translate(self, output: SchedulerOutput) -> SchedulerOutput:
        """Renumber the block ids of one warm-up step in place."""
        for new in output.scheduled_new_reqs:
            new.block_ids = self._per_group(new.block_ids)
        cached = output.scheduled_cached_reqs
        cached.new_block_ids = [
            None if ids is None else self._per_group(ids)
            for ids in cached.new_block_ids
        ]
        return output

    def used(self) -> dict[PoolKind, range]:
        """The ids handed out so far, per pool."""
        owned = owned_ids(self.config)
        return {kind: range(owned[kind].start, self._next[kind]) for kind in owned}


def warmup_blocks_per_request(model_runner: GPUModelRunner) -> list[int]:
    """Blocks of each group one warm-up request holds at its largest.

    Upstream's warm-up prefills ``decode_query_len + 1`` tokens, then decodes
    at most 3 steps (5 with speculative decoding; none for pooling models)
    of ``decode_query_len`` tokens; its block count per group comes from
    upstream's own reservation rule. Should upstream ask for more,
    :class:`PooledWarmupIds` refuses instead of leaving the pool.
    """
    from vllm.v1.worker.gpu.warmup import _warmup_block_counter

    counter = _warmup_block_counter(model_runner)
    query = model_runner.decode_query_len
    steps = 1
    if not model_runner.is_pooling_model:
        steps = 5 if model_runner.num_speculative_steps > 0 else 3
    tokens = query + 1 + steps * query
    groups = model_runner.kv_cache_config.kv_cache_groups
    return [counter(tokens, group.kv_cache_spec) for group in groups]


class _RunnerSizedForPools:
    """The model runner as upstream's warm-up reads it, with a KV cache
    config whose ``num_blocks`` caps the warm-up at the requests every pool
    holds (upstream's only size knob); every other attribute is the
    runner's. The steps themselves run on the runner, through the worker."""

    def __init__(
        self, runner: GPUModelRunner, kv_cache_config: PooledKVCacheConfig
    ) -> None:
        self._runner = runner
        self.kv_cache_config = kv_cache_config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


def warmup_kernels_pooled(
    model_runner: GPUModelRunner,
    worker_execute_model: Callable[[SchedulerOutput], Any],
    worker_sample_tokens: Callable[[GrammarOutput | None], Any],
) -> None:
    """Replacement of upstream's ``_warmup_kernels`` (module docstring)."""
    upstream_warmup = upstream_of(__name__, "warmup_kernels_pooled")
    config = model_runner.kv_cache_config
    if not isinstance(config, PooledKVCacheConfig):
        upstream_warmup(model_runner, worker_execute_model, worker_sample_tokens)
        return
    per_request = warmup_blocks_per_request(model_runner)
    limit = warmup_request_limit(config, per_request)
    if limit == 0:
        logger.warning(
            "vllm-hybrid: Model Runner V2's kernel warm-up skipped: one warm-up "
            "request's blocks (%s per KV cache group) do not fit the pools; "
            "kernels compile on the first request",
            per_request,
        )
        return
    sized = copy.copy(config)
    # upstream runs (num_blocks - 1) // sum(per_request) requests at most
    sized.num_blocks = 1 + limit * sum(per_request)
    ids = PooledWarmupIds(config)
    logger.info(
        "vllm-hybrid: Model Runner V2's kernel warm-up on the pooled KV cache: "
        "at most %d requests, block ids per pool (%s)",
        limit,
        ", ".join(f"{kind} from {r.start}" for kind, r in owned_ids(config).items()),
    )

    def execute(output: SchedulerOutput) -> Any:
        return worker_execute_model(ids.translate(output))

    upstream_warmup(
        _RunnerSizedForPools(model_runner, sized), execute, worker_sample_tokens
    )
