"""``vllm-hybrid plan``: KV cache plan of a model, offline, without weights.

Answers "will it fit, and what does pooled mode buy" before any download: the
attention block size vLLM 0.32 would pick, state page padding, block pools,
token capacity and concurrency, side by side for upstream's single shared
pool and for this project's pooled mode.

Everything is computed by vLLM's own code on configs alone: ``EngineArgs``
builds the ``VllmConfig`` from ``config.json``; the platform's block size
alignment (``update_block_size_for_backend`` with the attention backend the
chosen device would use), the model class's state shape and dtype methods,
the backend's ``customize_spec`` (TurboQuant packing) and
``vllm.v1.core.kv_cache_utils`` produce the upstream plan; this project's
``pooled_planner`` produces the pooled plan from the same layer specs at
natural sizes. No model is instantiated, so no GPU, no weights, seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_hybrid.tools.plan_presets import PRESETS, describe_presets

EXIT_BAD_INPUT = 2

#: Qwen3.5 classes live in a module that imports torchvision (for the vision
#: tower); where that import fails, Qwen3-Next's class stands in: its state
#: shape and dtype classmethods are the same formula over the same
#: ``hf_text_config`` fields.
STATE_SHAPE_STAND_INS = {
    "Qwen3_5ForCausalLM": "Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM": "Qwen3NextForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3NextForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3NextForCausalLM",
}
_STAND_IN_MODULE = "vllm.model_executor.models.qwen3_5"

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


class PlanError(ValueError):
    """Bad input or a plan that cannot exist; one line, exit code 2."""


def parse_size(text: str) -> int:
    """Bytes from ``48MiB``, ``10GiB``, ``1.5G`` (decimal), ``123`` (bytes)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (examples: 48MiB, 10GiB, 1.5G, 1048576)"
        )
    value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 bytes")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in (0, 1]")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def _prompt_lens(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of positive token counts"
        )
    return sorted(set(values))


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: one model, one device, one budget."""

    model: str
    kv_cache_memory: int
    device: str = "cuda"
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None
    #: None: vLLM's default for the model (on for these hybrids).
    prefix_caching: bool | None = None
    prompt_lens: tuple[int, ...] = (512, 2048, 8192)
    #: vLLM's ``--mamba-ssm-cache-dtype``; "auto" lets the model's hooks and
    #: the platform choose (the CPU platform forces float32 on AVX512-BF16
    #: hosts only), anything else is what vLLM then uses on every host.
    mamba_ssm_cache_dtype: str = "auto"


def kv_budget_from_gpu(
    gpu_memory_gib: float, utilization: float, weights_bytes: int, tp: int
) -> int:
    """Per-GPU KV bytes: ``gpu x utilization - weights / TP``.

    An estimate: activation peaks, CUDA graphs and the CUDA context, which
    vLLM measures at start-up, are not subtracted; ``--kv-cache-memory``
    (vLLM's ``--kv-cache-memory-bytes``) is exact.
    """
    budget = int(gpu_memory_gib * 2**30 * utilization) - weights_bytes // tp
    if budget <= 0:
        raise PlanError(
            f"--gpu-memory {gpu_memory_gib} GiB x --gpu-memory-utilization "
            f"{utilization} leaves no KV cache memory after --weights-memory "
            f"{weights_bytes / 2**30:.2f} GiB / TP {tp}"
        )
    return budget


# ---------------------------------------------------------------------------
# vLLM config without weights
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _model_dir(model: str) -> Iterator[tuple[Path, str | None]]:
    """A directory with ``config.json`` for ``model``, and the preset name."""
    preset = PRESETS.get(model)
    if preset is not None:
        with tempfile.TemporaryDirectory(prefix="vllm-hybrid-plan-") as tmp:
            yield preset.write_config(Path(tmp)), preset.name
        return
    path = Path(model)
    if path.is_file() and path.name.endswith(".json"):
        with tempfile.TemporaryDirectory(prefix="vllm-hybrid-plan-") as tmp:
            target = Path(tmp) / "config.json"
            target.write_bytes(path.read_bytes())
            yield Path(tmp), None
        return
    if path.is_dir() and (path / "config.json").is_file():
        yield path, None
        return
    raise PlanError(
        f"{model!r} is neither a built-in preset ({', '.join(PRESETS)}) nor a "
        "directory or file with a Hugging Face config.json"
    )


def _architecture(model_dir: Path) -> str | None:
    try:
        data = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc
    architectures = data.get("architectures") or [None]
    return architectures[0]


def _stand_in(architecture: str | None) -> str | None:
    """A state-shape stand-in when the real model class cannot be imported."""
    if architecture not in STATE_SHAPE_STAND_INS:
        return None
    try:
        __import__(_STAND_IN_MODULE)
    except ImportError:
        return STATE_SHAPE_STAND_INS[architecture]
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    # pydantic wraps the interesting line: "Value error, <message> [type=...".
    match = re.search(r"Value error, (.*?)(?: \[type=|$)", text, re.S)
    if match:
        text = match.group(1)
    return " ".join(text.split())[:400] or type(exc).__name__


def engine_config(request: PlanRequest, model_dir: Path) -> tuple[Any, list[str]]:
    """vLLM's ``VllmConfig`` for the request on this host, and notes."""
    from vllm.engine.arg_utils import EngineArgs

    notes: list[str] = []
    architecture = _architecture(model_dir)
    overrides: dict[str, Any] = {}
    stand_in = _stand_in(architecture)
    if stand_in is not None:
        overrides["architectures"] = [stand_in]
        notes.append(
            f"{architecture}'s module needs torchvision here; state shapes come "
            f"from {stand_in} (same classmethod formula)"
        )
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        skip_tokenizer_init=True,
        tensor_parallel_size=request.tensor_parallel_size,
        kv_cache_dtype=request.kv_cache_dtype,
        kv_cache_memory_bytes=request.kv_cache_memory,
        mamba_ssm_cache_dtype=request.mamba_ssm_cache_dtype,
        hf_overrides=overrides,
    )
    optional = {
        "max_model_len": request.max_model_len,
        "max_num_seqs": request.max_num_seqs,
        "block_size": request.block_size,
        "enable_prefix_caching": request.prefix_caching,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    try:
        config = EngineArgs(**kwargs).create_engine_config()
    except Exception as exc:  # vLLM raises many types for bad configs
        raise PlanError(f"vLLM rejects this configuration: {_first_line(exc)}") from exc
    if stand_in is not None:
        _apply_qwen3_5_ssm_dtype(config)
    return config, notes


def _apply_qwen3_5_ssm_dtype(vllm_config: Any) -> None:
    """Run Qwen3.5's own config hook, which the stand-in architecture skips."""
    from vllm.model_executor.models.config import (
        Qwen3_5ForConditionalGenerationConfig,
    )

    Qwen3_5ForConditionalGenerationConfig.verify_and_update_config(vllm_config)


def as_cuda_config(vllm_config: Any, request: PlanRequest) -> Any:
    """The config a CUDA host would hold after vLLM's config hooks.

    On this host vLLM ran the CPU platform's ``check_and_update_config``
    (block 128, SSM state forced to fp32, no CUDA graphs). A CUDA host keeps
    ``CacheConfig.DEFAULT_BLOCK_SIZE`` (or ``--block-size``) and the SSM
    dtype asked for (or, for "auto", whatever the model's own hook picks),
    so those are reset and the model hooks run again on a copy.
    """
    from vllm.config.cache import CacheConfig

    config = copy.deepcopy(vllm_config)
    cache = config.cache_config
    cache.block_size = request.block_size or CacheConfig.DEFAULT_BLOCK_SIZE
    cache.mamba_ssm_cache_dtype = request.mamba_ssm_cache_dtype
    cache.mamba_block_size = None
    cache.mamba_page_size_padded = None
    config.model_config.config_updated = False
    config.try_verify_and_update_config()
    return config


# ---------------------------------------------------------------------------
# Layer specs, as the workers would report them
# ---------------------------------------------------------------------------


def _kv_torch_dtype(vllm_config: Any) -> Any:
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype == "auto":
        return vllm_config.model_config.dtype
    return STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]


