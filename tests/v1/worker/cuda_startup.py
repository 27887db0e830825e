"""The CUDA start-up path of a pooled engine, run on a host without a GPU.

A Qwen3.6-35B-A3B-FP8-shaped checkpoint (``config.json`` only) goes through
what a CUDA host runs, step by step, with vLLM's and the overlay's own
functions:

* config: ``EngineArgs`` and the CUDA config hooks (``vllm-hybrid plan``'s
  :func:`as_cuda_config`);
* worker, after model load: the platform's block size alignment (the plan
  tool's CUDA stand-in platform with the overlay's alignment, as the patched
  ``Platform`` has it) and the layer specs the model runner reports;
* engine core: layout resolution, ``get_kv_cache_configs`` (the patched
  upstream entry), the scheduler config, the capacity line, the scheduler's
  ``KVCacheManager``;
* worker: attention groups, ``prepare_kernel_block_sizes``,
  ``allocate_kv_cache`` and the kernel-block mapping of bound caches.

Attention backends are the real classes where they import on this host
(FlashAttention, Triton, TurboQuant); FlashInfer needs its package, so
stand-ins report what ``FlashInferBackend`` reports on Hopper and on
Blackwell, read from its source.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.tools.plan import PRESETS, PlanRequest, as_cuda_config, engine_config
from vllm_hybrid.tools.plan.config import (
    current_platform_as,
    overlay_off,
    platform_class,
    upstream_align,
)
from vllm_hybrid.tools.plan.request import checkpoint_architecture
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind

MiB = 2**20
MAX_MODEL_LEN = 2048


def write_qwen36_fp8(directory: Path) -> Path:
    """``config.json`` of Qwen3.6-35B-A3B-FP8 in ``directory``: the planner's
    preset (40 layers, 30 GDN + 10 attention, 2 KV heads x 256, GDN 16/32
    heads x 128, fp32 SSM state, the FP8 quantization block)."""
    return PRESETS["qwen3.6-35b-a3b-fp8"].write_config(directory)


# ---------------------------------------------------------------------------
# FlashInfer, as its class answers on the two GPU generations
# ---------------------------------------------------------------------------


class FlashInferHopper(AttentionBackend):
    """``FlashInferBackend`` on SM90 (vllm/v1/attention/backends/flashinfer.py):
    ``customize_spec`` changes only nvfp4 specs; kernel blocks 16/32/64 (larger
    pages run only on the SM100 trtllm-gen kernel); no layout preference."""

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("stand-in: no kernels")

    @staticmethod
    def get_builder_cls():
        raise NotImplementedError("stand-in: no metadata builder")

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [16, 32, 64]


class FlashInferBlackwell(FlashInferHopper):
    """``FlashInferBackend`` on SM100 with trtllm-gen usable (GQA, 16 query
    heads over 2 KV heads): pages 16-1024; head-major block interiors."""

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [16, 32, 64, 128, 256, 512, 1024]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)


@contextlib.contextmanager
def flash_attn_4_hd256() -> Iterator[None]:
    """FlashAttention as it answers on SM100 with FA4's head-256 kernel: one
    128-token kernel block (``FA4_HD256_PAGE_SIZE``), also preferred as the
    default block."""
    from vllm.v1.attention.backends.fa_utils import FA4_HD256_PAGE_SIZE
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    saved = FlashAttentionBackend.__dict__["_get_fa4_hd256_block_size"]
    FlashAttentionBackend._get_fa4_hd256_block_size = classmethod(
        lambda cls, kv_cache_spec=None: FA4_HD256_PAGE_SIZE
    )
    try:
        yield
    finally:
        FlashAttentionBackend._get_fa4_hd256_block_size = saved


def backend_class(name: str) -> type:
    """FLASH_ATTN, TRITON_ATTN, TURBOQUANT: the real classes (FLASH_ATTN_FA4:
    FlashAttention's, under :func:`backend_context`); FLASHINFER_SM90,
    FLASHINFER_SM100: the stand-ins."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    stand_ins = {"FLASHINFER_SM90": FlashInferHopper}
    stand_ins["FLASHINFER_SM100"] = FlashInferBlackwell
    if name in stand_ins:
        return stand_ins[name]
    return AttentionBackendEnum[name.removesuffix("_FA4")].get_class()


def backend_context(name: str) -> contextlib.AbstractContextManager:
    """What the backend ``name`` needs to answer as on its GPU."""
    if name == "FLASH_ATTN_FA4":
        return flash_attn_4_hd256()
    return contextlib.nullcontext()


def gdn_backend() -> type:
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    return MambaAttentionBackendEnum.GDN_ATTN.get_class()


# ---------------------------------------------------------------------------
# Config and worker specs
# ---------------------------------------------------------------------------


@dataclass
class Startup:
    """One engine's start-up on the CUDA path, up to the layer specs."""

    request: PlanRequest
    vllm_config: Any
    backend: type
    platform: type
    specs: dict[str, Any] = field(default_factory=dict)


def cuda_request(
    directory: Path,
    *,
    budget: int,
    block_size: int | None,
    kv_cache_dtype: str = "auto",
) -> PlanRequest:
    return PlanRequest(
        model=str(directory),
        kv_cache_memory=budget,
        device="cuda",
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=MAX_MODEL_LEN,
        block_size=block_size,
    )


def cuda_config(request: PlanRequest, *, eager: bool = False) -> Any:
    """The ``VllmConfig`` a CUDA host builds (``--enforce-eager``: no CUDA
    graphs, as ``eager`` asks)."""
    from vllm.config.compilation import CUDAGraphMode

    directory = Path(request.model)
    config, _ = engine_config(request, directory)
    config = as_cuda_config(config, request, checkpoint_architecture(directory))
    if eager:
        config.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    return config


def worker_specs(vllm_config: Any, backend: type) -> dict[str, Any]:
    """The specs the model runner reports (``get_kv_cache_spec``): attention
    layers' ``FullAttentionSpec`` passed through ``customize_attention_spec``,
    GDN layers' ``MambaSpec`` from the shape and dtype calculators the layer
    calls (qwen3_next's GatedDeltaNet)."""
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        get_kv_quant_mode,
    )
    from vllm.v1.worker.utils import customize_attention_spec

    model, cache = vllm_config.model_config, vllm_config.cache_config
    parallel, hf = vllm_config.parallel_config, model.hf_text_config
    dtype = model.dtype
    if cache.cache_dtype != "auto":
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

        dtype = STR_DTYPE_TO_TORCH_DTYPE[cache.cache_dtype]
    attention = customize_attention_spec(
        backend,
        FullAttentionSpec(
            block_size=cache.block_size,
            num_kv_heads=model.get_num_kv_heads(parallel),
            head_size=hf.head_dim,
            head_size_v=hf.head_dim,
            dtype=dtype,
            kv_quant_mode=get_kv_quant_mode(cache.cache_dtype),
        ),
    )
    state = MambaSpec(
        shapes=tuple(
            MambaStateShapeCalculator.gated_delta_net_state_shape(
                parallel.tensor_parallel_size,
                hf.linear_num_key_heads,
                hf.linear_num_value_heads,
                hf.linear_key_head_dim,
                hf.linear_value_head_dim,
                hf.linear_conv_kernel_dim,
                0,
            )
        ),
        dtypes=MambaStateDtypeCalculator.gated_delta_net_state_dtype(
            model.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
        ),
        block_size=cache.mamba_block_size,
        page_size_padded=cache.mamba_page_size_padded,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=cache.mamba_cache_mode,
    )
    specs: dict[str, Any] = {}
    for i, kind in enumerate(hf.layer_types):
        if kind == "full_attention":
            specs[f"model.layers.{i}.self_attn.attn"] = attention
        else:
            specs[f"model.layers.{i}.linear_attn"] = state
    return specs


