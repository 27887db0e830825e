"""Counters of align-mode state checkpoints, read from a running engine.

The benchmark wraps public methods of the engine's own objects (in the worker
process, where ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core in
it). Every wrapper calls the original with the same arguments and returns its
result unchanged, so the engine behaves exactly as without them. The same
wrappers work on upstream's single pool (``MambaManager`` x state groups over
one ``BlockPool``) and on pooled mode's arena pools, because both run
upstream's ``MambaManager``; only the pool object behind
``manager.block_pool`` differs.

What is counted (all in whole request states: a count summed over the state
groups is divided by their number, since upstream splits one request's state
into several groups that always move together and pooled mode has one):

* **state blocks allocated**: non-null blocks a state manager's
  ``allocate_new_blocks`` hands a request that came fresh from the pool
  (``ref_cnt == 1``). Pooled mode's "advance in place" when memory is short
  returns the block the request already owns (second reference); those are
  counted as ``state_in_place``, not as allocations.
* **state copies**: read from each ``Scheduler.schedule()`` output. A new
  (or resumed) request with a prefix hit copies the hit's checkpoint into its
  own block. A running request's chunk ``[c, c + n)`` starts from the state in
  block column ``(c - 1) // B`` and ends in column ``(c + n - 1) // B``; the
  worker copies the state over when the two differ (a block edge was
  crossed). One copy moves every state layer of the request. An in-place
  crossing (``state_in_place``) is such a copy onto itself.
* **checkpoints cached**: state blocks of a state group that
  ``BlockPool.cache_full_blocks`` gave a prefix-cache key (it had none
  before), and keys ``BlockPool.cache_partial_block`` added to a block that
  did not hold them (upstream with ``--prefix-match-unit``). ``cached_positions`` lists
  their token positions.
* **checkpoints hit**: prefix hits a state group takes
  (``add_local_computed_blocks`` with a non-null block): ``hit_events``
  counts them, ``checkpoints_hit`` the distinct keys that served at least
  one hit since the last :meth:`CheckpointCounters.reset`.
* **tokens scheduled**: ``Scheduler.schedule()``'s
  ``total_num_scheduled_tokens``, summed (prefill plus decode, recomputation
  after preemption included).
* **prefill checkpoint cuts**: prefill chunks pooled mode's scheduler ended
  early at a prefill checkpoint (``PooledSchedulerMixin.prefill_checkpoint_cuts``;
  None on other schedulers).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

#: Attribute marking a function or method this module wrapped.
_WRAPPED = "_bench_checkpoint_probe"


@dataclass
class CheckpointCounters:
    """Live counters of one engine's state groups (see the module docstring).

    Raw counts are summed over state groups; :meth:`snapshot` divides them
    by ``state_groups``.
    """

    state_groups: int
    #: Tokens per state block (the checkpoint interval of align mode).
    state_block: int = 0
    allocated: int = 0
    in_place: int = 0
    cached: int = 0
    copies: int = 0
    hit_events: int = 0
    tokens_scheduled: int = 0
    hit_keys: set[Any] = field(default_factory=set)
    #: (request id, token position) of every state checkpoint cached / hit,
    #: first state group only (the others repeat it).
    cached_positions: list[tuple[str, int]] = field(default_factory=list)
    hit_positions: list[tuple[str, int]] = field(default_factory=list)
    #: The scheduler whose prefill checkpoint cuts are read, and their count
    #: at the last reset.
    scheduler: Any = None
    _cuts_at_reset: int = 0

    def reset(self) -> None:
        """Start a new measurement window (e.g. one workload)."""
        self.allocated = self.in_place = self.cached = self.copies = 0
        self.hit_events = self.tokens_scheduled = 0
        self.hit_keys = set()
        self.cached_positions = []
        self.hit_positions = []
        self._cuts_at_reset = self._cuts() or 0

    def _cuts(self) -> int | None:
        return getattr(self.scheduler, "prefill_checkpoint_cuts", None)

    def count_copies(self, output: Any) -> None:
        """State copies of one ``SchedulerOutput`` (see the module docstring)."""
        block = self.state_block
        if block <= 0:
            return
        scheduled = output.num_scheduled_tokens
        cached = output.scheduled_cached_reqs
        # new and resumed requests start from a hit's checkpoint, if any
        starts = {r.req_id: r.num_computed_tokens for r in output.scheduled_new_reqs}
        starts |= {
            r: c
            for r, c in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
            if r in cached.resumed_req_ids
        }
        running = {
            r: c
            for r, c in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
            if r not in starts
        }
        self.copies += sum(1 for c in starts.values() if c > 0)
        for req_id, start in running.items():
            end = start + scheduled.get(req_id, 0)
            if start > 0 and end > start and (start - 1) // block != (end - 1) // block:
                self.copies += 1

    def snapshot(self) -> dict[str, Any]:
        """Counts since the last reset, in whole request states."""
        n = max(1, self.state_groups)
        cuts = self._cuts()
        return {
            "state_groups": self.state_groups,
            "state_blocks_allocated": self.allocated / n,
            "state_in_place": self.in_place / n,
            "state_copies": self.copies,
            "checkpoints_cached": self.cached / n,
            "checkpoints_hit": len(self.hit_keys) / n,
            "state_hit_events": self.hit_events / n,
            "tokens_scheduled": self.tokens_scheduled,
            "prefill_checkpoint_cuts": (
                None if cuts is None else cuts - self._cuts_at_reset
            ),
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
    block pool(s) and ``schedule``. A second call returns the counters the
    first one attached."""
    attached = getattr(getattr(scheduler, "schedule", None), "bench_counters", None)
    if attached is not None:
        return attached
    managers = _state_managers(scheduler)
    counters = CheckpointCounters(
        state_groups=len(managers),
        state_block=int(managers[0][1].block_size) if managers else 0,
        scheduler=scheduler,
    )
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

    def cache_full(original):
        def counted(
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            **kwargs,
        ):
            new = range(num_cached_blocks, num_full_blocks)
            fresh = [
                (i, blocks[i])
                for i in new
                if kv_cache_group_id in state_gids
                and not blocks[i].is_null
                and blocks[i].block_hash is None
            ]
            result = original(
                request,
                blocks,
                num_cached_blocks,
                num_full_blocks,
                block_size,
                kv_cache_group_id,
                **kwargs,
            )
            for i, block in fresh:
                if block.block_hash is None:
                    continue
                counters.cached += 1
                if kv_cache_group_id == first_gid:
                    position = (i + 1) * block_size
                    counters.cached_positions.append((request.request_id, position))
            return result

        return counted

    def cache_partial(pool):
        def make(original):
            def counted(request, block, num_tokens, kv_cache_group_id, **kwargs):
                gid = kv_cache_group_id
                held = {block.block_hash}
                held.update(pool.cached_block_hashes_by_block.get(block.block_id, ()))
                key = original(request, block, num_tokens, gid, **kwargs)
                if gid in state_gids and key is not None and key not in held:
                    counters.cached += 1
                    if gid == first_gid:
                        position = (request.request_id, int(num_tokens))
                        counters.cached_positions.append(position)
                return key

            return counted

        return make

    pools = {id(m.block_pool): m.block_pool for _, m in managers}
    for pool in pools.values():
        _wrap(pool, "cache_full_blocks", cache_full)
        _wrap(pool, "cache_partial_block", cache_partial(pool))
    for gid, manager in managers:
        _wrap(manager, "allocate_new_blocks", allocate)
        _wrap(manager, "add_local_computed_blocks", add_hits(gid))

    def schedule(original):
        def counted(*args, **kwargs):
            output = original(*args, **kwargs)
            counters.tokens_scheduled += int(output.total_num_scheduled_tokens)
            counters.count_copies(output)
            return output

        counted.bench_counters = counters
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