def attention_backend(request: PlanRequest, *, pooled: bool) -> type:
    """The attention backend class the device would use for these layers.

    CUDA: FlashAttention (vLLM's first choice below Blackwell) or TurboQuant
    for ``turboquant_*`` KV dtypes. CPU: ``CPU_ATTN``, the only decoder
    backend vLLM 0.32 has there; in pooled mode TurboQuant KV dtypes are
    planned with TurboQuant's packed slot (this project's CPU backend).
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    turboquant = request.kv_cache_dtype.startswith("turboquant_")
    if turboquant and (request.device == "cuda" or pooled):
        return AttentionBackendEnum.TURBOQUANT.get_class()
    if request.device == "cuda":
        return AttentionBackendEnum.FLASH_ATTN.get_class()
    return AttentionBackendEnum.CPU_ATTN.get_class()


@dataclass(frozen=True)
class LayerKinds:
    attention: int
    state: int


def layer_kinds(vllm_config: Any) -> LayerKinds:
    """Attention and state layer counts of this rank's model."""
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if model_config.use_mla:
        raise PlanError("MLA attention models are not modelled by plan yet")
    types = getattr(model_config.hf_text_config, "layer_types", None) or []
    if any("sliding" in str(t) for t in types):
        raise PlanError("sliding-window attention layers are not modelled by plan")
    if model_config.is_attention_free:
        raise PlanError(
            f"{model_config.architecture} has no attention layers; plan covers "
            "hybrid (attention + state) and dense attention models"
        )
    total = model_config.get_num_layers(parallel)
    attention = model_config.get_num_layers_by_block_type(parallel, "attention")
    if not model_config.is_hybrid:
        return LayerKinds(attention, 0)
    state = sum(
        model_config.get_num_layers_by_block_type(parallel, kind)
        for kind in ("mamba", "linear_attention")
    )
    if attention <= 0 or state <= 0 or attention + state > total:
        raise PlanError(
            f"cannot tell the attention and state layers of "
            f"{model_config.architecture} apart from its config"
        )
    return LayerKinds(attention, state)