def start_worker(
    request: PlanRequest, backend: type, *, eager: bool = False, base: Any = None
) -> Startup:
    """Config, the worker's block alignment and its layer specs."""
    from vllm_hybrid.platforms.hybrid_block_size import align_hybrid_block_size

    config = copy.deepcopy(base) if base is not None else cuda_config(request)
    if eager:
        from vllm.config.compilation import CUDAGraphMode

        config.compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    platform = platform_class("cuda", backend, align_hybrid_block_size)
    platform.update_block_size_for_backend(config)
    startup = Startup(request, config, backend, platform)
    startup.specs = worker_specs(config, backend)
    return startup


# ---------------------------------------------------------------------------
# Engine core
# ---------------------------------------------------------------------------


def resolve_layout(startup: Startup) -> KVCacheLayout:
    """The engine core's layout resolution over the workers' backends."""
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    names = [
        layout.name
        for layout in get_supported_kv_cache_layouts([startup.backend, gdn_backend()])
    ]
    return resolve_kv_cache_layout(
        startup.vllm_config, [names], list(startup.specs.values())
    )


@contextlib.contextmanager
def captured(logger_name: str) -> Iterator[list[str]]:
    """Messages logged to ``logger_name`` for the duration (vLLM's loggers do
    not propagate to pytest's handler)."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger(logger_name)
    handler = Collect(level=logging.DEBUG)
    saved = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


@dataclass
class EngineCore:
    """What the engine core holds after planning."""

    worker_configs: list[Any]
    scheduler_config: Any
    manager: Any
    capacity_lines: list[str]
    plan_lines: list[str]


def plan_engine_core(startup: Startup) -> EngineCore:
    """``EngineCore._initialize_kv_caches`` from layout to scheduler manager."""
    import vllm.v1.core.kv_cache_utils as kvu
    import vllm.v1.engine.core as engine_core
    from vllm.logger import _print_info_once
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    config = startup.vllm_config
    if config.cache_config.kv_cache_layout is None:
        resolve_layout(startup)
    # vLLM logs a line once per arguments; each plan here must log its own
    _print_info_once.cache_clear()
    with current_platform_as(startup.platform()):
        with captured("vllm.hybrid.v1.core.pooled.engine") as plan_lines:
            workers = kvu.get_kv_cache_configs(
                config, [startup.specs], [startup.request.kv_cache_memory]
            )
        scheduler = kvu.generate_scheduler_kv_cache_config(workers)
        config.cache_config.block_size = min(
            g.kv_cache_spec.block_size for g in scheduler.kv_cache_groups
        )
        with captured("vllm.hybrid.v1.core.pooled.engine") as capacity_lines:
            engine_core.update_kv_cache_capacity(config, scheduler)
        block, hash_block = kvu.resolve_kv_cache_block_sizes(scheduler, config)
    manager = KVCacheManager(
        scheduler,
        max_model_len=config.model_config.max_model_len,
        scheduler_block_size=block,
        hash_block_size=hash_block,
        max_in_flight_tokens=config.max_in_flight_tokens,
        enable_caching=bool(config.cache_config.enable_prefix_caching),
    )
    return EngineCore(workers, scheduler, manager, capacity_lines, plan_lines)


def plan_upstream(startup: Startup) -> tuple[Startup, Any]:
    """Upstream's plan (overlay off): inflated blocks, single shared pool."""
    import vllm.v1.core.kv_cache_utils as kvu

    config = startup.vllm_config
    with overlay_off():
        platform = platform_class("cuda", startup.backend, upstream_align())
        platform.update_block_size_for_backend(config)
        specs = worker_specs(config, startup.backend)
        upstream = Startup(startup.request, config, startup.backend, platform, specs)
        resolve_layout(upstream)
        with current_platform_as(platform()):
            (plan,) = kvu.get_kv_cache_configs(
                config, [upstream.specs], [startup.request.kv_cache_memory]
            )
    return upstream, plan


