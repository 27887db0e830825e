"""Counts read from the engine's own objects while it runs.

The scheduler's block pool decides which state checkpoints enter the prefix
cache; no output reports it, so :func:`count_state_checkpoints` wraps the
``_insert_block_hash`` method of each pool behind an align-mode state
manager, on the instance: the wrapper counts and calls the original with the
same arguments, so the engine behaves exactly as without it. Upstream's
single pool and pooled mode's state pool are both ``BlockPool`` objects
under upstream's ``MambaManager``, so one probe serves both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class CheckpointCount:
    """State checkpoints entered into the prefix cache, in request states:
    upstream keeps one request's state in several state groups that are
    cached together, so keys are divided by the number of groups."""

    state_groups: int
    keys: int = 0

    @property
    def checkpoints(self) -> float:
        return self.keys / max(1, self.state_groups)


def count_state_checkpoints(scheduler: Any) -> CheckpointCount:
    """Attach the counting wrapper (see the module docstring)."""
    from vllm.v1.core.kv_cache_utils import get_group_id
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    state = {
        gid: manager
        for gid, manager in enumerate(managers)
        if isinstance(manager, MambaManager) and manager.mamba_cache_mode == "align"
    }
    count = CheckpointCount(len(state))
    pools = {id(m.block_pool): m.block_pool for m in state.values()}
    for pool in pools.values():
        original = pool._insert_block_hash

        def insert(key, block, num_tokens, _pool=pool, _original=original):
            new = get_group_id(key) in state and not (
                block.block_hash == key
                or _pool.cached_block_hash_to_block.contain(key, block.block_id)
            )
            _original(key, block, num_tokens)
            if new:
                count.keys += 1

        pool._insert_block_hash = insert
    return count
