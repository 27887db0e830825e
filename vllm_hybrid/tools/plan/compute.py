"""The two plans: upstream vLLM 0.32's single shared pool and pooled mode.

The upstream column runs vLLM's own block size alignment and
``vllm.v1.core.kv_cache_utils`` with the overlay reverted; the pooled column
runs the worker's block alignment and the engine core's own planning
function (:func:`vllm_hybrid.v1.core.pooled.engine.plan_pooled_configs`) on
the layer specs at natural sizes, and the capacity figures the engine logs
(:mod:`vllm_hybrid.v1.core.pooled.capacity`, which the upstream column's
bytes per request and the CUDA-graph rows read as well).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_hybrid.tools.plan.config import (
    attention_backend,
    current_platform_as,
    layer_kinds,
    layer_specs,
    overlay_off,
    platform_class,
    resolve_layout,
    upstream_align,
)
from vllm_hybrid.tools.plan.errors import PlanError
from vllm_hybrid.tools.plan.geometry import planned_config
from vllm_hybrid.tools.plan.limits import (
    graph_refusal,
    length_errors,
    length_shortfall,
    shared_pool_fit,
)
from vllm_hybrid.tools.plan.messages import error_text
from vllm_hybrid.tools.plan.precheck import check_before_vllm
from vllm_hybrid.tools.plan.request import PlanRequest, model_dir

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass
class ModePlan:
    """Figures of one mode (upstream or pooled); ``error`` if it cannot run."""

    mode: str
    error: str | None = None
    note: str | None = None
    attention_block_size: int | None = None
    attention_page_bytes: int | None = None
    state_page_bytes: int | None = None
    state_page_padded_bytes: int | None = None
    state_padding_bytes: int | None = None
    state_padding_pct: float | None = None
    groups: list[dict[str, Any]] = field(default_factory=list)
    pools: list[dict[str, Any]] = field(default_factory=list)
    num_blocks: int | None = None
    token_capacity: int | None = None
    #: Longest sequence one request can hold.
    max_tokens_one_request: int | None = None
    max_concurrency: float | None = None
    #: prompt length -> {"max_concurrency": x, "bytes_per_request": n}
    at_prompt_len: dict[int, dict[str, float]] = field(default_factory=dict)
    #: Full CUDA graphs against the states (CUDA hybrids with full graphs):
    #: {"graph_rows", "states", "cap", "refused"}; None where not planned.
    cuda_graphs: dict[str, Any] | None = None
    #: Where one request of max_model_len does not fit: the longest
    #: max_model_len this mode's engine holds in the budget (its own
    #: ``--max-model-len -1`` fit; 0 if not one token). None: it fits.
    fits_max_model_len: int | None = None
    #: vLLM's own message where upstream would refuse to start (its full
    #: CUDA graphs need more states than it holds).
    refusal: str | None = None
    #: The pooled column repeats upstream's plan (pooled mode does not apply).
    same_as_upstream: bool = False


@dataclass
class Plan:
    """Both plans for one request, plus what they were computed from."""

    model: str
    architecture: str
    preset: str | None
    device: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    kv_cache_memory: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prefix_caching: bool
    mamba_cache_mode: str
    hybrid: bool
    attention_layers: int
    state_layers: int
    prompt_lens: list[int]
    notes: list[str]
    upstream: ModePlan
    pooled: ModePlan
    #: The ``vllm serve`` line planned for (when the request came from one).
    serve_command: str | None = None
    #: The overlay's single pool, where asked for (:func:`plan_single_pool`).
    single_pool: ModePlan | None = None

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for mode in ("upstream", "pooled"):
            data[mode]["at_prompt_len"] = {
                str(k): v for k, v in data[mode]["at_prompt_len"].items()
            }
        return data


def _group_rows(kv_cache_config: KVCacheConfig) -> list[dict[str, Any]]:
    from vllm.v1.kv_cache_interface import MambaSpec

    rows = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        rows.append(
            {
                "kind": "state" if isinstance(spec, MambaSpec) else "attention",
                "layers": len(group.layer_names),
                "block_size": spec.block_size,
                "page_bytes": spec.page_size_bytes,
            }
        )
    return rows


def _with_len(vllm_config: VllmConfig, length: int) -> VllmConfig:
    """A shallow copy of ``vllm_config`` whose max_model_len is ``length``."""
    config = copy.copy(vllm_config)
    model_config = copy.copy(vllm_config.model_config)
    object.__setattr__(model_config, "max_model_len", length)
    object.__setattr__(config, "model_config", model_config)
    return config


def _fill_state_padding(plan: ModePlan, specs: dict[str, Any]) -> None:
    from vllm.v1.kv_cache_interface import MambaSpec

    states = [s for s in specs.values() if isinstance(s, MambaSpec)]
    attention = [s for s in specs.values() if not isinstance(s, MambaSpec)]
    plan.attention_block_size = attention[0].block_size
    plan.attention_page_bytes = attention[0].page_size_bytes
    if not states:
        return
    real = states[0].real_page_size_bytes
    padded = states[0].page_size_bytes
    plan.state_page_bytes = real
    plan.state_page_padded_bytes = padded
    plan.state_padding_bytes = padded - real
    plan.state_padding_pct = 100 * (padded - real) / real


def _shared_block_bytes(kv_cache_config: KVCacheConfig) -> int:
    """:func:`~vllm_hybrid.v1.core.pooled.capacity.shared_block_bytes`, its
    refusal as the planner's error."""
    from vllm_hybrid.v1.core.pooled.capacity import shared_block_bytes

    try:
        return shared_block_bytes(kv_cache_config)
    except ValueError as exc:
        raise PlanError(str(exc)) from exc


