"""The admission workload: how close admission comes to what the bytes allow.

many_short's requests (all at once, seeded prompt lengths, fixed output) on
an engine of its own, by default with 32-token attention blocks, where the
tiny ``qwen3_5``'s state page is padded by 22% upstream; run by
:func:`run_admission`, in three parts, all read-only towards the engine:

* **The byte limit** (:func:`pooled_byte_limit`): how many of the workload's
  requests fit in the KV cache at once if each holds exactly its full
  footprint: attention blocks for its prompt and its ``max_tokens`` at the
  engine's real page size, and the state blocks one running request holds.
  The footprints come from the core's own arithmetic
  (:func:`~vllm_hybrid.v1.core.pooled.capacity.request_bytes`, and the state
  block counts of :mod:`~vllm_hybrid.v1.core.pooled.capacity`), so the
  benchmark and the engine cannot disagree about what a request costs.
* **The admission probe** (:class:`AdmissionProbe`): wrappers on the
  scheduler's and the KV cache's instances (as the simulator's probes wrap
  methods) that record, per engine step, what admission refused and why,
  what each preemption was for, how many state blocks each running request
  held, and where the arena's boundary stood. Every wrapper calls the
  original with the same arguments and returns its result; the analyses
  read state and change none, so a probed engine schedules exactly as an
  unprobed one.
* **The counts** of the drive, the simulator's (peak and mean running,
  preemptions, engine steps), which the report sets against the byte limit
  and against upstream's (:func:`acceptance`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: Why admission refused a request's blocks (:func:`plan_refusal`), one
#: short label per way the arena's plan can fail, plus upstream's checks.
REASONS = {
    "both_short": "both pools short of free blocks",
    "token_short_state_floor": "token pool short; state pool at its floor",
    "token_short_state_would_run_short": (
        "token pool short; moving the boundary would leave the state pool short"
    ),
    "token_short_live_state_pins": (
        "token pool short; live state blocks next to the boundary pin it"
    ),
    "token_short_kept_state": "token pool short; kept state blocks in the way",
    "state_short_token_floor": "state pool short; token pool at its floor",
    "state_short_token_would_run_short": (
        "state pool short; moving the boundary would leave the token pool short"
    ),
    "state_short_live_token_pins": (
        "state pool short; live token blocks in the way could not move"
    ),
    "state_short_kept_token": "state pool short; kept token blocks in the way",
    "watermark": "served by the arena, refused by the growth reserve (watermark)",
    "deferred_hit": (
        "refused before any plan: upstream deferring a prefix hit made this "
        "step (a state need beyond the state pool's ids)"
    ),
    "unknown": "refused, reason not traced",
}


# ---------------------------------------------------------------------------
# The byte limit
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ByteLimit:
    """How many of a workload's requests the KV cache holds at once."""

    #: bytes the KV cache can hand out (null blocks taken out)
    usable_bytes: int
    #: bytes of one request's full footprint, in arrival order
    footprints: tuple[int, ...]
    #: state blocks counted per request
    state_blocks_per_request: int

    @property
    def mean_footprint(self) -> float:
        return sum(self.footprints) / len(self.footprints)

    @property
    def mean_concurrency(self) -> float:
        """Usable bytes over the mean footprint."""
        return self.usable_bytes / self.mean_footprint

    @property
    def window_concurrency(self) -> int:
        """The most consecutive requests, in arrival order, whose footprints
        fit together: the largest batch a first-come-first-served admission
        that counted every byte could run (compare with peak running)."""
        return max_window(self.footprints, self.usable_bytes)

    @property
    def first_wave(self) -> int:
        """How many of the first requests fit together (the batch the first
        steps could admit)."""
        total = count = 0
        for footprint in self.footprints:
            total += footprint
            if total > self.usable_bytes:
                break
            count += 1
        return count

    def summary(self) -> dict[str, Any]:
        return {
            "usable_bytes": self.usable_bytes,
            "state_blocks_per_request": self.state_blocks_per_request,
            "mean_footprint_bytes": round(self.mean_footprint),
            "mean_concurrency": self.mean_concurrency,
            "window_concurrency": self.window_concurrency,
            "first_wave": self.first_wave,
        }