def layer_specs(vllm_config: Any, backend: type) -> dict[str, Any]:
    """``{layer name: KVCacheSpec}`` as the model's layers would build them."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        get_kv_quant_mode,
    )

    model_config = vllm_config.model_config
    cache = vllm_config.cache_config
    kinds = layer_kinds(vllm_config)
    attn = backend.customize_spec(
        FullAttentionSpec(
            block_size=cache.block_size,
            num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
            head_size=model_config.get_head_size(),
            dtype=_kv_torch_dtype(vllm_config),
            kv_quant_mode=get_kv_quant_mode(cache.cache_dtype),
        )
    )
    specs: dict[str, Any] = {
        f"model.layers.{i}.self_attn.attn": attn for i in range(kinds.attention)
    }
    if kinds.state:
        model_cls, _ = ModelRegistry.resolve_model_cls(
            model_config.architecture, model_config=model_config
        )
        state = MambaSpec(
            shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
            dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(vllm_config)),
            block_size=cache.mamba_block_size,
            page_size_padded=cache.mamba_page_size_padded,
            mamba_cache_mode=cache.mamba_cache_mode,
            num_speculative_blocks=0,
        )
        for j in range(kinds.state):
            specs[f"model.layers.{kinds.attention + j}.mixer"] = state
    return specs


def resolve_layout(vllm_config: Any, backend: type, specs: dict[str, Any]) -> None:
    """Resolve the KV cache layout as the engine core does before planning."""
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    names = [layout.name for layout in get_supported_kv_cache_layouts([backend])]
    layout = resolve_kv_cache_layout(vllm_config, [names], list(specs.values()))
    vllm_config.cache_config.kv_cache_layout = layout.name


def _platform_class(device: str, backend: type, align: Any) -> type:
    """vLLM's platform class for ``device`` with the backend fixed.

    ``_find_non_ssm_backends`` normally reads the instantiated attention
    layers; with no model, it returns the backend this device would pick.
    ``align`` is upstream's ``_align_hybrid_block_size`` or this project's.
    """
    if device == "cpu":
        from vllm.platforms.cpu import CpuPlatform as base
    else:
        # CUDA does not override the block size methods of Platform, and
        # importing CudaPlatform on a host without CUDA is not safe.
        from vllm.platforms.interface import Platform as base

    def find(cls, vllm_config):
        return [backend]

    return type(
        f"Plan{base.__name__}",
        (base,),
        {
            "_find_non_ssm_backends": classmethod(find),
            "_align_hybrid_block_size": align,
        },
    )


def _upstream_align() -> Any:
    from vllm_hybrid.patches.registry import upstream
    from vllm_hybrid.platforms.hybrid_block_size import TARGET

    return upstream(TARGET)


@contextlib.contextmanager
def overlay_off() -> Iterator[None]:
    """Revert this project's patches for the duration (restore them after).

    Upstream's planner functions call each other through module globals, so
    exact upstream figures need the upstream functions in place.
    """
    from vllm_hybrid import plugin

    state = plugin.state()
    was_active = state is not None and state.active
    if was_active:
        plugin.deactivate()
    try:
        yield
    finally:
        if was_active:
            plugin.register()


# ---------------------------------------------------------------------------
# The two plans
# ---------------------------------------------------------------------------


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
    #: Longest sequence one request can hold (issue 4's honest figure).
    max_tokens_one_request: int | None = None
    max_concurrency: float | None = None
    #: prompt length -> {"max_concurrency": x, "bytes_per_request": n}
    at_prompt_len: dict[int, dict[str, float]] = field(default_factory=dict)


def _group_rows(kv_cache_config: Any) -> list[dict[str, Any]]:
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


def _with_len(vllm_config: Any, length: int) -> Any:
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


def plan_upstream(
    request: PlanRequest, vllm_config: Any, prompt_lens: Sequence[int]
) -> ModePlan:
    """vLLM 0.32's single shared pool, as its engine would start."""
    import vllm.v1.core.kv_cache_utils as kvu

    from vllm_hybrid.v1.core.kv_cache_utils import kv_cache_token_capacity

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
        _platform_class(
            request.device, backend, _upstream_align()
        ).update_block_size_for_backend(config)
        specs = layer_specs(config, backend)
        resolve_layout(config, backend, specs)
        try:
            worker = kvu.get_kv_cache_configs(
                config, [specs], [request.kv_cache_memory]
            )
        except ValueError as exc:
            plan.error = _first_line(exc)
            return plan
        scheduler = kvu.generate_scheduler_kv_cache_config(worker)
        tokens, concurrency = kvu.get_kv_cache_capacity(config, scheduler)
    _fill_state_padding(plan, specs)
    plan.groups = _group_rows(scheduler)
    plan.num_blocks = scheduler.num_blocks
    block_bytes = sum(t.size for t in worker[0].kv_cache_tensors) // max(
        1, worker[0].num_blocks
    )
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
        blocks = sum(
            math.ceil(
                g.kv_cache_spec.max_memory_usage_bytes(at)
                / g.kv_cache_spec.page_size_bytes
            )
            for g in scheduler.kv_cache_groups
        )
        plan.at_prompt_len[length] = {
            "max_concurrency": kvu.get_max_concurrency_for_kv_cache_config(
                at, scheduler
            ),
            "bytes_per_request": blocks * block_bytes,
        }
    return plan