# ---------------------------------------------------------------------------
# Worker: kernel blocks and views
# ---------------------------------------------------------------------------


@dataclass
class WorkerCaches:
    attn_groups: list[list[Any]]
    kernel_block_sizes: list[int]
    kv_caches: dict[str, torch.Tensor]


def attention_groups(kv_cache_config: Any, backend: type) -> list[list[Any]]:
    """One attention group per KV cache group, as the model runner builds
    them: the attention backend for attention groups, GDN's for state."""
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.worker.utils import AttentionGroup

    groups = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        owner = gdn_backend() if isinstance(spec, MambaSpec) else backend
        groups.append([AttentionGroup(owner, list(group.layer_names), spec, gid)])
    return groups


def allocate(
    kv_cache_config: Any, backend: type, layout: KVCacheLayout, device: str = "meta"
) -> WorkerCaches:
    """``prepare_kernel_block_sizes`` and ``allocate_kv_cache`` as the
    model runner calls them (``meta``: shapes and strides, no memory)."""
    from vllm.v1.worker.utils import allocate_kv_cache, prepare_kernel_block_sizes

    groups = attention_groups(kv_cache_config, backend)
    kernel_block_sizes = prepare_kernel_block_sizes(kv_cache_config, groups)
    caches = allocate_kv_cache(
        kv_cache_config, torch.device(device), layout, kernel_block_sizes
    )
    return WorkerCaches(groups, kernel_block_sizes, caches)


