"""What keeps an engine from starting, in one place for the planner and
the simulator: the longest max_model_len each engine's own planning holds
in a budget, one message for it, and upstream's refusal of full CUDA graphs
in vLLM's own words.

The limit is what each engine picks with ``--max-model-len -1``: vLLM's
auto-fit on upstream's planning, pooled mode's own auto-fit on its arena.
Both columns of a plan, and the check ``simulate`` makes before it starts
an engine, read it from here, so a budget gives one number to lower
``--max-model-len`` to.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm_hybrid.tools.plan.errors import unwrapped
from vllm_hybrid.tools.plan.request import PlanRequest

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from vllm_hybrid.tools.plan.compute import ModePlan, Plan


def shared_pool_fit(vllm_config: VllmConfig, specs: dict[str, Any], budget: int) -> int:
    """The longest max_model_len a single shared pool holds in ``budget``:
    what its engine picks with ``--max-model-len -1`` (0: not one token),
    by the planning ``vllm.v1.core.kv_cache_utils`` holds when called:
    upstream's inside :func:`.config.overlay_off`, the overlay's single pool
    (pooled mode off) otherwise."""
    import vllm.v1.core.kv_cache_utils as kvu

    probe = copy.deepcopy(vllm_config)
    probe.model_config.original_max_model_len = -1
    try:
        kvu.get_kv_cache_configs(probe, [specs], [budget])
    except ValueError:
        return 0
    return probe.model_config.max_model_len


def graph_refusal(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> str | None:
    """vLLM's own message refusing full CUDA graphs for more sequences than
    the states it holds (its check when the runner resolves graph modes,
    asked of a copy of the compilation config)."""
    from vllm.v1.attention.backend import AttentionCGSupport

    compilation = copy.deepcopy(vllm_config.compilation_config)
    try:
        compilation.resolve_cudagraph_mode_and_sizes(
            AttentionCGSupport.ALWAYS,
            None,
            kv_cache_config=kv_cache_config,
            max_num_reqs=vllm_config.scheduler_config.max_num_seqs,
        )
    except ValueError as exc:
        return unwrapped(exc)
    return None


#: How messages name each mode's engine.
MODE_NAMES = {
    "upstream": "upstream vLLM 0.32",
    "pooled": "pooled mode",
    "single_pool": "the overlay's single pool",
}


def length_shortfall(
    request: PlanRequest, max_model_len: int, modes: Mapping[str, ModePlan]
) -> str | None:
    """One message for the modes of ``modes`` that cannot hold one request
    of ``max_model_len``, or None: each engine's own limit and one number to
    lower ``--max-model-len`` to, the longest every one of them holds."""
    limits = {
        name: mode.fits_max_model_len
        for name, mode in modes.items()
        if mode.fits_max_model_len is not None and not mode.same_as_upstream
    }
    if not limits:
        return None
    held = [f"{MODE_NAMES[n]} {v:,}" for n, v in limits.items()]
    each = " and ".join([", ".join(held[:-1]), held[-1]] if len(held) > 2 else held)
    whose = "each engine's" if len(held) > 1 else "the engine's"
    fits = min(limits.values())
    advice = (
        f"or lower --max-model-len to {fits:,}"
        if fits > 0
        else "(no --max-model-len fits: one request's state and one attention "
        "block do not)"
    )
    return (
        f"The KV cache budget of {request.kv_cache_memory / 2**20:,.2f} MiB per GPU "
        f"cannot hold one request of max_model_len {max_model_len:,} tokens; the "
        f"longest that fit, by {whose} own planning: {each}. Raise "
        f"{request.budget_options}, {advice}."
    )


def length_errors(plan: Plan) -> None:
    """A mode that cannot hold one request says so in the same figures as
    :func:`length_shortfall`; the advice, with its one number, is a note."""
    modes = [plan.upstream, plan.pooled, plan.single_pool]
    for mode in filter(None, modes):
        if mode.fits_max_model_len is not None:
            mode.error = (
                f"holds at most {mode.fits_max_model_len:,} tokens per request, "
                f"not max_model_len {plan.max_model_len:,}"
            )
