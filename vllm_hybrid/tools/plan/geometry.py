"""One engine's view of a model, as its engine core and workers would hold it.

The planner computes two columns in one process, so it names upstream's and
this project's block alignment explicitly. A simulated engine runs in a
process of its own mode (the overlay's switch is read once per process), so
here the alignment is whichever ``Platform._align_hybrid_block_size`` this
process has installed, and the engine options a simulation varies (prefix
match unit, retention interval, checkpoint interval, scheduler limits,
``hybrid_kv`` options) are set on the config before the engine sees it.

Everything else is the planner's: :func:`planned_config` is the one path
from a plan request to the config both the planner and a simulated engine
start from (:func:`engine_config` on this host, then on CUDA ``vllm
serve``'s batch limits, :func:`as_cuda_config` and the CUDA graph sizes);
:func:`platform_class` stands in for the device's platform with the
attention backend fixed, :func:`layer_specs` gives every layer's spec.

:func:`kv_geometry` reads what a request truly needs from an engine's
``KVCacheConfig`` (attention bytes per token, state bytes per request, both
unpadded), once for the simulator's cost model and ``bench_pooled``'s
needed-over-reserved figures.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_hybrid.tools.plan.config import (
    as_cuda_config,
    attention_backend,
    current_platform_as,
    engine_config,
    layer_specs,
    platform_class,
)
from vllm_hybrid.tools.plan.cuda_defaults import (
    set_cuda_graph_sizes,
    with_serve_defaults,
)
from vllm_hybrid.tools.plan.request import (
    PlanError,
    PlanRequest,
    checkpoint_architecture,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: Engine options a simulated engine may set, by the vLLM config that holds
#: them. Anything else is refused, so a typo is not silently ignored.
CACHE_OPTIONS = frozenset(
    {
        "prefix_match_unit",
        "prefix_cache_retention_interval",
        "mamba_block_size",
        "enable_prefix_caching",
    }
)
SCHEDULER_OPTIONS = frozenset(
    {"max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold"}
)


@dataclass(frozen=True)
class EngineOptions:
    """What one engine sets on top of the plan request.

    ``cache`` and ``scheduler`` hold fields of vLLM's ``CacheConfig`` and
    ``SchedulerConfig`` (:data:`CACHE_OPTIONS`, :data:`SCHEDULER_OPTIONS`);
    ``hybrid_kv`` is the overlay's ``--additional-config`` section, passed
    as it is so that any option of the overlay can be varied.
    """

    cache: Mapping[str, Any] = field(default_factory=dict)
    scheduler: Mapping[str, Any] = field(default_factory=dict)
    hybrid_kv: Mapping[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """Raise :class:`PlanError` naming an option no engine field holds."""
        for given, known, where in (
            (self.cache, CACHE_OPTIONS, "cache"),
            (self.scheduler, SCHEDULER_OPTIONS, "scheduler"),
        ):
            unknown = sorted(set(given) - known)
            if unknown:
                raise PlanError(
                    f"unknown {where} option(s) {', '.join(unknown)}; "
                    f"known: {', '.join(sorted(known))}"
                )


@dataclass
class EngineGeometry:
    """A config and the device pieces the stand-in executor needs."""

    vllm_config: VllmConfig
    #: The attention backend class the device would use.
    backend: type
    #: The device's platform class with that backend fixed, and this
    #: process's block alignment.
    platform: type
    notes: list[str]
    #: The checkpoint's own architecture (where a class stands in for it).
    architecture: str

    def align_block_size(self) -> None:
        """What the executor does after loading the model: the platform picks
        the attention block (and, upstream, pads state pages) for this
        backend."""
        self.platform.update_block_size_for_backend(self.vllm_config)

    def layer_specs(self) -> dict[str, Any]:
        """Every layer's ``KVCacheSpec``, after :meth:`align_block_size`, in
        the model's layer order (see :func:`in_layer_order`)."""
        return in_layer_order(
            self.vllm_config, layer_specs(self.vllm_config, self.backend)
        )

    @contextlib.contextmanager
    def device_platform(self) -> Iterator[None]:
        """The planned device's platform is vLLM's current platform for the
        duration (engine code asks it, e.g., whether CUDA graphs run); a CPU
        plan keeps this host's platform."""
        if self.vllm_config.device_config.device_type == "cpu":
            yield
            return
        import_with_host_platform()
        with current_platform_as(self.platform()):
            yield