def max_window(sizes: Sequence[int], capacity: int) -> int:
    """Longest run of consecutive ``sizes`` whose sum is at most
    ``capacity`` (two pointers: every size is positive)."""
    best = total = start = 0
    for end, size in enumerate(sizes):
        total += size
        while total > capacity:
            total -= sizes[start]
            start += 1
        best = max(best, end + 1 - start)
    return best


def pooled_byte_limit(
    kv_cache_config: Any,
    prompt_lens: Sequence[int],
    max_tokens: int,
    state_blocks: str = "min",
) -> ByteLimit:
    """The byte limit of a pooled plan: token blocks at the token pool's
    block (every token group takes its own ids) and ``state_blocks`` state
    blocks per request, ``"min"`` (what one running request can run on,
    :func:`~.capacity.min_state_blocks_per_request`) or ``"max"`` (align
    mode's copy target and checkpoints too)."""
    from vllm_hybrid.v1.core.pooled.capacity import (
        max_state_blocks_per_request,
        min_state_blocks_per_request,
        request_bytes,
    )
    from vllm_hybrid.v1.core.pooled.spec import PoolKind

    token = kv_cache_config.pool_by_kind(PoolKind.TOKEN)
    state = kv_cache_config.pool_by_kind(PoolKind.STATE)
    groups = kv_cache_config.kv_cache_groups
    block_size = groups[token.group_ids[0]].kv_cache_spec.block_size
    spec = groups[state.group_ids[0]].kv_cache_spec
    count = (
        min_state_blocks_per_request
        if state_blocks == "min"
        else max_state_blocks_per_request
    )
    per_request = count(spec) * len(state.group_ids)
    token_bytes = token.block_bytes * len(token.group_ids)
    footprints = tuple(
        request_bytes(
            n + max_tokens, block_size, token_bytes, state.block_bytes, per_request
        ).total
        for n in prompt_lens
    )
    layout = kv_cache_config.layout
    usable = layout.arena_bytes - layout.null_region_bytes
    return ByteLimit(usable, footprints, per_request)