def plan_pooled(
    request: PlanRequest,
    vllm_config: Any,
    prompt_lens: Sequence[int],
    upstream_plan: ModePlan,
) -> ModePlan:
    """This project's pooled mode (upstream's plan where it does not apply)."""
    from vllm_hybrid.platforms.hybrid_block_size import align_hybrid_block_size
    from vllm_hybrid.v1.core.pooled_config import pooled_mode_decision
    from vllm_hybrid.v1.core.pooled_planner import (
        PooledBudget,
        PooledPlanError,
        max_token_blocks,
        plan_pooled_kv_cache,
        pooled_capacity,
        split_layers,
    )

    config = copy.deepcopy(vllm_config)
    decision = pooled_mode_decision(config)
    if not decision.enabled:
        same = dataclasses.replace(upstream_plan, mode="pooled")
        same.note = f"pooled mode does not apply ({decision.reason}): upstream plan"
        return same
    backend = attention_backend(request, pooled=True)
    _platform_class(
        request.device, backend, align_hybrid_block_size
    ).update_block_size_for_backend(config)
    specs = layer_specs(config, backend)
    resolve_layout(config, backend, specs)
    split = split_layers(specs)
    if split.token is None or split.state is None:
        same = dataclasses.replace(upstream_plan, mode="pooled")
        same.note = f"pooled mode does not apply ({split.reason}): upstream plan"
        return same
    budget = PooledBudget(
        arena_bytes=request.kv_cache_memory,
        max_model_len=config.model_config.max_model_len,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        # CPU: no kernel writes through null ids; CUDA: CUDA graphs (default).
        null_blocks_overlap=request.device == "cpu",
    )
    plan = ModePlan("pooled")
    try:
        pooled = plan_pooled_kv_cache(split, budget)
    except PooledPlanError as exc:
        plan.error = _first_line(exc)
        return plan
    _fill_state_padding(plan, specs)
    plan.groups = _group_rows(pooled)
    token = pooled.pool_by_kind("token")
    state = pooled.pool_by_kind("state")
    plan.pools = [
        {"kind": p.kind, "num_blocks": p.num_blocks, "block_bytes": p.block_bytes}
        for p in (token, state)
    ]
    plan.num_blocks = pooled.num_blocks
    capacity = pooled_capacity(pooled, budget.max_model_len)
    plan.token_capacity = capacity.token_capacity
    plan.max_tokens_one_request = max_token_blocks(pooled.layout) * (
        split.token.spec.block_size
    )
    plan.max_concurrency = capacity.max_concurrency
    block_size = split.token.spec.block_size
    for length in prompt_lens:
        plan.at_prompt_len[length] = {
            "max_concurrency": pooled_capacity(pooled, length).max_concurrency,
            "bytes_per_request": math.ceil(length / block_size) * token.block_bytes
            + pooled.state_blocks_per_request * state.block_bytes,
        }
    return plan


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
    prefix_caching: bool
    mamba_cache_mode: str
    hybrid: bool
    attention_layers: int
    state_layers: int
    prompt_lens: list[int]
    notes: list[str]
    upstream: ModePlan
    pooled: ModePlan

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for mode in ("upstream", "pooled"):
            data[mode]["at_prompt_len"] = {
                str(k): v for k, v in data[mode]["at_prompt_len"].items()
            }
        return data


