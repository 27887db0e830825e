"""One in-process engine at a time, with the overlay on or off.

Shared by the engine tests that compare the overlay against upstream vLLM in
one process (``tests/`` is on ``sys.path`` through its ``conftest.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

# engine_core and NEAR_TIE: re-exported for the engine tests
from testing.inproc import engine_core, open_llm
from vllm_hybrid.tools.greedy import NEAR_TIE, first_difference, top2_gaps

T = TypeVar("T")

try:
    # tests/site/sitecustomize.py, loaded in every process of the suite
    from sitecustomize import full_collect
except ImportError:  # a script of the suite run by hand
    import gc

    full_collect = gc.collect

#: Engine arguments every engine test uses unless it says otherwise.
ENGINE_DEFAULTS = {
    # vLLM's CPU platform forces the GDN SSM state to float32 on AVX512-BF16
    # hosts and keeps the model's bf16 elsewhere: state pages, block sizes,
    # budgets that force preemption and token capacities would all depend on
    # the machine a run lands on. float32 is what docs/ figures were measured
    # with.
    "mamba_ssm_cache_dtype": "float32",
    # torch.compile costs about 35 s per engine start on CPU and changes
    # nothing the overlay does; the OpenAI server test keeps vLLM's default.
    "enforce_eager": True,
}


def with_engine(
    model: str, overlay: bool, kwargs: dict[str, Any], work: Callable[[Any], T]
) -> T:
    """Build an engine (overlay on or off), run ``work(llm)``, tear it down.

    ``kwargs`` go to ``vllm.LLM`` on top of :data:`ENGINE_DEFAULTS`.

    No reference to the engine survives this call, so the next engine in the
    process starts from a clean distributed state; the overlay is active
    again afterwards, as vLLM leaves it for the rest of a process.
    """
    from vllm.plugins import load_general_plugins

    from vllm_hybrid import plugin

    # vLLM loads plugins once per process; load them now so that the engine
    # below does not re-activate the overlay after it was switched off.
    load_general_plugins()
    plugin.deactivate()
    if overlay:
        plugin.register()
    engine_kwargs = {"model": model, **ENGINE_DEFAULTS, **kwargs}
    try:
        with open_llm(engine_kwargs, full_collect) as llm:
            result = work(llm)
            del llm  # so that the collection on leaving frees the engine
        return result
    finally:
        plugin.deactivate()
        plugin.register()


@contextmanager
def stand_in_engine(model: Any, budget: int, checkpoint_interval: int) -> Iterator[Any]:
    """A pooled engine of the tiny ``model`` on the simulator's stand-in
    executor (no model compute), for tests of what its scheduler schedules:
    256 MiB of KV, 16 sequences of at most 8,192 tokens, a token budget of
    ``budget`` and prefill checkpoints every ``checkpoint_interval`` tokens."""
    from vllm_hybrid.tools.plan.geometry import EngineOptions
    from vllm_hybrid.tools.plan.request import PlanRequest
    from vllm_hybrid.tools.simulate.engine import open_engine

    request = PlanRequest(
        model=str(model),
        kv_cache_memory=256 * 2**20,
        device="cpu",
        mamba_ssm_cache_dtype=ENGINE_DEFAULTS["mamba_ssm_cache_dtype"],
        max_num_seqs=16,
        max_num_batched_tokens=budget,
        max_model_len=8192,
    )
    hybrid_kv = {"prefill_checkpoint_interval": checkpoint_interval}
    with open_engine(request, model, EngineOptions(hybrid_kv=hybrid_kv)) as engine:
        yield engine


def scheduler(llm: Any) -> Any:
    """The in-process scheduler (needs multiprocessing off)."""
    return engine_core(llm).scheduler


def record_preemptions(sched: Any) -> list[tuple[str, int]]:
    """Wrap the scheduler's preemption method; the returned list gets one
    ``(request id, output tokens so far)`` entry per preemption."""
    preempted: list[tuple[str, int]] = []
    original = sched._preempt_request

    def recording(request: Any, *args: Any, **kwargs: Any) -> Any:
        preempted.append((request.request_id, request.num_output_tokens))
        return original(request, *args, **kwargs)

    sched._preempt_request = recording
    return preempted


def record_calls(obj: Any, name: str) -> list[tuple]:
    """Wrap the method ``obj.name``; the returned list gets the positional
    arguments of every later call."""
    calls: list[tuple] = []
    original = getattr(obj, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    setattr(obj, name, recording)
    return calls


def record_scheduled_tokens(sched: Any) -> list[dict[str, int]]:
    """Wrap ``sched.schedule``; the returned list gets the tokens each later
    step schedules, per request id."""
    steps: list[dict[str, int]] = []
    schedule = sched.schedule

    def recording(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        steps.append(dict(out.num_scheduled_tokens))
        return out

    sched.schedule = recording
    return steps


def bench_pooled() -> ModuleType:
    """The library behind ``benchmarks/bench_pooled.py``, the package
    ``benchmarks.pooled`` (the repository root is on ``sys.path`` through
    its ``conftest.py``)."""
    return importlib.import_module("benchmarks.pooled")


@dataclass
class Greedy:
    """Greedy completions of a batch of prompts."""

    tokens: list[list[int]]
    #: per prompt and output token, the top-2 log-probability gap
    gaps: list[list[float | None]]
    #: per prompt, the prompt tokens that were prefix-cache hits
    cached: list[int] | None = None


def generate_greedy(llm: Any, prompts: Sequence[Any], max_tokens: int) -> Greedy:
    """Greedy decoding of ``prompts`` (EOS ignored), with top-2 gaps."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2
    )
    outputs = llm.generate(list(prompts), params, use_tqdm=False)
    completions = [o.outputs[0] for o in outputs]
    return Greedy(
        [list(c.token_ids) for c in completions],
        [top2_gaps(c) for c in completions],
        [o.num_cached_tokens or 0 for o in outputs],
    )