def shared_pool_byte_limit(
    vllm_config: Any,
    kv_cache_config: Any,
    prompt_lens: Sequence[int],
    max_tokens: int,
) -> ByteLimit:
    """The byte limit of upstream's single shared pool, at its real (padded)
    page and its inflated attention block: each token group takes
    ``max_num_blocks_per_req`` blocks, each other group the blocks one
    running request holds at least (one in align mode)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_hybrid.v1.core.pooled.capacity import (
        min_state_blocks_per_request,
        shared_block_bytes,
    )
    from vllm_hybrid.v1.core.token_capacity import split_token_groups

    block_bytes = shared_block_bytes(kv_cache_config)
    split = split_token_groups(vllm_config, kv_cache_config)
    assert split is not None, "a hybrid model's shared pool"
    token_groups, others = split
    held = sum(
        min_state_blocks_per_request(g.kv_cache_spec)
        if isinstance(g.kv_cache_spec, MambaSpec)
        else 1
        for g in others
    )

    def blocks(num_tokens: int) -> int:
        return held + sum(
            g.kv_cache_spec.max_num_blocks_per_req(vllm_config, num_tokens)
            for g in token_groups
        )

    footprints = tuple(blocks(n + max_tokens) * block_bytes for n in prompt_lens)
    usable = (kv_cache_config.num_blocks - 1) * block_bytes
    return ByteLimit(usable, footprints, held)


# ---------------------------------------------------------------------------
# Why the arena's plan refuses (read-only mirror of ArenaBoundary._plan)
# ---------------------------------------------------------------------------


def plan_refusal(
    boundary: Any, need_token: int, need_state: int, keep: Any, reach: Any
) -> str | None:
    """The reason label (:data:`REASONS`) for which the boundary's plan
    would refuse these needs at ``reach``, or None when it can serve them
    (with or without a move, or by moving live token blocks off the
    boundary, which the plan itself then tries). Reads the pools only."""
    token, state = boundary.token_pool, boundary.state_pool
    free_token = token.get_num_free_within(reach)
    free_state = state.get_num_free_within(reach)
    short_token = need_token > free_token
    short_state = need_state > free_state
    if not short_token and not short_state:
        return None
    if short_token and short_state:
        return "both_short"
    layout = boundary.layout
    floor = boundary.state_floor
    kept = boundary._kept(keep, reach)
    if short_token:
        capacity = token.owned_capacity + need_token - free_token
        target = layout.state_floor_for_token_capacity(capacity)
        if target > layout.max_state_floor:
            return "token_short_state_floor"
        lost = range(floor, target)
        if free_state - len(lost) < need_state:
            return "token_short_state_would_run_short"
        if any(state.blocks[i].ref_cnt for i in lost):
            return "token_short_live_state_pins"
        if any((id(state), i) in kept for i in lost):
            return "token_short_kept_state"
        return None
    target = floor - (need_state - free_state)
    if target < layout.min_state_floor:
        return "state_short_token_floor"
    lost = boundary._token_ids_lost(target)
    if free_token - len(lost) < need_token:
        return "state_short_token_would_run_short"
    if any((id(token), i) in kept for i in lost):
        return "state_short_kept_token"
    if any(token.blocks[i].ref_cnt for i in lost):
        # the plan may still move them (plan_moves); the caller checks
        return "state_short_live_token_pins"
    return None


# ---------------------------------------------------------------------------
# The probe
# ---------------------------------------------------------------------------


@dataclass
class Refusal:
    """One refused allocation: whose, of what, why."""

    request_id: str
    #: waiting | preempted | running
    status: str
    #: "full" (vLLM's full-prompt admission check) or "chunk"
    phase: str
    need_token: int
    need_state: int
    reason: str
    #: the growth reserve (token blocks) that applied
    reserve: int = 0
    #: every plan tried for it: "reach need_token,need_state: outcome"
    attempts: list[str] = field(default_factory=list)


@dataclass
class Preemption:
    """One preemption and the allocation it made room for."""

    victim: str
    #: the running request whose blocks could not be served
    for_request: str
    #: decode | prefill (of the request being served)
    for_phase: str
    need_token: int
    need_state: int
    reason: str
    #: whether the request being served was at a state block edge
    at_state_edge: bool


@dataclass
class StepTrace:
    """One engine step as admission saw it."""

    step: int
    waiting_before: int
    running_before: int
    running_after: int = 0
    admitted: int = 0
    preempted: int = 0
    scheduled_tokens: int = 0
    token_budget: int = 0
    #: the growth reserve (token blocks) of this step
    reserve: int = 0
    state_floor_before: int = 0
    state_floor_after: int = 0
    token_owned: int = 0
    token_used: int = 0
    state_owned: int = 0
    state_used: int = 0
    #: boundary moves this step (each: "token+N" or "state+N")
    moves: list[str] = field(default_factory=list)
    #: live token blocks moved off the boundary this step
    token_blocks_moved: int = 0
    refusals: list[Refusal] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    #: state blocks held -> running requests holding that many, after the step
    state_blocks_held: dict[int, int] = field(default_factory=dict)
    #: token blocks the running requests hold, after the step
    running_token_blocks: int = 0
    #: bytes the running requests' full footprints take (the byte limit's
    #: count) and bytes both pools hold in use, after the step
    projected_bytes: int = 0
    used_bytes: int = 0
    #: why the waiting queue stopped being admitted (None: it emptied)
    admission_stop: str | None = None


def _distinct_blocks(managers: Sequence[Any], request_id: str) -> int:
    """Blocks a request holds in ``managers``: distinct ids, as a state
    advanced in place sits in two slots of its block table for a step."""
    return sum(
        len({b.block_id for b in m.req_to_blocks.get(request_id, ()) if not b.is_null})
        for m in managers
    )


def _status(request: Any) -> str:
    from vllm.v1.request import RequestStatus

    if request.status == RequestStatus.PREEMPTED:
        return "preempted"
    if request.status == RequestStatus.WAITING:
        return "waiting"
    return "running"


class AdmissionProbe:
    """Per-step trace of a pooled scheduler's admission (module docstring).

    Attach once, before the drive; read :attr:`steps` after it. Upstream's
    scheduler gets no probe: its refusals have one reason (no free block).
    """

    def __init__(self, scheduler: Any) -> None:
        from vllm_hybrid.v1.core.pooled.coordinator import arena_of
        from vllm_hybrid.v1.core.pooled.spec import PoolKind

        self.scheduler = scheduler
        self.manager = scheduler.kv_cache_manager
        self.coordinator = self.manager.coordinator
        self.arena = arena_of(self.manager)
        if self.arena is None:
            raise ValueError("the admission probe needs a pooled scheduler")
        self.boundary = self.arena.boundary
        self.steps: list[StepTrace] = []
        self._step: StepTrace | None = None
        #: the allocation in progress: its request, the request's status and
        #: the coordinator's counts it made (each with its plans)
        self._alloc: dict[str, Any] | None = None
        #: the latest refused allocation of a running request this step (a
        #: preemption follows it) and of a waiting one (admission stops)
        self._last_running_refusal: Refusal | None = None
        self._last_waiting_refusal: Refusal | None = None

        managers = self.coordinator.single_type_managers
        kinds = [
            self.manager.kv_cache_config.pool_of_group(i).kind
            for i in range(len(managers))
        ]
        self._state_managers = [
            m for m, k in zip(managers, kinds, strict=True) if k is PoolKind.STATE
        ]
        self._token_managers = [
            m for m, k in zip(managers, kinds, strict=True) if k is PoolKind.TOKEN
        ]
        layout = self.arena.layout
        self._token_bytes = layout.token_block_bytes
        self._state_bytes = layout.state_block_bytes
        self._token_block = self._token_managers[0].block_size
        #: the allocation count being traced (its plan attempts go there)
        self._counting: dict[str, Any] | None = None
        self._wrap()

    # -- wrappers ------------------------------------------------------------

    def _wrap(self) -> None:
        sched, manager, coordinator, boundary = (
            self.scheduler,
            self.manager,
            self.coordinator,
            self.boundary,
        )
        schedule = sched.schedule
        allocate = manager.allocate_slots
        count = coordinator.admit
        plan = boundary._plan
        move = boundary._move_to
        preempt = sched._preempt_request

        def probed_schedule(*args: Any, **kwargs: Any) -> Any:
            self._begin_step()
            output = schedule(*args, **kwargs)
            self._end_step(output)
            return output

        def probed_allocate(request: Any, *args: Any, **kwargs: Any) -> Any:
            outer = self._alloc
            self._alloc = {
                "request": request,
                "status": _status(request),
                "counts": [],
            }
            try:
                result = allocate(request, *args, **kwargs)
            finally:
                alloc, self._alloc = self._alloc, outer
            if result is None:
                self._refused(alloc)
            return result

        def probed_count(
            request_id: str, num_tokens: int, *args: Any, **kwargs: Any
        ) -> Any:
            # vLLM's full-prompt check passes apply_admission_cap
            record: dict[str, Any] = {
                "attempts": [],
                "full": bool(kwargs.get("apply_admission_cap")),
                "reserve": kwargs.get("reserve", 0),
            }
            if self._alloc is not None:
                self._alloc["counts"].append(record)
            self._counting = record
            try:
                blocks = count(request_id, num_tokens, *args, **kwargs)
            finally:
                self._counting = None
            return blocks

        def probed_plan(
            need_token: int, need_state: int, keep: Any, reach: Any, *args: Any
        ) -> Any:
            keep = list(keep)  # read twice: by the mirror and by the plan
            reason = plan_refusal(boundary, need_token, need_state, keep, reach)
            moved_before = self._moved_count()
            target = plan(need_token, need_state, keep, reach, *args)
            record = self._counting
            if record is not None:
                record["attempts"].append(
                    {
                        "need_token": need_token,
                        "need_state": need_state,
                        "reach": getattr(reach, "value", str(reach)),
                        "served": target is not None,
                        "reason": None if target is not None else (reason or "unknown"),
                    }
                )
            if self._step is not None:
                self._step.token_blocks_moved += self._moved_count() - moved_before
            return target

        def probed_move(target: int) -> None:
            before = boundary.state_floor
            move(target)
            if self._step is not None:
                side = "token" if target > before else "state"
                self._step.moves.append(f"{side}+{abs(target - before)}")

        def probed_preempt(request: Any, *args: Any, **kwargs: Any) -> Any:
            self._preempted(request)
            return preempt(request, *args, **kwargs)

        sched.schedule = probed_schedule
        manager.allocate_slots = probed_allocate
        coordinator.admit = probed_count
        boundary._plan = probed_plan
        boundary._move_to = probed_move
        sched._preempt_request = probed_preempt

    def _moved_count(self) -> int:
        moves = self.boundary.moves
        return 0 if moves is None else moves.blocks

    # -- per allocation ------------------------------------------------------

    def _refused(self, alloc: dict[str, Any]) -> None:
        """Record a refused allocation with the reason of its last plan."""
        counts = alloc["counts"]
        last = counts[-1] if counts else None
        reason, need_token, need_state, reserve = "unknown", 0, 0, 0
        if last is not None:
            attempts = last["attempts"]
            reserve = last["reserve"]
            if not attempts:
                # the boundary refused before planning: a need beyond the
                # state pool's ids, upstream's way of deferring a hit
                reason = "deferred_hit"
            elif attempts[-1]["served"]:
                reason = "watermark"
            else:
                reason = attempts[-1]["reason"]
            if attempts:
                need_token = attempts[-1]["need_token"]
                need_state = attempts[-1]["need_state"]
        tried = [
            f"{a['reach']} {a['need_token']},{a['need_state']}: "
            f"{'served' if a['served'] else a['reason']}"
            for c in counts
            for a in c["attempts"]
        ]
        refusal = Refusal(
            alloc["request"].request_id,
            alloc["status"],
            "full" if last is not None and last["full"] else "chunk",
            need_token,
            need_state,
            reason,
            reserve,
            tried,
        )
        if self._step is not None:
            self._step.refusals.append(refusal)
        if alloc["status"] == "running":
            self._last_running_refusal = refusal
        else:
            self._last_waiting_refusal = refusal

    def _preempted(self, victim: Any) -> None:
        refusal = self._last_running_refusal
        if self._step is None:
            return
        served = self.scheduler.requests.get(refusal.request_id) if refusal else None
        block = self._state_block_size()
        phase, edge = "decode", False
        if served is not None:
            from vllm_hybrid.v1.core.pooled.policy.steps import prefill_end

            computed = served.num_computed_tokens
            phase = "prefill" if computed < prefill_end(served) else "decode"
            edge = bool(block) and computed % block == 0
        self._step.preemptions.append(
            Preemption(
                victim.request_id,
                refusal.request_id if refusal else "?",
                phase,
                refusal.need_token if refusal else 0,
                refusal.need_state if refusal else 0,
                refusal.reason if refusal else "unknown",
                edge,
            )
        )

    def _state_block_size(self) -> int:
        return self._state_managers[0].block_size if self._state_managers else 0

    # -- per step ------------------------------------------------------------

    def _begin_step(self) -> None:
        sched = self.scheduler
        self._step = StepTrace(
            step=len(self.steps) + 1,
            waiting_before=len(sched.waiting),
            running_before=len(sched.running),
            state_floor_before=self.boundary.state_floor,
        )
        self._last_waiting_refusal = None
        self._last_running_refusal = None

    def _end_step(self, output: Any) -> None:
        step = self._step
        assert step is not None
        sched = self.scheduler
        token, state = self.arena.token_pool, self.arena.state_pool
        step.running_after = len(sched.running)
        step.admitted = len(output.scheduled_new_reqs) + len(
            getattr(output.scheduled_cached_reqs, "resumed_req_ids", ()) or ()
        )
        step.preempted = len(step.preemptions)
        step.scheduled_tokens = output.total_num_scheduled_tokens
        step.token_budget = sched.max_num_scheduled_tokens
        step.reserve = self.manager.watermark_blocks
        step.state_floor_after = self.boundary.state_floor
        step.token_owned = token.owned_capacity
        step.token_used = token.owned_capacity - token.get_num_free_blocks()
        step.state_owned = state.owned_capacity
        step.state_used = state.owned_capacity - state.get_num_free_blocks()
        held: Counter[int] = Counter()
        token_blocks = 0
        for request in sched.running:
            rid = request.request_id
            held[_distinct_blocks(self._state_managers, rid)] += 1
            token_blocks += _distinct_blocks(self._token_managers, rid)
        step.state_blocks_held = dict(sorted(held.items()))
        step.projected_bytes = sum(self._footprint(r) for r in sched.running)
        step.used_bytes = (
            step.token_used * self._token_bytes + step.state_used * self._state_bytes
        )
        step.running_token_blocks = token_blocks
        step.admission_stop = self._stop_reason(step)
        self.steps.append(step)
        self._step = None

    def _footprint(self, request: Any) -> int:
        """The byte limit's footprint of one request (one state block)."""
        from vllm_hybrid.v1.core.pooled.capacity import request_bytes

        tokens = request.num_prompt_tokens + request.max_tokens
        groups = len(self._token_managers)
        return request_bytes(
            tokens,
            self._token_block,
            self._token_bytes * groups,
            self._state_bytes,
            len(self._state_managers),
        ).total

    def _stop_reason(self, step: StepTrace) -> str | None:
        sched = self.scheduler
        if not sched.waiting:
            return None
        if step.preemptions:
            return "preempted this step (vLLM admits nothing then)"
        if len(sched.running) >= sched.max_num_running_reqs:
            return "max_num_seqs"
        refusal = self._last_waiting_refusal
        if refusal is not None:
            return refusal.reason
        if step.scheduled_tokens >= step.token_budget:
            return "token budget"
        return "chunk cut / token budget left too small"

    # -- results ---------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Counts over the drive: refusals and preemptions by reason, the
        steps' stop reasons, state blocks held, boundary moves."""
        refusals = Counter((r.status, r.reason) for s in self.steps for r in s.refusals)
        preempt_for = Counter(
            (p.for_phase, p.reason, "edge" if p.at_state_edge else "no edge")
            for s in self.steps
            for p in s.preemptions
        )
        stops = Counter(s.admission_stop for s in self.steps if s.admission_stop)
        held: Counter[int] = Counter()
        for s in self.steps:
            held.update(s.state_blocks_held)
        moves = Counter(m.split("+")[0] for s in self.steps for m in s.moves)
        return {
            "refusals": {f"{k[0]}: {k[1]}": v for k, v in refusals.most_common()},
            "preemptions_for": {
                f"{k[0]}, {k[2]}: {k[1]}": v for k, v in preempt_for.most_common()
            },
            "admission_stops": dict(stops.most_common()),
            "state_blocks_held_request_steps": dict(sorted(held.items())),
            "boundary_moves": dict(moves),
            "token_blocks_moved": sum(s.token_blocks_moved for s in self.steps),
            # the coordinator's own counts: state block edges crossed in
            # place (short of memory, or at edges no policy keeps) and
            # running state blocks moved away from the boundary
            "coordinator": dict(getattr(self.coordinator, "short_memory_counts", {})),
        }

    def trace(self) -> list[dict[str, Any]]:
        return [asdict(s) for s in self.steps]