#: vLLM modules that answer a device question when first imported by
#: calling a compiled op of the current platform's build (``w8a8_utils``
#: asks whether CUTLASS supports block FP8, through ``vllm.v1.worker.utils``,
#: which an executor imports). This host's vLLM build has no CUDA ops, so
#: they must be first imported while this host's platform is current, as the
#: overlay's own start-up does in every engine it is active in.
HOST_IMPORTED_MODULES = ("vllm.v1.worker.utils",)


def import_with_host_platform() -> None:
    """Import :data:`HOST_IMPORTED_MODULES` before a planned CUDA platform
    becomes current, so an engine starts alike with the overlay on or off."""
    import importlib

    for name in HOST_IMPORTED_MODULES:
        importlib.import_module(name)


#: Layer type names of the two kinds in configs' layer lists.
_ATTENTION_TYPES = frozenset({"attention", "full_attention"})
_STATE_TYPES = frozenset({"mamba", "linear_attention"})


def in_layer_order(vllm_config: VllmConfig, specs: dict[str, Any]) -> dict[str, Any]:
    """``specs`` keyed and ordered as the model's workers report them.

    The engine groups layers by spec in the order the specs arrive (the
    order in which the model registers its layers), so the group ids, the
    order in which a request's blocks are allocated and freed, and with it
    which cached blocks are evicted first, follow the model's layer order:
    Qwen3-Next's first layer is a gated DeltaNet layer, so its state groups
    come before the attention group. Layer names follow vLLM's models
    (``self_attn.attn``; ``linear_attn`` for gated DeltaNet, ``mixer`` for
    Mamba). Without a layer type list the planner's order is kept.
    """
    from vllm.v1.kv_cache_interface import MambaSpec

    model_config = vllm_config.model_config
    text = model_config.hf_text_config
    types = getattr(text, "layer_types", None) or getattr(
        text, "layers_block_type", None
    )
    attention = [s for s in specs.values() if not isinstance(s, MambaSpec)]
    state = [s for s in specs.values() if isinstance(s, MambaSpec)]
    if not types or not attention:
        return specs
    start, end = model_config.get_layers_start_end_indices(vllm_config.parallel_config)
    ordered: dict[str, Any] = {}
    for index in range(start, end):
        kind = str(types[index])
        if kind in _ATTENTION_TYPES:
            ordered[f"model.layers.{index}.self_attn.attn"] = attention[0]
        elif kind in _STATE_TYPES and state:
            mixer = "linear_attn" if kind == "linear_attention" else "mixer"
            ordered[f"model.layers.{index}.{mixer}"] = state[0]
    counts = (len(attention), len(state))
    found = (
        sum(not isinstance(s, MambaSpec) for s in ordered.values()),
        sum(isinstance(s, MambaSpec) for s in ordered.values()),
    )
    return ordered if found == counts else specs


def installed_align() -> Any:
    """The block alignment this process runs: the overlay's where it is
    active, upstream's otherwise (a classmethod object, for a class body)."""
    from vllm.platforms.interface import Platform

    return Platform.__dict__["_align_hybrid_block_size"]


def apply_options(vllm_config: VllmConfig, options: EngineOptions) -> None:
    """Set ``options`` on a config vLLM built, as the engine arguments of the
    same names would have."""
    options.check()
    cache = vllm_config.cache_config
    for name, value in options.cache.items():
        setattr(cache, name, value)
    scheduler = vllm_config.scheduler_config
    for name, value in options.scheduler.items():
        setattr(scheduler, name, value)
    if options.hybrid_kv:
        # over the request's own --additional-config, as vLLM merges nothing:
        # the engine's options win key by key
        additional = dict(vllm_config.additional_config or {})
        given = dict(additional.get("hybrid_kv") or {})
        additional["hybrid_kv"] = {**given, **options.hybrid_kv}
        vllm_config.additional_config = additional