def plan_upstream(
    request: PlanRequest, vllm_config: VllmConfig, prompt_lens: Sequence[int]
) -> ModePlan:
    """vLLM 0.32's single shared pool, as its engine would start."""
    import vllm.v1.core.kv_cache_utils as kvu

    from vllm_hybrid.v1.core.kv_cache_utils import kv_cache_token_capacity
    from vllm_hybrid.v1.core.pooled.capacity import group_blocks_per_request

    plan = ModePlan("upstream")
    if request.device == "cpu" and request.kv_cache_dtype.startswith("turboquant_"):
        plan.error = (
            "vLLM 0.32 has no TurboQuant attention on CPU (CPU_ATTN supports "
            "auto/fp8 KV caches only)"
        )
        return plan
    config = copy.deepcopy(vllm_config)
    backend = attention_backend(request, pooled=False)
    with overlay_off():
        platform_class(
            request.device, backend, upstream_align()
        ).update_block_size_for_backend(config)
        specs = layer_specs(config, backend)
        resolve_layout(config, backend, specs)
        try:
            worker = kvu.get_kv_cache_configs(
                config, [specs], [request.kv_cache_memory]
            )
        except ValueError as exc:
            plan.error = error_text(exc, request)
            fit = shared_pool_fit(config, specs, request.kv_cache_memory)
            if fit < config.model_config.max_model_len:
                plan.fits_max_model_len = fit
            return plan
        scheduler = kvu.generate_scheduler_kv_cache_config(worker)
        tokens, concurrency = kvu.get_kv_cache_capacity(config, scheduler)
        plan.cuda_graphs = _graph_figures(config, worker[0], upstream=True)
        if plan.cuda_graphs and plan.cuda_graphs["refused"]:
            plan.refusal = graph_refusal(config, worker[0])
    _fill_state_padding(plan, specs)
    plan.groups = _group_rows(scheduler)
    plan.num_blocks = scheduler.num_blocks
    block_bytes = _shared_block_bytes(worker[0])
    plan.pools = [
        {
            "kind": "shared",
            "num_blocks": scheduler.num_blocks,
            "block_bytes": block_bytes,
        }
    ]
    plan.token_capacity = tokens
    plan.max_tokens_one_request = kv_cache_token_capacity(config, scheduler)
    plan.max_concurrency = concurrency
    for length in prompt_lens:
        at = _with_len(config, length)
        blocks = group_blocks_per_request(at, scheduler.kv_cache_groups)
        plan.at_prompt_len[length] = {
            "max_concurrency": kvu.get_max_concurrency_for_kv_cache_config(
                at, scheduler
            ),
            "bytes_per_request": blocks * block_bytes,
        }
    return plan