# ---------------------------------------------------------------------------
# The workload
# ---------------------------------------------------------------------------


def state_page_padding(kv_cache_config: Any) -> float:
    """How much the engine pads its state pages: the largest padded page
    over the real one, minus one, over its state groups (0: none)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    pads = [
        g.kv_cache_spec.page_size_bytes / g.kv_cache_spec.real_page_size_bytes - 1
        for g in kv_cache_config.kv_cache_groups
        if isinstance(g.kv_cache_spec, MambaSpec)
    ]
    return max(pads, default=0.0)


def engine_byte_limit(
    engine: Any, prompt_lens: Sequence[int], output: int
) -> ByteLimit:
    """The byte limit at the engine's own pages: the arena's in pooled mode,
    the single shared pool's (padded pages, inflated block) upstream."""
    from vllm_hybrid.v1.core.pooled.coordinator import arena_of

    scheduler = engine.scheduler
    config = scheduler.kv_cache_config
    if arena_of(scheduler.kv_cache_manager) is not None:
        return pooled_byte_limit(config, prompt_lens, output)
    return shared_pool_byte_limit(engine.vllm_config, config, prompt_lens, output)


def run_admission(engine: Any, cfg: Any) -> dict[str, Any]:
    """many_short's requests on the admission engine, with the byte limit of
    its pages and, in pooled mode, the admission probe."""
    from testing.inproc import llm_vocab
    from vllm_hybrid.tools.plan.geometry import kv_geometry
    from vllm_hybrid.tools.simulate.sources import ManyShortShape, ManyShortWorkload
    from vllm_hybrid.v1.core.pooled.coordinator import arena_of

    from .engine import drive
    from .workloads import _counted, _shape, check_finished

    scheduler = engine.scheduler
    geometry = kv_geometry(scheduler.kv_cache_config)
    shape = _shape(ManyShortShape, cfg, "many_short")
    workload = ManyShortWorkload(shape, llm_vocab(engine.llm))
    lens = [len(prompt) for prompt in workload.prompts]
    limit = engine_byte_limit(engine, lens, shape.output)
    pooled = arena_of(scheduler.kv_cache_manager) is not None
    probe = AdmissionProbe(scheduler) if pooled else None
    result = drive(engine, workload, cfg, geometry)
    check_finished(result, "admission")
    counted = _counted(result)
    metrics = {
        key: counted[key]
        for key in ("peak_running", "mean_running", "preemptions", "engine_steps")
    }
    waited = [s.running for s in result.samples if s.waiting]
    mean_waiting = sum(waited) / len(waited) if waited else None
    allowed = limit.window_concurrency

    def over_limit(running: float | None) -> float | None:
        return running / allowed if running is not None and allowed else None

    metrics |= {
        "mean_running_waiting": mean_waiting,
        "byte_limit": allowed,
        "byte_limit_mean": limit.mean_concurrency,
        "peak_over_byte_limit": over_limit(counted["peak_running"]),
        "waiting_running_over_byte_limit": over_limit(mean_waiting),
        "state_page_padding": state_page_padding(scheduler.kv_cache_config),
        "cpu_s": counted["cpu_s"],
    }
    details: dict[str, Any] = {
        "prompt_lens": lens,
        "byte_limit": limit.summary(),
        "running_per_step": [s.running for s in result.samples],
        "waiting_per_step": [s.waiting for s in result.samples],
    }
    if pooled:
        details["byte_limit_max_state_blocks"] = pooled_byte_limit(
            scheduler.kv_cache_config, lens, shape.output, "max"
        ).summary()
    if probe is not None:
        details["probe"] = probe.summary()
        details["trace"] = probe.trace()
    return {"metrics": metrics, "details": details, "wall_s": result.wall_s}


