"""Counters of align-mode state checkpoints, read from a running engine.

The benchmark wraps methods of the engine's own objects (in the worker
process, where ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core and,
on CPU, vLLM's ``UniProcExecutor`` keeps the model runner). Every wrapper
calls the original with the same arguments and returns its result unchanged,
so the engine behaves exactly as without them. The same wrappers work on
upstream's single pool (``MambaManager`` x state groups over one
``BlockPool``) and on pooled mode's arena pools, because both run upstream's
``MambaManager``; only the pool object behind ``manager.block_pool`` differs.

What is counted (all in whole request states: a count summed over the state
groups is divided by their number, since upstream splits one request's state
into several groups that always move together and pooled mode has one):

* **state blocks allocated**: non-null blocks a state manager's
  ``allocate_new_blocks`` hands a request that came fresh from the pool
  (``ref_cnt == 1``). Pooled mode's "advance in place" when memory is short
  returns the block the request already owns (second reference); those are
  counted as ``state_in_place``, not as allocations.
* **state copies**: what the worker does, not what the scheduler plans:
  calls of ``vllm.v1.worker.mamba_utils.collect_mamba_copy_meta`` that copy
  (source column differs from the destination column). ``preprocess_mamba``
  makes one such call per request and step whose running state moves to a
  new block column (a block edge was crossed, or a prefix hit's checkpoint is
  taken over by a new request); one call copies every state layer of the
  request. Calls whose source and destination columns name the same block
  id (pooled mode's in-place crossing) are also counted as ``self_copies``.
  The CPU model runner has no fused pre-copy path, so every copy goes
  through this function; a run where it never ran reports ``None``.
* **checkpoints cached**: prefix-cache keys inserted into a state group's
  block (``BlockPool._insert_block_hash`` of the pool behind the state
  managers, filtered by the key's group id; re-inserting a key a block
  already has is not counted). ``cached_positions`` lists their token
  positions.
* **checkpoints hit**: prefix hits a state group takes
  (``add_local_computed_blocks`` with a non-null block): ``hit_events``
  counts them, ``checkpoints_hit`` the distinct keys that served at least
  one hit since the last :meth:`CheckpointCounters.reset`.
* **tokens scheduled**: ``Scheduler.schedule()``'s
  ``total_num_scheduled_tokens``, summed (prefill plus decode, recomputation
  after preemption included).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

#: Attribute marking a function or method this module wrapped.
_WRAPPED = "_bench_checkpoint_probe"


@dataclass
class _CopyTally:
    """Worker-side copies, for the whole process (one engine at a time)."""

    installed: bool = False
    copies: int = 0
    self_copies: int = 0


_TALLY = _CopyTally()


def install_copy_probe() -> None:
    """Wrap ``mamba_utils.collect_mamba_copy_meta`` once per process.

    ``preprocess_mamba`` looks the function up as a module global at each
    call, so replacing the module attribute reaches every model runner.
    """
    from vllm.v1.worker import mamba_utils

    original = mamba_utils.collect_mamba_copy_meta
    if getattr(original, _WRAPPED, False):
        return

    def counted(copy_bufs, kv_cache_config, funcs, group_ids, src, dst, bias, *rest):
        if src != dst or bias != 0:
            _TALLY.copies += 1
            req_state = rest[0] if rest else None
            ids = getattr(req_state, "block_ids", None)
            if ids is not None and group_ids:
                column = ids[group_ids[0]]
                if max(src, dst) < len(column) and column[src] == column[dst]:
                    _TALLY.self_copies += 1
        return original(
            copy_bufs, kv_cache_config, funcs, group_ids, src, dst, bias, *rest
        )

    setattr(counted, _WRAPPED, True)
    mamba_utils.collect_mamba_copy_meta = counted
    _TALLY.installed = True


@dataclass
class CheckpointCounters:
    """Live counters of one engine's state groups (see the module docstring).

    Raw counts are summed over state groups; :meth:`snapshot` divides them
    by ``state_groups``.
    """

    state_groups: int
    allocated: int = 0
    in_place: int = 0
    cached: int = 0
    hit_events: int = 0
    tokens_scheduled: int = 0
    hit_keys: set[Any] = field(default_factory=set)
    #: (request id, token position) of every state checkpoint cached / hit,
    #: first state group only (the others repeat it).
    cached_positions: list[tuple[str, int]] = field(default_factory=list)
    hit_positions: list[tuple[str, int]] = field(default_factory=list)
    _copies_at_reset: int = 0
    _self_copies_at_reset: int = 0

    def reset(self) -> None:
        """Start a new measurement window (e.g. one workload)."""
        self.allocated = self.in_place = self.cached = 0
        self.hit_events = self.tokens_scheduled = 0
        self.hit_keys = set()
        self.cached_positions = []
        self.hit_positions = []
        self._copies_at_reset = _TALLY.copies
        self._self_copies_at_reset = _TALLY.self_copies

    def snapshot(self) -> dict[str, Any]:
        """Counts since the last reset, in whole request states."""
        n = max(1, self.state_groups)
        copies = self_copies = None
        if _TALLY.installed:
            copies = _TALLY.copies - self._copies_at_reset
            self_copies = _TALLY.self_copies - self._self_copies_at_reset
        return {
            "state_groups": self.state_groups,
            "state_blocks_allocated": self.allocated / n,
            "state_in_place": self.in_place / n,
            "state_copies": copies,
            "state_self_copies": self_copies,
            "checkpoints_cached": self.cached / n,
            "checkpoints_hit": len(self.hit_keys) / n,
            "state_hit_events": self.hit_events / n,
            "tokens_scheduled": self.tokens_scheduled,
        }


def _state_managers(scheduler: Any) -> list[tuple[int, Any]]:
    """(group id, manager) of every align-mode state group."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    return [
        (gid, m)
        for gid, m in enumerate(managers)
        if isinstance(m, MambaManager) and m.mamba_cache_mode == "align"
    ]


