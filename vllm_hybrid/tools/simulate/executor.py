"""A stand-in for vLLM's executor: the real geometry, no model.

vLLM's engine core talks to its model only through the executor interface
(``vllm.v1.executor.abstract.Executor``): it asks for every layer's
``KVCacheSpec`` and the memory left for the KV cache, hands the resulting
``KVCacheConfig`` back, then sends one ``SchedulerOutput`` per step and
reads the sampled tokens. :class:`StandInExecutor` answers those calls with
the model's layer specs and KV budget for the device planned
(:class:`~vllm_hybrid.tools.plan.geometry.EngineGeometry`), and with
deterministic tokens: the first output token when a request's prompt is
done, one token per decode step after that. Everything the engine decides
(admission, chunking, prefix hits, eviction, preemption, state checkpoints)
is vLLM's and the overlay's own code.

Each step is observed (:class:`~.steps.StepObserver`), which counts what a
runner would compute and copy, and the step's record is kept for the
driver's clock.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from vllm.v1.executor.abstract import Executor

from vllm_hybrid.tools.simulate.steps import StepObserver, StepRecord, state_geometry

#: Output tokens of the stand-in: (request id, output index) -> token id.
TokenSource = Callable[[str, int], int]


def counting_tokens(vocab_size: int) -> TokenSource:
    """Deterministic ids that differ per request and position: no two
    requests repeat each other's replies, so a reply never makes a prefix
    hit that the real model's reply would not."""

    def token(request_id: str, index: int) -> int:
        seed = zlib.crc32(request_id.encode())
        return (seed * 31 + 7919 * (index + 1)) % (vocab_size - 3) + 3

    return token


def replayed_tokens(
    recorded: Mapping[str, Sequence[int]], fallback: TokenSource
) -> TokenSource:
    """Tokens a real engine produced (by request id), for workloads whose
    later prompts contain earlier replies; ``fallback`` for anything else."""

    def token(request_id: str, index: int) -> int:
        ids = recorded.get(request_id)
        if ids is not None and index < len(ids):
            return int(ids[index])
        return fallback(request_id, index)

    return token


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class StandInExecutor(Executor):
    """The executor interface over :class:`EngineGeometry` (see the module
    docstring). Subclasses made by :func:`stand_in_executor` carry the
    geometry, budget and token source as class attributes, since the engine
    core builds its executor from a class and the config alone."""

    geometry: Any = None
    kv_cache_memory: int = 0
    tokens: TokenSource | None = None
    uses_ray = False
    supports_pp = False

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def _init_executor(self) -> None:
        self.world_size = self.parallel_config.world_size
        self.geometry.align_block_size()
        self.specs = self.geometry.layer_specs()
        self.kv_cache_config: Any = None
        self.observer: StepObserver | None = None
        #: records of the steps executed since the driver last took them
        self.records: list[StepRecord] = []
        #: request id -> (prompt length, output tokens sampled so far)
        self._lengths: dict[str, list[int]] = {}
        self._pending: Any = None

    # -- start-up ------------------------------------------------------------

    def collective_rpc(  # type: ignore[override]
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        non_block: bool = False,
    ) -> Any:
        """Start-up questions the engine core asks every worker; the answer is
        the same on every rank."""
        if callable(method):
            raise NotImplementedError("the stand-in executor runs no callables")
        handler = getattr(self, f"_rpc_{method}", None)
        if handler is None:
            raise NotImplementedError(f"the stand-in executor has no {method!r}")
        result = [handler(*args, **(kwargs or {}))] * self.world_size
        return _done(result) if non_block else result

    def _rpc_get_kv_cache_spec(self) -> dict[str, Any]:
        return self.specs

    def _rpc_determine_available_memory(self) -> int:
        return self.kv_cache_memory

    def _rpc_get_supported_kv_cache_layouts(self) -> list[str]:
        from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

        return [
            layout.name
            for layout in get_supported_kv_cache_layouts([self.geometry.backend])
        ]

    def _rpc_set_kv_cache_layout(self, layout_name: str) -> None:
        from vllm.v1.attention.backends.utils import record_kv_cache_layout

        record_kv_cache_layout(self.cache_config, layout_name)

    def _rpc_initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        self.kv_cache_config = kv_cache_configs[0]
        from vllm_hybrid.tools.simulate.clock import Runner, cuda_runner
        from vllm_hybrid.v1.worker.state_reads import copy_free_chunk_tokens

        block, group = state_geometry(
            self.kv_cache_config, self.cache_config.mamba_cache_mode
        )
        # the engine modeled runs on CUDA; only Model Runner V2 drops the
        # copies of chunks that read out of place
        free = None
        if cuda_runner() is Runner.V2:
            free = copy_free_chunk_tokens(
                self.vllm_config, self.kv_cache_config, cuda=True
            )
        self.observer = StepObserver(block, group, free)

    def _rpc_compile_or_warm_up_model(self) -> Any:
        from vllm.v1.worker.worker_base import CompilationTimes

        return CompilationTimes(0.0, 0.0)

    def _rpc_get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def _rpc_update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    def _rpc_shutdown(self) -> None:
        return None

    def check_health(self) -> None:
        return None

    def take_draft_token_ids(self) -> None:
        return None

    # -- steps -------------------------------------------------------------

    def execute_model(  # type: ignore[override]
        self, scheduler_output: Any, non_block: bool = False
    ) -> Any:
        """Observe the step and prepare its sampled tokens; they are handed
        out by :meth:`sample_tokens`, as a real runner does (a step with no
        token scheduled answers at once, with an empty output)."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        self.records.append(self.observer.observe(scheduler_output))
        if scheduler_output.total_num_scheduled_tokens <= 0:
            result = EMPTY_MODEL_RUNNER_OUTPUT
        else:
            self._pending = self._sample(scheduler_output)
            result = None
        return _done(result) if non_block else result

    def sample_tokens(  # type: ignore[override]
        self, grammar_output: Any, non_block: bool = False
    ) -> Any:
        output, self._pending = self._pending, None
        return _done(output) if non_block else output

    def _sample(self, scheduler_output: Any) -> Any:
        """One token for every request whose known tokens are all computed
        after this step; none for a prefill chunk that stops short."""
        from vllm.v1.outputs import ModelRunnerOutput

        lengths = self._lengths
        for req_id in scheduler_output.finished_req_ids:
            lengths.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            lengths.setdefault(new.req_id, [len(new.prompt_token_ids or ()), 0])
        computed = dict(
            zip(
                scheduler_output.scheduled_cached_reqs.req_ids,
                scheduler_output.scheduled_cached_reqs.num_computed_tokens,
                strict=True,
            )
        )
        for new in scheduler_output.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            known = lengths[req_id]
            end = computed[req_id] + scheduler_output.num_scheduled_tokens[req_id]
            if end >= known[0] + known[1]:
                sampled.append([self.tokens(req_id, known[1])])
                known[1] += 1
            else:
                sampled.append([])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )

    def take_records(self) -> list[StepRecord]:
        """The records of the steps executed since the last call."""
        records, self.records = self.records, []
        return records


def stand_in_executor(
    geometry: Any, kv_cache_memory: int, tokens: TokenSource
) -> type[StandInExecutor]:
    """A :class:`StandInExecutor` class bound to one engine's geometry."""
    return type(
        "StandInExecutor",
        (StandInExecutor,),
        {
            "geometry": geometry,
            "kv_cache_memory": kv_cache_memory,
            "tokens": staticmethod(tokens),
        },
    )