# ---------------------------------------------------------------------------
# Acceptance: pooled mode against the byte limit and against upstream
# ---------------------------------------------------------------------------

#: Pooled peak running over the byte-limited concurrency, at least.
PEAK_OVER_LIMIT_TARGET = 0.9
#: Pooled engine steps over upstream's, at most.
STEPS_RATIO_TARGET = 0.85


@dataclass(frozen=True)
class Check:
    """One acceptance figure of the admission workload."""

    name: str
    value: float | None
    target: str
    met: bool | None

    def line(self) -> str:
        shown = "-" if self.value is None else f"{self.value:.2f}"
        if not self.target:
            return f"{self.name}: {shown} (no target)"
        verdict = {True: "met", False: "NOT met", None: "not measured"}[self.met]
        return f"{self.name}: {shown} (target {self.target}): {verdict}"


def acceptance(up: dict[str, Any], ov: dict[str, Any]) -> list[Check]:
    """The checks the admission workload answers, from each engine's
    metrics (upstream's and pooled mode's), and the concurrency pooled mode
    keeps while requests wait (a peak can be a step's overshoot that the
    next step's preemptions take back; no target)."""

    def get(metrics: dict[str, Any], key: str) -> Any:
        return metrics.get(key)

    peak, limit = get(ov, "peak_running"), get(ov, "byte_limit")
    over = peak / limit if peak is not None and limit else None
    pre_up, pre_ov = get(up, "preemptions"), get(ov, "preemptions")
    steps_up, steps_ov = get(up, "engine_steps"), get(ov, "engine_steps")
    steps = steps_ov / steps_up if steps_ov is not None and steps_up else None
    return [
        Check(
            "pooled peak running / byte-limited concurrency",
            over,
            f">= {PEAK_OVER_LIMIT_TARGET}",
            None if over is None else over >= PEAK_OVER_LIMIT_TARGET,
        ),
        Check(
            "pooled preemptions - upstream's",
            None if None in (pre_up, pre_ov) else pre_ov - pre_up,
            "<= 0",
            None if None in (pre_up, pre_ov) else pre_ov <= pre_up,
        ),
        Check(
            "pooled engine steps / upstream's",
            steps,
            f"<= {STEPS_RATIO_TARGET}",
            None if steps is None else steps <= STEPS_RATIO_TARGET,
        ),
        Check(
            "pooled mean running while requests wait / byte-limited concurrency",
            get(ov, "waiting_running_over_byte_limit"),
            "",
            None,
        ),
    ]