def build_plan(request: PlanRequest) -> Plan:
    """Compute both plans; raises :class:`PlanError` for bad input."""
    if request.device not in ("cuda", "cpu"):
        raise PlanError(f"--device must be cuda or cpu, got {request.device!r}")
    with _model_dir(request.model) as (model_dir, preset):
        config, notes = engine_config(request, model_dir)
        # the checkpoint's own architecture, even where a stand-in computes
        architecture = _architecture(model_dir) or _architecture_of(config)
        if request.device == "cuda":
            config = as_cuda_config(config, request)
        kinds = layer_kinds(config)
        max_len = config.model_config.max_model_len
        lens = sorted({*request.prompt_lens, max_len})
        upstream_plan = plan_upstream(request, config, lens)
        pooled_plan = plan_pooled(request, config, lens, upstream_plan)
    if upstream_plan.error and pooled_plan.error:
        raise PlanError(
            f"the KV cache budget cannot hold one request: {pooled_plan.error}"
        )
    return Plan(
        model=request.model,
        architecture=str(architecture),
        preset=preset,
        device=request.device,
        kv_cache_dtype=request.kv_cache_dtype,
        tensor_parallel_size=request.tensor_parallel_size,
        kv_cache_memory=request.kv_cache_memory,
        max_model_len=max_len,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        prefix_caching=bool(config.cache_config.enable_prefix_caching),
        mamba_cache_mode=str(config.cache_config.mamba_cache_mode),
        hybrid=kinds.state > 0,
        attention_layers=kinds.attention,
        state_layers=kinds.state,
        prompt_lens=lens,
        notes=notes,
        upstream=upstream_plan,
        pooled=pooled_plan,
    )


def _architecture_of(vllm_config: Any) -> str:
    return vllm_config.model_config.architecture


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.2f} MiB"


def _groups_text(plan: ModePlan) -> str:
    if not plan.groups:
        return "-"
    counts: dict[tuple[str, int], int] = {}
    for g in plan.groups:
        key = (g["kind"], g["layers"])
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(
        f"{n} {kind} x {layers} layers" for (kind, layers), n in counts.items()
    )


def _pools_text(plan: ModePlan) -> str:
    return "; ".join(
        f"{p['kind']} {p['num_blocks']:,} x {p['block_bytes']:,} B" for p in plan.pools
    )


def _padding_text(plan: ModePlan) -> str:
    if plan.state_padding_bytes is None:
        return "-"
    return f"{plan.state_padding_bytes:,} B ({plan.state_padding_pct:.2f}%)"


