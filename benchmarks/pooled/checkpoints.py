"""Counters of align-mode state blocks and prefix-cache checkpoints, read
from a running engine (what each counts: ``docs/benchmarks.md``, "State
checkpoints at small blocks").

Wrappers on the engine's own objects call the original with the same
arguments and return its result; both modes run upstream's ``MambaManager``,
so one set serves both. Counts summed over state groups are divided by their
number (one request's state). State copies, scheduled tokens and preemptions
come from the simulator's ``StepObserver`` on the same engine.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any

from vllm_hybrid.tools.simulate.steps import StepObserver, StepRecord

#: Attribute marking a function or method this module wrapped.
_WRAPPED = "_bench_checkpoint_probe"


@dataclass
class CheckpointCounters:
    """Live counters of one engine's state groups (see the module docstring).

    Raw counts are summed over state groups; :meth:`snapshot` divides them
    by ``state_groups``.
    """

    state_groups: int
    #: The engine's step observer (copies, tokens), and its totals at reset.
    steps: StepObserver | None = None
    allocated: int = 0
    in_place: int = 0
    cached: int = 0
    hit_events: int = 0
    _steps_at_reset: StepRecord = field(default_factory=StepRecord)
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
        self.allocated = self.in_place = self.cached = self.hit_events = 0
        self._steps_at_reset = replace(self.steps.total) if self.steps else StepRecord()
        self.hit_keys, self.cached_positions, self.hit_positions = set(), [], []
        self._cuts_at_reset = self._cuts() or 0

    def _cuts(self) -> int | None:
        return getattr(self.scheduler, "prefill_checkpoint_cuts", None)

    def snapshot(self) -> dict[str, Any]:
        """Counts since the last reset, in whole request states."""
        n = max(1, self.state_groups)
        cuts = self._cuts()
        cuts_since = None if cuts is None else cuts - self._cuts_at_reset
        now = self.steps.total if self.steps else StepRecord()
        before = self._steps_at_reset
        prefill = now.prefill_tokens - before.prefill_tokens
        return {
            "state_groups": self.state_groups,
            "state_blocks_allocated": self.allocated / n,
            "state_in_place": self.in_place / n,
            "state_copies": now.state_copies - before.state_copies,
            "checkpoints_cached": self.cached / n,
            "checkpoints_hit": len(self.hit_keys) / n,
            "state_hit_events": self.hit_events / n,
            "tokens_scheduled": prefill + now.decode_tokens - before.decode_tokens,
            "prefill_tokens_computed": prefill,
            "prefill_checkpoint_cuts": cuts_since,
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


def attach(scheduler: Any, steps: StepObserver | None = None) -> CheckpointCounters:
    """Install the counting wrappers on a scheduler's state managers and
    their block pool(s); ``steps`` observes the same scheduler."""
    from vllm.v1.core.block_pool import BlockPool

    full_signature = inspect.signature(BlockPool.cache_full_blocks)
    managers = _state_managers(scheduler)
    counters = CheckpointCounters(len(managers), steps, scheduler=scheduler)
    state_gids = {gid for gid, _ in managers}
    first_gid = min(state_gids, default=-1)

    def allocate(original):
        def counted(request_id, *args, **kwargs):
            blocks = original(request_id, *args, **kwargs)
            real = [block for block in blocks if not block.is_null]
            counters.allocated += sum(block.ref_cnt == 1 for block in real)
            counters.in_place += sum(block.ref_cnt != 1 for block in real)
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
        def counted(*args, **kwargs):
            # The arguments by name, however the caller passed them (upstream's
            # signature: pooled mode's pool forwards ``*args``; None is ``self``).
            call = full_signature.bind(None, *args, **kwargs).arguments
            gid, blocks = call["kv_cache_group_id"], call["blocks"]
            fresh = [
                (i, blocks[i])
                for i in range(call["num_cached_blocks"], call["num_full_blocks"])
                if gid in state_gids
                and not blocks[i].is_null
                and blocks[i].block_hash is None
            ]
            result = original(*args, **kwargs)
            for i, block in fresh:
                if block.block_hash is not None:
                    counters.cached += 1
                    if gid == first_gid:
                        position = (i + 1) * call["block_size"]
                        request_id = call["request"].request_id
                        counters.cached_positions.append((request_id, position))
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

    counters.reset()
    return counters


#: The counts :func:`per_unit` also gives per request and per 1,000 decoded tokens.
PER_UNIT = (
    "state_blocks_allocated",
    "state_copies",
    "checkpoints_cached",
    "checkpoints_hit",
)


def per_unit(snapshot: dict[str, Any], requests: int, output_tokens: int) -> dict:
    """The :data:`PER_UNIT` counts of a snapshot per request and per 1,000
    decoded tokens."""
    out: dict[str, Any] = {}
    for key in PER_UNIT:
        value = snapshot[key]
        out[f"{key}_per_request"] = value / requests if requests else None
        per_1k = 1000 * value / output_tokens if output_tokens else None
        out[f"{key}_per_1k_decoded"] = per_1k
    return out


def counters_of(engine: Any) -> CheckpointCounters | None:
    """The engine's checkpoint counters, attached on first use; None without
    prefix caching (no align-mode state groups to count)."""
    if not engine.spec.prefix_caching:
        return None
    counters = engine.probes.get("checkpoints")
    if counters is None:
        steps = engine.steps()
        counters = engine.probes["checkpoints"] = attach(engine.scheduler, steps)
    return counters