def diagnosis_lines(details: dict[str, Any], top: int = 6) -> list[str]:
    """The probe's summary of a pooled drive, a few lines to print."""
    probe = details.get("probe")
    if not probe:
        return []
    lines = []
    for title, key in (
        ("admission refused (request status: reason)", "refusals"),
        ("steps whose admission stopped on", "admission_stops"),
        (
            "preemptions (phase of the request served, state edge: reason)",
            "preemptions_for",
        ),
    ):
        counts = list(probe[key].items())[:top]
        shown = "; ".join(f"{k} x{v}" for k, v in counts) or "none"
        lines.append(f"{title}: {shown}")
    held = probe["state_blocks_held_request_steps"]
    lines.append(
        "state blocks held by a running request (blocks: request-steps): "
        + ", ".join(f"{k}: {v}" for k, v in held.items())
    )
    seen = [
        key
        for part in ("refusals", "admission_stops", "preemptions_for")
        for text in list(probe[part])[:top]
        for key in REASONS
        if text.endswith(f": {key}") or text == key
    ]
    lines += [f"{key}: {REASONS[key]}" for key in dict.fromkeys(seen)]
    counts = probe.get("coordinator") or {}
    if counts:
        lines.append(
            "state block edges crossed in place: "
            f"{counts.get('state_in_place', 0)} short of memory, "
            f"{counts.get('edges_in_place', 0)} at edges no policy keeps; "
            f"running state blocks moved off the boundary: "
            f"{counts.get('relocations', 0)}"
        )
    moves = probe["boundary_moves"]
    lines.append(
        f"boundary moves: state pool grew {moves.get('state', 0)}, token pool "
        f"grew {moves.get('token', 0)}; live token blocks moved off it: "
        f"{probe['token_blocks_moved']}"
    )
    return lines