def _rows(plan: Plan) -> list[tuple[str, str, str]]:
    up, po = plan.upstream, plan.pooled

    def both(fn) -> tuple[str, str]:
        return tuple(  # type: ignore[return-value]
            (f"not possible: {m.error}" if m.error else fn(m)) for m in (up, po)
        )

    def opt(value, fmt="{:,}") -> str:
        return "-" if value is None else fmt.format(value)

    rows = [
        ("KV cache groups", *both(_groups_text)),
        ("attention block (tokens)", *both(lambda m: opt(m.attention_block_size))),
        ("attention page", *both(lambda m: opt(m.attention_page_bytes, "{:,} B"))),
        ("state page", *both(lambda m: opt(m.state_page_bytes, "{:,} B"))),
        ("state padding", *both(_padding_text)),
        ("pools (blocks x bytes)", *both(_pools_text)),
        ("token capacity (logged)", *both(lambda m: opt(m.token_capacity))),
        (
            "longest single request",
            *both(lambda m: opt(m.max_tokens_one_request)),
        ),
        (
            f"max concurrency @ {plan.max_model_len:,}",
            *both(lambda m: opt(m.max_concurrency, "{:.2f}x")),
        ),
    ]
    for length in plan.prompt_lens:
        rows.append(
            (
                f"concurrency @ {length:,} tokens",
                *both(
                    lambda m, n=length: (
                        f"{m.at_prompt_len[n]['max_concurrency']:.2f}x "
                        f"({_mib(m.at_prompt_len[n]['bytes_per_request'])}/req)"
                    )
                ),
            )
        )
    return rows


