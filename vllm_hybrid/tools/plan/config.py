"""vLLM's view of the model without weights: config, platform, layer specs.

``EngineArgs`` builds the ``VllmConfig`` on this host (CPU platform hooks
included); :func:`as_cuda_config` turns it into what a CUDA host would hold.
A stand-in platform class fixes the attention backend the chosen device
would use, and :func:`layer_specs` builds the ``KVCacheSpec`` of every layer
as the model's layers would report them. Where a model class cannot be
imported here, a class with the same state-shape formula stands in, and the
checkpoint's own config hook still runs.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_hybrid.tools.plan.errors import PlanError
from vllm_hybrid.tools.plan.messages import error_text
from vllm_hybrid.tools.plan.request import PlanRequest, checkpoint_architecture

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

#: Qwen3.5 classes live in a module that imports torchvision (for the vision
#: tower); where that import fails, Qwen3-Next's class stands in: its state
#: shape and dtype classmethods are the same formula over the same
#: ``hf_text_config`` fields. The stand-ins have no config hook of their own.
STATE_SHAPE_STAND_INS = {
    "Qwen3_5ForCausalLM": "Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM": "Qwen3NextForCausalLM",
    "Qwen3_5ForConditionalGeneration": "Qwen3NextForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3NextForCausalLM",
}
_STAND_IN_MODULE = "vllm.model_executor.models.qwen3_5"


def stand_in(architecture: str | None) -> str | None:
    """A state-shape stand-in when the real model class cannot be imported."""
    if architecture not in STATE_SHAPE_STAND_INS:
        return None
    try:
        __import__(_STAND_IN_MODULE)
    except ImportError:
        return STATE_SHAPE_STAND_INS[architecture]
    return None


@contextlib.contextmanager
def checkpoint_hooks(
    architecture: str | None, computed_as: str | None
) -> Iterator[None]:
    """Let vLLM run ``architecture``'s config hook for its stand-in.

    vLLM picks a model's config hook (``verify_and_update_config``: SSM
    state dtype, mamba cache mode) by ``model_config.architecture``, which is
    the stand-in's name here. For the duration, the stand-in's name maps to
    the checkpoint's hook, so the hook runs where vLLM runs it: before the
    platform's ``check_and_update_config``. Restored afterwards.
    """
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    hook = MODELS_CONFIG_MAP.get(architecture) if architecture else None
    if hook is None or computed_as is None or computed_as == architecture:
        yield
        return
    missing = object()
    saved = MODELS_CONFIG_MAP.get(computed_as, missing)
    MODELS_CONFIG_MAP[computed_as] = hook
    try:
        yield
    finally:
        if saved is missing:
            del MODELS_CONFIG_MAP[computed_as]
        else:
            MODELS_CONFIG_MAP[computed_as] = saved


def engine_config(
    request: PlanRequest, directory: Path
) -> tuple[VllmConfig, list[str]]:
    """vLLM's ``VllmConfig`` for the request on this host, and notes."""
    from vllm.engine.arg_utils import EngineArgs

    notes: list[str] = []
    architecture = checkpoint_architecture(directory)
    overrides: dict[str, Any] = {}
    substitute = stand_in(architecture)
    if substitute is not None:
        overrides["architectures"] = [substitute]
        notes.append(
            f"{architecture}'s module needs torchvision here; state shapes come "
            f"from {substitute} (same classmethod formula)"
        )
    kwargs: dict[str, Any] = dict(
        model=str(directory),
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
        "max_num_batched_tokens": request.max_num_batched_tokens,
        "block_size": request.block_size,
        "enable_prefix_caching": request.prefix_caching,
        "mamba_cache_mode": request.mamba_cache_mode,
        "mamba_block_size": request.mamba_block_size,
        "additional_config": request.additional_config,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    try:
        with checkpoint_hooks(architecture, substitute):
            config = EngineArgs(**kwargs).create_engine_config()
    except Exception as exc:  # vLLM raises many types for bad configs
        raise PlanError(
            f"vLLM rejects this configuration: {error_text(exc, request)}"
        ) from exc
    return config, notes


def as_cuda_config(
    vllm_config: VllmConfig, request: PlanRequest, architecture: str | None = None
) -> VllmConfig:
    """The config a CUDA host would hold after vLLM's config hooks.

    On this host vLLM ran the CPU platform's ``check_and_update_config``
    (block 128, SSM state forced to fp32, no CUDA graphs). A CUDA host keeps
    ``CacheConfig.DEFAULT_BLOCK_SIZE`` (or ``--block-size``), the SSM dtype
    asked for (or, for "auto", whatever the model's own hook picks) and the
    CUDA graph mode of the optimization level, so those are reset and the
    model hooks, the checkpoint ``architecture``'s included where a class
    stands in for it, run again on a copy.
    """
    from vllm.config.cache import CacheConfig
    from vllm.config.compilation import CompilationMode
    from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG

    config = copy.deepcopy(vllm_config)
    cache = config.cache_config
    cache.block_size = request.block_size or CacheConfig.DEFAULT_BLOCK_SIZE
    cache.mamba_ssm_cache_dtype = request.mamba_ssm_cache_dtype
    cache.mamba_block_size = request.mamba_block_size
    cache.mamba_page_size_padded = None
    level = OPTIMIZATION_LEVEL_TO_CONFIG[config.optimization_level]
    compilation = config.compilation_config
    compilation.cudagraph_mode = level["compilation_config"]["cudagraph_mode"]
    if compilation.cudagraph_mode.requires_piecewise_compilation():
        # vLLM's compilation on CUDA, whose piecewise graphs split at the
        # attention and state ops (the CPU platform compiles without splits)
        compilation.mode = CompilationMode.VLLM_COMPILE
        compilation.splitting_ops = None
        compilation.set_splitting_ops_for_v1(
            config.parallel_config.all2all_backend,
            config.parallel_config.data_parallel_size,
        )
    config.model_config.config_updated = False
    with checkpoint_hooks(architecture, config.model_config.architecture):
        config.try_verify_and_update_config()
    # what the engine's capacity line names the device by
    config.device_config.device_type = "cuda"
    return config


# ---------------------------------------------------------------------------
# Layer specs, as the workers would report them
# ---------------------------------------------------------------------------


def kv_torch_dtype(vllm_config: VllmConfig) -> torch.dtype:
    """The torch dtype of the attention KV cache."""
    from vllm_hybrid.v1.worker.pooled_views import kv_cache_torch_dtype

    return kv_cache_torch_dtype(vllm_config)


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


def layer_kinds(vllm_config: VllmConfig) -> LayerKinds:
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
    if attention <= 0:
        attention, state = _kinds_from_type_list(vllm_config) or (attention, state)
    if attention <= 0 or state <= 0 or attention + state > total:
        raise PlanError(
            f"cannot tell the attention and state layers of "
            f"{model_config.architecture} apart from its config"
        )
    return LayerKinds(attention, state)


#: Layer type names of the two kinds, in both the names configs were written
#: with (Jamba, Granite 4, Nemotron-H patterns) and the ones transformers 5
#: rewrites them to.
_ATTENTION_TYPES = frozenset({"attention", "full_attention"})
_STATE_TYPES = frozenset({"mamba", "linear_attention"})


def _kinds_from_type_list(vllm_config: VllmConfig) -> tuple[int, int] | None:
    """Attention and state layers of this rank from the config's layer type
    list, or None without one.

    vLLM 0.32 counts a ``layers_block_type`` list by the names "attention"
    and "mamba", but transformers 5 loads Nemotron-H and Granite 4 configs
    with the names "full_attention" and "linear_attention", so vLLM counts no
    attention layer there; its model classes build their layers from the
    same list and run fine.
    """
    text = vllm_config.model_config.hf_text_config
    types = getattr(text, "layers_block_type", None) or getattr(
        text, "layer_types", None
    )
    if not types:
        return None
    start, end = vllm_config.model_config.get_layers_start_end_indices(
        vllm_config.parallel_config
    )
    own = [str(t) for t in types[start:end]]
    return (
        sum(t in _ATTENTION_TYPES for t in own),
        sum(t in _STATE_TYPES for t in own),
    )


def layer_specs(vllm_config: VllmConfig, backend: type) -> dict[str, Any]:
    """``{layer name: KVCacheSpec}`` as the model's layers would build them."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.worker.utils import customize_attention_spec

    from vllm_hybrid.v1.worker.pooled_views import attention_spec_of

    model_config = vllm_config.model_config
    cache = vllm_config.cache_config
    kinds = layer_kinds(vllm_config)
    # the model runner's own step from a layer's spec to the one it reports
    attn = customize_attention_spec(backend, attention_spec_of(vllm_config))
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
            **_state_backend(vllm_config),
        )
        for j in range(kinds.state):
            specs[f"model.layers.{kinds.attention + j}.mixer"] = state
    return specs


def _state_backend(vllm_config: VllmConfig) -> dict[str, Any]:
    """The ``mamba_type`` a state layer would put in its spec, where the
    config tells: gated DeltaNet (Qwen3-Next, Qwen3.5/3.6) has linear
    attention heads; others keep the spec's default."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    text = vllm_config.model_config.hf_text_config
    if getattr(text, "linear_num_value_heads", None):
        return {"mamba_type": MambaAttentionBackendEnum.GDN_ATTN}
    return {}


def resolve_layout(
    vllm_config: VllmConfig, backend: type, specs: dict[str, Any]
) -> None:
    """Resolve the KV cache layout as the engine core does before planning."""
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    names = [layout.name for layout in get_supported_kv_cache_layouts([backend])]
    layout = resolve_kv_cache_layout(vllm_config, [names], list(specs.values()))
    vllm_config.cache_config.kv_cache_layout = layout.name


# ---------------------------------------------------------------------------
# The device's platform, without the device
# ---------------------------------------------------------------------------


def platform_class(device: str, backend: type, align: Any) -> type:
    """vLLM's platform class for ``device`` with the backend fixed.

    ``_find_non_ssm_backends`` normally reads the instantiated attention
    layers; with no model, it returns the backend this device would pick.
    ``align`` is upstream's ``_align_hybrid_block_size`` or this project's.
    """
    from vllm.platforms.interface import PlatformEnum

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
            "_enum": PlatformEnum.CPU if device == "cpu" else PlatformEnum.CUDA,
            "_find_non_ssm_backends": classmethod(find),
            "_align_hybrid_block_size": align,
        },
    )


@contextlib.contextmanager
def current_platform_as(platform: Any) -> Iterator[None]:
    """``vllm.platforms.current_platform`` is ``platform`` for the duration.

    Only for engine functions that ask the platform a question about the
    device planned for (such as whether CUDA graphs can run); restored after.
    """
    import vllm.platforms as platforms

    saved = platforms._current_platform
    platforms._current_platform = platform
    try:
        yield
    finally:
        platforms._current_platform = saved


def upstream_align() -> Any:
    """Upstream's ``Platform._align_hybrid_block_size``, patched or not."""
    from vllm_hybrid.patches.registry import upstream_of

    return upstream_of(
        "vllm_hybrid.platforms.hybrid_block_size", "align_hybrid_block_size"
    )


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