def bind_as_runner(worker: WorkerCaches) -> dict[str, torch.Tensor]:
    """The kernel block each metadata builder picks for its group
    (``AttentionGroup.create_metadata_builders``) and the mapping of the
    caches before they are bound (``map_kv_caches_to_kernel_blocks``)."""
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import (
        map_kv_caches_to_kernel_blocks,
        select_common_block_size,
    )

    flat = [g for groups in worker.attn_groups for g in groups]
    for group in flat:
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            continue
        chosen = select_common_block_size(
            worker.kernel_block_sizes[group.kv_cache_group_id], [group.backend], [spec]
        )
        if chosen != spec.block_size:
            group.kernel_block_size = chosen
    return map_kv_caches_to_kernel_blocks(worker.kv_caches, flat)


# ---------------------------------------------------------------------------
# Worker: CUDA graph resolution and the dispatcher's keys
# ---------------------------------------------------------------------------


def resolve_as_runner(startup: Startup, kv_cache_config) -> CUDAGraphMode:
    """``GPUModelRunner._check_and_update_cudagraph_mode``: the least CUDA
    graph support over the groups' builders, then the resolution."""
    config = startup.vllm_config
    supports = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        owner = gdn_backend() if isinstance(spec, MambaSpec) else startup.backend
        builder = owner.get_builder_cls()
        supports.append((builder.get_cudagraph_support(config, spec), owner))
    support, owner = min(supports, key=lambda item: item[0].value)
    return config.compilation_config.resolve_cudagraph_mode_and_sizes(
        support,
        owner.__name__,
        1,
        use_v2_model_runner=False,
        kv_cache_config=kv_cache_config,
        max_num_reqs=config.scheduler_config.max_num_seqs,
        is_profiling=False,
    )


def dispatcher_keys(startup: Startup, capped: bool = True) -> dict:
    """The keys vLLM's dispatcher builds for this config after the runner's
    resolution (``capped=False``: upstream's method alone)."""
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    dispatcher = CudagraphDispatcher(startup.vllm_config)
    initialize = (
        type(dispatcher).initialize_cudagraph_keys
        if capped
        else upstream_of(
            "vllm_hybrid.v1.worker.cudagraph_capacity", "initialize_cudagraph_keys"
        )
    )
    mode = startup.vllm_config.compilation_config.cudagraph_mode
    initialize(dispatcher, mode, 1)
    return dispatcher.cudagraph_keys


def conv_state_rows(startup: Startup, config: PooledKVCacheConfig) -> int:
    """Blocks of a GDN layer's conv state as the layer unpacks its bound view
    (``MambaBase.bind_kv_cache``): the kernel's ``num_cache_lines``."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    layout = KVCacheLayout[startup.vllm_config.cache_config.kv_cache_layout]
    bound = bind_as_runner(allocate(config, startup.backend, layout))
    state = config.pool_by_kind(PoolKind.STATE)
    group = config.kv_cache_groups[state.group_ids[0]]
    spec = group.kv_cache_spec
    layer = SimpleNamespace(
        get_state_shape=lambda: spec.shapes, get_state_dtype=lambda: spec.dtypes
    )
    MambaBase.bind_kv_cache(layer, bound[group.layer_names[0]])
    conv_state = layer.kv_cache[0]
    return conv_state.size(0)


# ---------------------------------------------------------------------------
# Worker: vLLM's initialize_from_config
# ---------------------------------------------------------------------------


class RecordingRunner:
    """Stands in for the model runner inside ``Worker.initialize_from_config``:
    records the routed-experts store size the AuxOutput connector would be
    built with (the runner reads it once, in ``initialize_kv_cache``)."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.store_bytes: list[int | None] = []

    def initialize_kv_cache(self, kv_cache_config: Any, **kwargs: Any) -> None:
        self.store_bytes.append(self.vllm_config.aux_output_config.max_bytes)


def initialize_worker(vllm_config: Any, kv_cache_config: Any) -> RecordingRunner:
    """vLLM's GPU ``Worker.initialize_from_config``, called as the executor
    calls it on the worker vLLM's platform picks (no ``--worker-cls``), on a
    worker whose model runner is a :class:`RecordingRunner`."""
    from vllm.v1.worker.gpu_worker import Worker

    worker = object.__new__(Worker)
    worker.vllm_config = vllm_config
    worker.cache_config = vllm_config.cache_config
    worker.model_config = vllm_config.model_config
    worker.model_runner = RecordingRunner(vllm_config)
    Worker.initialize_from_config(worker, kv_cache_config)
    return worker.model_runner