def plan_single_pool(request: PlanRequest, vllm_config: VllmConfig) -> ModePlan:
    """The overlay's single shared pool (``hybrid_kv.pooled`` false), as far
    as its engine's start-up planning goes: whether one request of
    max_model_len fits, and the longest that does. The simulator checks it
    before starting a ``single-pool`` engine; plans do not show it."""
    import vllm.v1.core.kv_cache_utils as kvu

    from vllm_hybrid.platforms.hybrid_block_size import align_hybrid_block_size

    plan = ModePlan("single_pool")
    config = copy.deepcopy(vllm_config)
    additional = dict(config.additional_config or {})
    additional["hybrid_kv"] = {**(additional.get("hybrid_kv") or {}), "pooled": False}
    config.additional_config = additional
    backend = attention_backend(request, pooled=True)
    platform = platform_class(request.device, backend, align_hybrid_block_size)
    platform.update_block_size_for_backend(config)
    specs = layer_specs(config, backend)
    resolve_layout(config, backend, specs)
    budget = request.kv_cache_memory
    with current_platform_as(platform()):
        try:
            worker = kvu.get_kv_cache_configs(config, [specs], [budget])
        except ValueError as exc:
            plan.error = error_text(exc, request)
            fit = shared_pool_fit(config, specs, budget)
            if fit < config.model_config.max_model_len:
                plan.fits_max_model_len = fit
            return plan
    plan.num_blocks = worker[0].num_blocks
    return plan


def plan_pooled(
    request: PlanRequest,
    vllm_config: VllmConfig,
    prompt_lens: Sequence[int],
    upstream_plan: ModePlan,
) -> ModePlan:
    """This project's pooled mode (upstream's plan where it does not apply).

    The worker's block alignment and the engine core's planning function
    (``plan_pooled_configs``, the one ``get_kv_cache_configs`` calls) run on
    the layer specs, with the device's platform current, so budget, null
    blocks, layout check and capacity are the engine's own.
    """
    from vllm_hybrid.platforms.hybrid_block_size import align_hybrid_block_size
    from vllm_hybrid.v1.core.pooled.capacity import pooled_capacity
    from vllm_hybrid.v1.core.pooled.engine import plan_pooled_configs
    from vllm_hybrid.v1.core.pooled.layers import split_layers
    from vllm_hybrid.v1.core.pooled.planner import PooledPlanError
    from vllm_hybrid.v1.core.pooled.scope import pooled_mode_decision
    from vllm_hybrid.v1.core.pooled.spec import PoolKind
    from vllm_hybrid.v1.worker.pooled_views import PooledViewError

    config = copy.deepcopy(vllm_config)
    decision = pooled_mode_decision(config)
    if not decision.enabled:
        return _as_upstream(upstream_plan, decision.reason)
    backend = attention_backend(request, pooled=True)
    platform = platform_class(request.device, backend, align_hybrid_block_size)
    plan = ModePlan("pooled")
    try:
        platform.update_block_size_for_backend(config)
    except PooledViewError as exc:
        plan.error = error_text(exc, request)
        return plan
    specs = layer_specs(config, backend)
    resolve_layout(config, backend, specs)
    split = split_layers(specs)
    if split.token is None:
        return _as_upstream(upstream_plan, split.reason)
    try:
        with current_platform_as(platform()):
            configs = plan_pooled_configs(config, [specs], [request.kv_cache_memory])
    except PooledPlanError as exc:
        plan.error = error_text(exc, request)
        if exc.shortfall is not None:
            plan.fits_max_model_len = exc.shortfall.fitting_max_model_len
        return plan
    if configs is None:
        layout = config.cache_config.kv_cache_layout
        return _as_upstream(upstream_plan, f"KV cache layout {layout}")
    pooled = configs[0]
    _fill_state_padding(plan, specs)
    plan.groups = _group_rows(pooled)
    plan.pools = [
        {"kind": p.kind.value, "num_blocks": p.num_blocks, "block_bytes": p.block_bytes}
        for p in (
            pooled.pool_by_kind(PoolKind.TOKEN),
            pooled.pool_by_kind(PoolKind.STATE),
        )
    ]
    plan.num_blocks = pooled.num_blocks
    plan.cuda_graphs = _graph_figures(config, pooled, upstream=False)
    max_model_len = config.model_config.max_model_len
    capacity = pooled_capacity(pooled, max_model_len)
    plan.token_capacity = capacity.token_capacity
    # What the engine logs is already the longest single request: the token
    # pool with the state pool at its floor.
    plan.max_tokens_one_request = capacity.token_capacity
    plan.max_concurrency = capacity.max_concurrency
    for length in prompt_lens:
        at = pooled_capacity(pooled, length)
        plan.at_prompt_len[length] = {
            "max_concurrency": at.max_concurrency,
            "bytes_per_request": at.bytes_per_request,
        }
    return plan


