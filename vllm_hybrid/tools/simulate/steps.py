"""What one engine step computes, read from the scheduler's output alone.

A model runner learns everything it does in a step from the
``SchedulerOutput`` it receives: which requests run, from which token, for
how many tokens, into which blocks. :class:`StepObserver` keeps the little
per-request state a runner keeps and turns each output into a
:class:`StepRecord`: prefill and decode tokens, the context decode reads,
preemptions, and the align-mode state copies the runner makes. The stand-in
executor observes every step it is given; :class:`ExecutedSteps` attaches the
same observer to a real engine's executor (the benchmark's engines, the
simulator's trust test), so both are counted by one piece of code.

State copies follow vLLM 0.32's ``preprocess_mamba`` (the V1 runner, no
speculative decoding): a request's running state lives in the block column
of its last computed token; when a step moves that column (a block edge is
crossed, or a new request starts from a cached checkpoint and runs past its
block), the state is copied to the new column. When both columns name the
same block id (pooled mode letting a request cross its edge in place) the
copy moves nothing new; it is counted as a self copy too. Model Runner V2's
fused pre-copy copies at the same column changes; the overlay drops self
copies on both runners, so they cost nothing (:attr:`StepRecord.copies_moved`).
Copy-on-write
block copies (a sub-block prefix hit taking over a cached checkpoint) come
from the output's ``kv_cache_block_copies``, the token blocks pooled mode
moves off its arena's boundary from its ``hybrid_token_moves``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from vllm_hybrid.v1.core.pooled.moves import MOVES_ATTRIBUTE


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class StepRecord:
    """Counted work of one step (or, summed, of a run)."""

    steps: int = 0
    #: requests with tokens scheduled
    requests: int = 0
    #: tokens computed for the first time at a prompt position, or again at
    #: any position (recomputation after preemption)
    prefill_tokens: int = 0
    #: tokens computed for the first time past the prompt (one per request
    #: and step while decoding)
    decode_tokens: int = 0
    #: sum over decode tokens of the context they attend to
    decode_context: int = 0
    #: sum over prefill tokens of their position (attention work of a chunk)
    prefill_context: int = 0
    #: requests scheduled for the first time, and their prompt tokens
    new_requests: int = 0
    new_prompt_tokens: int = 0
    preemptions: int = 0
    state_copies: int = 0
    state_self_copies: int = 0
    #: copies before a prefill chunk that reads its state in the source
    #: block instead (:mod:`vllm_hybrid.v1.worker.state_reads`)
    state_reads_elsewhere: int = 0
    cow_copies: int = 0
    #: live token blocks the workers copy elsewhere before the step, so
    #: that the arena's boundary could move (``hybrid_token_moves``,
    #: :mod:`vllm_hybrid.v1.core.pooled.moves`)
    token_moves: int = 0

    @property
    def copies_moved(self) -> int:
        """State copies that move a state: all but those of a block onto
        itself (an edge crossed in place), which the overlay's runners skip
        (:mod:`vllm_hybrid.v1.worker.mamba_copies`), and those Model Runner
        V2 drops before chunks that read out of place."""
        return self.state_copies - self.state_self_copies - self.state_reads_elsewhere

    def add(self, other: StepRecord) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class _Tracked:
    """What a runner remembers of one request."""

    prompt_len: int
    #: highest position computed so far (positions below it are recomputed)
    computed_high: int = 0
    #: block ids of the first state group, by column
    state_column: list[int] = field(default_factory=list)


class StepObserver:
    """Counts each step of one engine (see the module docstring).

    ``state_block`` is the state groups' block size in align mode (None when
    the engine caches no state checkpoints: no copies), ``state_group`` the
    index of the first state group in the block id tuples.
    ``copy_free_tokens``: on an engine whose prefill chunks of at least that
    many tokens, and the decodes of a step of decodes only, read their state
    out of place (:mod:`vllm_hybrid.v1.worker.state_reads`), the copies
    before such steps are counted as ``state_reads_elsewhere``.
    """

    def __init__(
        self,
        state_block: int | None,
        state_group: int | None,
        copy_free_tokens: int | None = None,
    ) -> None:
        self.state_block = state_block
        self.state_group = state_group
        self.copy_free_tokens = copy_free_tokens
        #: whether the step being observed runs decodes only
        self.decode_only = False
        self.requests: dict[str, _Tracked] = {}
        #: running-state column of each request, as ``mamba_state_idx``
        self.state_index: dict[str, int] = {}
        self.total = StepRecord()
        #: prefill tokens computed per request, recomputation included
        self.prefill_by_request: dict[str, int] = {}

    def observe(self, output: Any) -> StepRecord:
        """Count one ``SchedulerOutput``; the totals are kept in ``total``."""
        record = StepRecord(steps=1)
        finished = output.finished_req_ids
        preempted = output.preempted_req_ids or set()
        cached = output.scheduled_cached_reqs
        for req_id in finished:
            self.requests.pop(req_id, None)
        for req_id in (*finished, *preempted, *cached.resumed_req_ids):
            self.state_index.pop(req_id, None)
        record.preemptions = len(preempted)
        scheduled = output.num_scheduled_tokens
        self.decode_only = self.copy_free_tokens is not None and self._decodes_only(
            output
        )
        for new in output.scheduled_new_reqs:
            tracked = self.requests.get(new.req_id)
            if tracked is None:
                tracked = _Tracked(len(new.prompt_token_ids or ()))
                self.requests[new.req_id] = tracked
                record.new_requests += 1
                record.new_prompt_tokens += tracked.prompt_len
            if self.state_group is not None:
                tracked.state_column = list(new.block_ids[self.state_group])
            self._count(record, new.req_id, tracked, new.num_computed_tokens, scheduled)
        for i, req_id in enumerate(cached.req_ids):
            tracked = self.requests[req_id]
            blocks = cached.new_block_ids[i]
            if self.state_group is not None and blocks is not None:
                if req_id in cached.resumed_req_ids:
                    tracked.state_column = list(blocks[self.state_group])
                else:
                    tracked.state_column.extend(blocks[self.state_group])
            computed = cached.num_computed_tokens[i]
            self._count(record, req_id, tracked, computed, scheduled)
        record.cow_copies = len(output.kv_cache_block_copies or ())
        record.token_moves = len(getattr(output, MOVES_ATTRIBUTE, None) or ())
        self.total.add(record)
        return record

    @staticmethod
    def _decodes_only(output: Any) -> bool:
        """Whether every scheduled request runs one token on computed ones
        (the metadata builder's batch without prefills)."""
        scheduled = output.num_scheduled_tokens
        cached = output.scheduled_cached_reqs
        steps = [
            (n.num_computed_tokens, scheduled.get(n.req_id, 0))
            for n in output.scheduled_new_reqs
        ]
        steps += [
            (cached.num_computed_tokens[i], scheduled.get(req_id, 0))
            for i, req_id in enumerate(cached.req_ids)
        ]
        steps = [(computed, n) for computed, n in steps if n > 0]
        return bool(steps) and all(n == 1 and computed > 0 for computed, n in steps)

    def _count(
        self,
        record: StepRecord,
        req_id: str,
        tracked: _Tracked,
        computed: int,
        scheduled: dict[str, int],
    ) -> None:
        n = scheduled.get(req_id, 0)
        if n <= 0:
            return
        record.requests += 1
        end = computed + n
        first_new = max(computed, tracked.prompt_len, tracked.computed_high)
        decode = max(0, end - first_new)
        record.decode_tokens += decode
        record.prefill_tokens += n - decode
        if n > decode:
            self.prefill_by_request[req_id] = (
                self.prefill_by_request.get(req_id, 0) + n - decode
            )
        record.decode_context += decode * end
        # positions computed+0 .. end-1, less the decode ones
        prefill_end = end - decode
        record.prefill_context += (computed + prefill_end - 1) * (n - decode) // 2
        tracked.computed_high = max(tracked.computed_high, end)
        if self.state_block is not None:
            self._copy(record, req_id, tracked, computed, end)

    def _copy(
        self,
        record: StepRecord,
        req_id: str,
        tracked: _Tracked,
        computed: int,
        end: int,
    ) -> None:
        block = self.state_block
        previous = self.state_index.get(req_id)
        if previous is None:
            previous = (computed - 1) // block
        current = cdiv(end, block) - 1
        self.state_index[req_id] = current
        if previous == -1 or previous == current:
            return
        record.state_copies += 1
        column = tracked.state_column
        if max(previous, current) < len(column) and column[previous] == column[current]:
            record.state_self_copies += 1
        elif self.copy_free_tokens is not None and (
            end - computed >= self.copy_free_tokens
            or (self.decode_only and end - computed == 1)
        ):
            record.state_reads_elsewhere += 1


def state_geometry(
    kv_cache_config: Any, mamba_cache_mode: str
) -> tuple[int | None, int | None]:
    """(state block size, first state group index) of an engine's config
    when it caches align-mode checkpoints; (None, None) otherwise."""
    from vllm.v1.kv_cache_interface import MambaSpec

    if mamba_cache_mode != "align":
        return None, None
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if isinstance(group.kv_cache_spec, MambaSpec):
            return group.kv_cache_spec.block_size, index
    return None, None


class ExecutedSteps:
    """The step records of an in-process engine core with a real executor,
    observed at the call the stand-in executor observes them at (each
    scheduler output handed to ``execute_model``), so that a real engine and
    the stand-in are counted alike. ``observer.total`` sums every step since
    attaching; :meth:`take` returns the records not yet taken (what a
    ``Driver`` reads after each step)."""

    def __init__(self, core: Any) -> None:
        mode = core.vllm_config.cache_config.mamba_cache_mode
        geometry = state_geometry(core.scheduler.kv_cache_config, mode)
        self.observer = StepObserver(*geometry)
        self.records: list[StepRecord] = []
        execute = core.model_executor.execute_model

        def observed(output: Any, non_block: bool = False) -> Any:
            self.records.append(self.observer.observe(output))
            return execute(output, non_block)

        core.model_executor.execute_model = observed

    def take(self) -> list[StepRecord]:
        taken, self.records = self.records, []
        return taken


def summed(records: Iterable[StepRecord]) -> StepRecord:
    total = StepRecord()
    for record in records:
        total.add(record)
    return total