def render_table(plan: Plan) -> str:
    """The human-readable plan."""
    name = plan.preset or plan.model
    head = (
        f"{name} ({plan.architecture}, {plan.attention_layers} attention + "
        f"{plan.state_layers} state layers) on {plan.device}, TP "
        f"{plan.tensor_parallel_size}, kv_cache_dtype {plan.kv_cache_dtype}, "
        f"KV budget {_mib(plan.kv_cache_memory)} per GPU, max_model_len "
        f"{plan.max_model_len:,}, max_num_seqs {plan.max_num_seqs}, prefix "
        f"caching {'on' if plan.prefix_caching else 'off'}"
        + (f" (mamba_cache_mode {plan.mamba_cache_mode})" if plan.hybrid else "")
    )
    rows = [("", "upstream vLLM 0.32", "vllm-hybrid pooled"), *_rows(plan)]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [head, ""]
    for i, row in enumerate(rows):
        lines.append(
            "  ".join(
                cell.ljust(w) for cell, w in zip(row, widths, strict=True)
            ).rstrip()
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    for note in (*plan.notes, plan.upstream.note, plan.pooled.note):
        if note:
            lines.append(f"note: {note}")
    return "\n".join(lines)


def plot_concurrency(plan: Plan, request: PlanRequest, path: Path) -> None:
    """PNG of max concurrency against prompt length, both modes."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlanError(
            "--plot needs matplotlib: pip install vllm-hybrid[plot]"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in (plan.upstream, plan.pooled):
        if mode.error:
            continue
        lens = sorted(mode.at_prompt_len)
        ax.plot(
            lens,
            [mode.at_prompt_len[n]["max_concurrency"] for n in lens],
            marker="o",
            label="upstream vLLM 0.32" if mode.mode == "upstream" else "pooled mode",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per request")
    ax.set_ylabel("max concurrent requests")
    ax.set_title(
        f"{plan.preset or Path(plan.model).name}: {plan.device}, TP "
        f"{plan.tensor_parallel_size}, {plan.kv_cache_dtype}, "
        f"{plan.kv_cache_memory / 2**30:.2f} GiB KV"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors and exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"vllm-hybrid plan: error: {message}\n")


EPILOG = """\
Memory: --kv-cache-memory is the exact KV budget per GPU (vLLM's
--kv-cache-memory-bytes). Otherwise the budget is estimated as
--gpu-memory x --gpu-memory-utilization - --weights-memory / TP (activations,
CUDA graphs and the CUDA context are not subtracted).
SIZE accepts 48MiB, 10GiB, 1.5G (decimal), 1048576 (bytes).

Models: hybrid models (attention + Mamba/Mamba2/gated DeltaNet layers) get
both plans; dense attention models are planned as controls (pooled mode does
not apply, both columns agree). MLA, sliding-window and attention-free
models, and architectures vLLM does not know, are rejected (exit 2).

Devices: cuda models FlashAttention (TurboQuant for turboquant_* dtypes),
16-token default block, CUDA graphs on; cpu models CPU_ATTN, 128-token
default block and this host's SSM state dtype, exactly as the CPU engine.
Exit codes: 0 plan printed; 2 bad input or no request fits either plan.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="vllm-hybrid plan",
        description=(
            "KV cache plan of a hybrid model for vLLM 0.32 and for vllm-hybrid's "
            "pooled mode: block size, state padding, pools, token capacity, "
            "concurrency. Offline: reads config.json only, no weights, no GPU."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="local directory or file with a Hugging Face config.json, or a "
        "built-in preset (see --list-presets)",
    )
    parser.add_argument(
        "--list-presets",
        action="store_true",
        help="list the built-in presets and the checkpoint each stands for",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="KV cache dtype as for vllm serve (auto, fp8, turboquant_k8v4, ...)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=_positive_int,
        default=1,
        metavar="N",
        help="tensor parallel size; figures are per GPU (default 1)",
    )
    memory = parser.add_argument_group("KV cache memory (one of)")
    memory.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        metavar="SIZE",
        help="exact KV cache budget per GPU",
    )
    memory.add_argument(
        "--gpu-memory",
        type=_positive_float,
        metavar="GiB",
        help="GPU memory in GiB (with --gpu-memory-utilization, --weights-memory)",
    )
    memory.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=0.9,
        metavar="F",
        help="fraction of --gpu-memory vLLM may use (default 0.9)",
    )
    memory.add_argument(
        "--weights-memory",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="weights of the whole model, split evenly over TP ranks "
        "(required with --gpu-memory)",
    )
    parser.add_argument(
        "--max-model-len",
        type=_positive_int,
        metavar="N",
        help="maximum sequence length (default: the model's)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        metavar="N",
        help="maximum concurrent sequences (default: vLLM's)",
    )
    parser.add_argument(
        "--block-size",
        type=_positive_int,
        metavar="N",
        help="attention block size as for vllm serve (upstream may still "
        "inflate it for hybrid models; pooled mode keeps it)",
    )
    parser.add_argument(
        "--mamba-ssm-cache-dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="SSM state dtype as for vllm serve (default auto: the model's "
        "choice; vLLM's CPU platform forces float32 on AVX512-BF16 hosts)",
    )
    parser.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefix caching on/off (default: vLLM's, on)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="device to plan for (default cuda)",
    )
    parser.add_argument(
        "--prompt-lens",
        type=_prompt_lens,
        default=[512, 2048, 8192],
        metavar="N,N,...",
        help="token counts for the concurrency and bytes-per-request rows "
        "(default 512,2048,8192; max_model_len is always added)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead")
    parser.add_argument(
        "--plot",
        type=Path,
        metavar="OUT.png",
        help="write a PNG of concurrency against prompt length "
        "(needs matplotlib: pip install vllm-hybrid[plot])",
    )
    return parser


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    if args.model is None:
        raise PlanError("MODEL is required (a directory, config.json or preset)")
    if args.kv_cache_memory is not None:
        if args.gpu_memory is not None:
            raise PlanError("give --kv-cache-memory or --gpu-memory, not both")
        budget = args.kv_cache_memory
    elif args.gpu_memory is not None:
        if args.weights_memory is None:
            raise PlanError("--gpu-memory needs --weights-memory SIZE")
        budget = kv_budget_from_gpu(
            args.gpu_memory,
            args.gpu_memory_utilization,
            args.weights_memory,
            args.tensor_parallel_size,
        )
    else:
        raise PlanError("give --kv-cache-memory SIZE or --gpu-memory GiB")
    return PlanRequest(
        model=args.model,
        kv_cache_memory=budget,
        device=args.device,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        prefix_caching=args.prefix_caching,
        prompt_lens=tuple(args.prompt_lens),
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
    )


_QUIET_VLLM_LOGS = {
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}


@contextlib.contextmanager
def _quiet_vllm_logs() -> Iterator[None]:
    """Keep vLLM's INFO lines off stdout (the plan, or JSON, goes there).

    vLLM reads these variables when it configures logging (at import in a
    fresh ``vllm-hybrid plan`` process). They are restored afterwards, so a
    caller's process (tests run ``main`` in-process) keeps its own settings.
    """
    saved = {name: os.environ.get(name) for name in _QUIET_VLLM_LOGS}
    for name, value in _QUIET_VLLM_LOGS.items():
        os.environ.setdefault(name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_presets:
        print(describe_presets())
        return 0
    try:
        request = request_from_args(args)
        with _quiet_vllm_logs():
            plan = build_plan(request)
        if args.plot is not None:
            plot_concurrency(plan, request, args.plot)
    except PlanError as exc:
        print(f"vllm-hybrid plan: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(render_table(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
