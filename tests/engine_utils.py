"""One in-process engine at a time, with the overlay on or off.

Shared by the engine tests that compare the overlay against upstream vLLM in
one process (``tests/`` is on ``sys.path`` through its ``conftest.py``).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Engine arguments every engine test uses unless it says otherwise. vLLM's
#: CPU platform forces the GDN SSM state to float32 on AVX512-BF16 hosts and
#: keeps the model's bf16 elsewhere: state pages, block sizes, budgets that
#: force preemption and token capacities would all depend on the machine a
#: run lands on. float32 is what the figures in docs/ were measured with.
HOST_INDEPENDENT = {"mamba_ssm_cache_dtype": "float32"}


def with_engine(
    model: str, overlay: bool, kwargs: dict[str, Any], work: Callable[[Any], T]
) -> T:
    """Build an engine (overlay on or off), run ``work(llm)``, tear it down.

    ``kwargs`` go to ``vllm.LLM`` on top of :data:`HOST_INDEPENDENT`.

    No reference to the engine survives this call, so the next engine in the
    process starts from a clean distributed state; the overlay is active
    again afterwards, as vLLM leaves it for the rest of a process.
    """
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.plugins import load_general_plugins

    from vllm_hybrid import plugin

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM loads plugins once per process; load them now so that the engine
    # below does not re-activate the overlay after it was switched off.
    load_general_plugins()
    plugin.deactivate()
    if overlay:
        plugin.register()
    llm = LLM(model=model, **(HOST_INDEPENDENT | kwargs))
    try:
        return work(llm)
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
        plugin.deactivate()
        plugin.register()


def scheduler(llm: Any) -> Any:
    """The in-process scheduler (needs multiprocessing off)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


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