def _wrap(obj: Any, name: str, make: Any) -> None:
    """Replace ``obj.name`` (a bound method) by ``make(original)`` on the
    instance, once."""
    original = getattr(obj, name)
    if getattr(original, _WRAPPED, False):
        return
    wrapper = make(original)
    setattr(wrapper, _WRAPPED, True)
    setattr(obj, name, wrapper)


def attach(scheduler: Any) -> CheckpointCounters:
    """Install the counting wrappers on a scheduler's state managers, their
    block pool(s) and ``schedule``; the worker-side copy probe too. A second
    call returns the counters the first one attached."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    attached = getattr(getattr(scheduler, "schedule", None), "_bench_counters", None)
    if attached is not None:
        return attached
    install_copy_probe()
    managers = _state_managers(scheduler)
    counters = CheckpointCounters(state_groups=len(managers))
    state_gids = {gid for gid, _ in managers}
    first_gid = min(state_gids, default=-1)

    def allocate(original):
        def counted(request_id, *args, **kwargs):
            blocks = original(request_id, *args, **kwargs)
            for block in blocks:
                if block.is_null:
                    continue
                if block.ref_cnt == 1:
                    counters.allocated += 1
                else:
                    counters.in_place += 1
            return blocks

        return counted

    def add_hits(gid):
        def make(original):
            def counted(request_id, blocks, num_local, *args, **kw):
                hit = [b for b in blocks if not b.is_null]
                result = original(request_id, blocks, num_local, *args, **kw)
                if hit and hit[-1].block_hash is not None:
                    counters.hit_events += 1
                    counters.hit_keys.add(hit[-1].block_hash)
                    if gid == first_gid:
                        counters.hit_positions.append((request_id, int(num_local)))
                return result

            return counted

        return make

    def insert(pool):
        def make(original):
            def counted(key, block, num_tokens, *args, **kwargs):
                gid = get_group_id(key)
                new = gid in state_gids and not (
                    block.block_hash == key
                    or pool.cached_block_hash_to_block.contain(key, block.block_id)
                )
                result = original(key, block, num_tokens, *args, **kwargs)
                if new:
                    counters.cached += 1
                    if gid == first_gid:
                        request = getattr(pool, "_bench_caching", None)
                        counters.cached_positions.append(
                            (getattr(request, "request_id", ""), int(num_tokens or 0))
                        )
                return result

            return counted

        return make

    def remember_request(pool, name):
        def make(original):
            def counted(request, *args, **kwargs):
                pool._bench_caching = request
                try:
                    return original(request, *args, **kwargs)
                finally:
                    pool._bench_caching = None

            return counted

        return make

    pools = {id(m.block_pool): m.block_pool for _, m in managers}
    for pool in pools.values():
        _wrap(pool, "_insert_block_hash", insert(pool))
        for name in ("cache_full_blocks", "cache_partial_block"):
            _wrap(pool, name, remember_request(pool, name))
    for gid, manager in managers:
        _wrap(manager, "allocate_new_blocks", allocate)
        _wrap(manager, "add_local_computed_blocks", add_hits(gid))

    def schedule(original):
        def counted(*args, **kwargs):
            output = original(*args, **kwargs)
            counters.tokens_scheduled += int(output.total_num_scheduled_tokens)
            return output

        counted._bench_counters = counters
        return counted

    _wrap(scheduler, "schedule", schedule)
    counters.reset()
    return counters


def per_unit(snapshot: dict[str, Any], requests: int, output_tokens: int) -> dict:
    """The checkpoint counts per request and per 1,000 decoded tokens."""
    out: dict[str, Any] = {}
    for key in (
        "state_blocks_allocated",
        "state_copies",
        "checkpoints_cached",
        "checkpoints_hit",
    ):
        value = snapshot.get(key)
        if value is None:
            continue
        out[f"{key}_per_request"] = value / requests if requests else None
        out[f"{key}_per_1k_decoded"] = (
            1000 * value / output_tokens if output_tokens else None
        )
    return out


def position_histogram(positions: list[tuple[str, int]]) -> dict[int, int]:
    """How many checkpoints were cached at each token position."""
    return dict(sorted(Counter(pos for _, pos in positions).items()))


def counters_of(engine: Any) -> CheckpointCounters | None:
    """The engine's checkpoint counters, attached on first use; None without
    prefix caching (no align-mode state groups to count)."""
    if not engine.spec.prefix_caching:
        return None
    counters = engine.probes.get("checkpoints")
    if counters is None:
        counters = engine.probes["checkpoints"] = attach(engine.scheduler)
    return counters


def state_block_size(kv_cache_config: Any) -> int | None:
    """Block (checkpoint interval) of the first state group, in tokens."""
    from vllm.v1.kv_cache_interface import MambaSpec

    for group in kv_cache_config.kv_cache_groups:
        if isinstance(group.kv_cache_spec, MambaSpec):
            return int(group.kv_cache_spec.block_size)
    return None