def near_tie_differences(
    reference: Greedy,
    tokens: Sequence[list[int]],
    other_gaps: Sequence[list[float | None]] | None = None,
) -> list[tuple[int, int, float | None]]:
    """(prompt, first differing position, the reference's top-2 gap there)
    for every prompt whose ``tokens`` differ from the reference's other than
    by starting at a near-tie (:data:`NEAR_TIE`). Empty: equal up to bf16
    rounding. The reference is the run whose behaviour is trusted (upstream,
    or the uncached run): where it was confident, a different token is a
    fault, not rounding.

    With ``other_gaps`` (the other run's top-2 gaps) a difference also counts
    as a near-tie when the two runs' gaps there add up to at most
    ``2 * NEAR_TIE``: each run put its own token ahead by less than one
    rounding step. Runs that score a token in batches of another shape
    (speculative decoding verifies several tokens per forward pass) round
    both ways."""
    found = []
    for i, (ref, ids) in enumerate(zip(reference.tokens, tokens, strict=True)):
        at = first_difference(ref, ids)
        if at is None:
            continue
        gaps = reference.gaps[i]
        gap = gaps[at] if at < len(gaps) else None
        if gap is not None and gap > NEAR_TIE and other_gaps is not None:
            theirs = other_gaps[i][at] if at < len(other_gaps[i]) else None
            if theirs is not None and gap + theirs <= 2 * NEAR_TIE:
                continue
        if gap is None or gap > NEAR_TIE:
            found.append((i, at, gap))
    return found


def qwen3_5_like_kv_config(block_size: int = 256, padded: int | None = 524288):
    """A scheduler-side KVCacheConfig shaped like the tiny qwen3_5 model:
    3 GDN groups of 2 layers and 1 attention group of 2 layers."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
    )

    attn = FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=256, dtype=torch.bfloat16
    )
    gdn = MambaSpec(
        block_size=block_size,
        shapes=((3, 1024), (4, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=padded,
    )
    groups = [
        KVCacheGroupSpec(
            [f"layers.{i}.linear_attn", f"layers.{i + 4}.linear_attn"], gdn
        )
        for i in range(3)
    ]
    groups.append(KVCacheGroupSpec(["layers.3.attn", "layers.7.attn"], attn))
    num_blocks = 48
    block_bytes = 2 * attn.page_size_bytes
    tensors = [
        KVCacheTensor(
            size=block_bytes * num_blocks,
            layers=g.layer_names,
            layer_stride=attn.page_size_bytes * num_blocks,
            block_stride=attn.page_size_bytes,
        )
        for g in groups
    ]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
    )