def planned_config(
    request: PlanRequest, directory: Path
) -> tuple[PlanRequest, VllmConfig, list[str], str | None]:
    """The config the planner plans and a simulated engine starts from, built
    once for both: vLLM's config on this host and, for a CUDA plan,
    ``vllm serve``'s batch limits for the GPU size (filled into the request
    returned), the CUDA host's config and its CUDA graph capture sizes. Also
    the planner's notes and the checkpoint's own architecture."""
    if request.device == "cuda":
        request = with_serve_defaults(request)
    config, notes = engine_config(request, directory)
    architecture = checkpoint_architecture(directory)
    if request.device == "cuda":
        config = as_cuda_config(config, request, architecture)
        set_cuda_graph_sizes(config, request.gpu_memory_gib)
    return request, config, notes, architecture


def engine_geometry(
    request: PlanRequest, directory: Path, options: EngineOptions, *, pooled: bool
) -> EngineGeometry:
    """The config an engine of ``request`` starts from, with ``options``.

    ``pooled`` says whether this process runs the overlay (it decides the
    attention backend only where upstream has none, TurboQuant on CPU). On
    CUDA the batch limits and CUDA graph sizes are ``vllm serve``'s for the
    GPU size, as the planner takes them. ``mamba_block_size`` is set after
    the CUDA conversion, which resets it to the model hooks' default.
    """
    from vllm_hybrid.config.hybrid_kv import options_error

    request, config, notes, architecture = planned_config(request, directory)
    problem = options_error({"hybrid_kv": dict(options.hybrid_kv)})
    if problem is not None:
        raise PlanError(problem)
    apply_options(config, options)
    backend = attention_backend(request, pooled=pooled)
    platform = platform_class(request.device, backend, installed_align())
    return EngineGeometry(
        vllm_config=config,
        backend=backend,
        platform=platform,
        notes=notes,
        architecture=str(architecture or config.model_config.architecture),
    )


@dataclass(frozen=True)
class KVGeometry:
    """What one request really needs, from the model's layer specs, unpadded:
    the benchmark's ``needed/reserved`` shows padding, rounding and
    fragmentation against it, and the simulator prices a state copy with it."""

    #: Bytes one token occupies summed over all attention layers.
    attn_bytes_per_token: float
    #: Bytes of one request's recurrent state summed over all state layers.
    state_bytes_per_request: int
    num_attention_layers: int
    num_state_layers: int
    #: Layers of other spec types; they are not counted in "needed".
    other_layers: tuple[str, ...] = ()

    def bytes_needed(self, num_computed_tokens: Iterable[int]) -> float:
        """Bytes the running requests with these token counts truly need."""
        counts = list(num_computed_tokens)
        return sum(counts) * self.attn_bytes_per_token + len(counts) * (
            self.state_bytes_per_request
        )

    def token_bound(self, budget_bytes: int) -> int:
        """Longest sequence one request could have if bytes were exact."""
        if self.attn_bytes_per_token <= 0:
            return 0
        free = budget_bytes - self.state_bytes_per_request
        return max(0, math.floor(free / self.attn_bytes_per_token))


def _layer_specs(kv_cache_config: KVCacheConfig) -> Iterator[tuple[str, Any]]:
    """(layer name, spec) of every layer of a ``KVCacheConfig``."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            yield from spec.kv_cache_specs.items()
        else:
            yield from ((name, spec) for name in group.layer_names)


def kv_geometry(kv_cache_config: KVCacheConfig) -> KVGeometry:
    """Per-token and per-request bytes of a ``KVCacheConfig``'s layers,
    unpadded (``real_page_size_bytes``)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    layers = list(_layer_specs(kv_cache_config))
    attention = [spec for _, spec in layers if isinstance(spec, AttentionSpec)]
    state = [spec for _, spec in layers if isinstance(spec, MambaSpec)]
    return KVGeometry(
        sum((spec.real_page_size_bytes / spec.block_size for spec in attention), 0.0),
        sum(spec.real_page_size_bytes for spec in state),
        len(attention),
        len(state),
        tuple(n for n, s in layers if not isinstance(s, (AttentionSpec, MambaSpec))),
    )