def _graph_figures(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, upstream: bool
) -> dict[str, Any] | None:
    """The largest full CUDA graph against the states ``kv_cache_config``
    holds, as the engine sizes it (upstream: whether it refuses instead)."""
    from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig
    from vllm_hybrid.v1.worker.cudagraph_capacity import (
        full_graph_states,
        single_pool_graph_states,
    )

    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if (
        vllm_config.device_config.device_type != "cuda"
        or not mode.has_full_cudagraphs()
        or not kv_cache_config.has_mamba_layers
    ):
        return None
    measure = (
        full_graph_states
        if isinstance(kv_cache_config, PooledKVCacheConfig)
        else single_pool_graph_states
    )
    max_num_seqs = vllm_config.scheduler_config.max_num_seqs
    states = measure(
        kv_cache_config,
        mode,
        list(compilation.cudagraph_capture_sizes or []),
        max_num_seqs,
    )
    return {
        "max_num_seqs": max_num_seqs,
        "graph_rows": states.graph_rows,
        "states": states.max_states,
        "cap": None if upstream else states.row_cap,
        # vLLM 0.32's own check (end of resolve_cudagraph_mode_and_sizes)
        "refused": upstream and max_num_seqs > kv_cache_config.num_blocks,
    }


def _as_upstream(upstream_plan: ModePlan, reason: str) -> ModePlan:
    same = dataclasses.replace(upstream_plan, mode="pooled", same_as_upstream=True)
    same.note = f"pooled mode does not apply ({reason}): upstream plan"
    return same


def build_plan(
    request: PlanRequest, single_pool: bool = False, strict: bool = True
) -> Plan:
    """Compute both plans; raises :class:`PlanError` for bad input, and, if
    ``strict``, where neither mode can run.

    What ``config.json`` settles is checked before vLLM is imported. With
    ``single_pool`` the overlay's single pool is planned too
    (:func:`plan_single_pool`). The simulator plans with ``strict`` off and
    judges the modes of the engines it starts itself.
    """
    if request.device not in ("cuda", "cpu"):
        raise PlanError(f"--device must be cuda or cpu, got {request.device!r}")
    with model_dir(request.model) as (directory, preset):
        check_before_vllm(request, directory)
        request, config, notes, checkpoint = planned_config(request, directory)
        # the checkpoint's own architecture, even where a stand-in computes
        architecture = checkpoint or config.model_config.architecture
        kinds = layer_kinds(config)
        max_len = config.model_config.max_model_len
        lens = sorted({*request.prompt_lens, max_len})
        upstream_plan = plan_upstream(request, config, lens)
        pooled_plan = plan_pooled(request, config, lens, upstream_plan)
        single = plan_single_pool(request, config) if single_pool else None
    modes = {"upstream": upstream_plan, "pooled": pooled_plan}
    shortfall = length_shortfall(request, max_len, modes)
    if strict and upstream_plan.error and pooled_plan.error:
        raise PlanError(shortfall or pooled_plan.error)
    if shortfall is not None:
        notes.append(shortfall)
    if request.ignored_serve_flags:
        flags = ", ".join(request.ignored_serve_flags)
        notes.append(f"vllm serve flags that change nothing planned: {flags}")
    plan = Plan(
        model=request.model,
        architecture=str(architecture),
        preset=preset,
        device=request.device,
        kv_cache_dtype=request.kv_cache_dtype,
        tensor_parallel_size=request.tensor_parallel_size,
        kv_cache_memory=request.kv_cache_memory,
        max_model_len=max_len,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        prefix_caching=bool(config.cache_config.enable_prefix_caching),
        mamba_cache_mode=str(config.cache_config.mamba_cache_mode),
        hybrid=kinds.state > 0,
        attention_layers=kinds.attention,
        state_layers=kinds.state,
        prompt_lens=lens,
        notes=notes,
        upstream=upstream_plan,
        pooled=pooled_plan,
        serve_command=request.serve_command,
        single_pool=single,
    )
    length_errors(plan)
    return plan
