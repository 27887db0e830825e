"""One simulated engine: vLLM's ``EngineCore`` over the stand-in executor.

The engine core is built exactly as ``vllm serve`` builds it in its engine
process (KV cache planning, scheduler class, block hasher), from the config
the planner derives for the device asked, with
:class:`~.executor.StandInExecutor` as its executor class. Whether the
overlay is active is this process's decision (``VLLM_HYBRID_KV``, read when
vLLM loads plugins); :func:`overlay_active` reports it.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hybrid.tools.plan.geometry import (
    EngineGeometry,
    EngineOptions,
    engine_geometry,
)
from vllm_hybrid.tools.plan.request import PlanRequest
from vllm_hybrid.tools.simulate.executor import (
    StandInExecutor,
    TokenSource,
    counting_tokens,
    stand_in_executor,
)


def overlay_active() -> bool:
    """Whether the overlay runs in this process (loads vLLM's plugins)."""
    from vllm.plugins import load_general_plugins

    from vllm_hybrid import plugin

    load_general_plugins()
    state = plugin.state()
    return state is not None and state.active


@dataclass
class SimEngine:
    """An open engine core and what its driver reads."""

    core: Any
    geometry: EngineGeometry
    executor: StandInExecutor

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def vllm_config(self) -> Any:
        return self.geometry.vllm_config

    def vocab_size(self) -> int:
        return self.vllm_config.model_config.get_vocab_size()


def kernel_block(backend: type) -> int:
    """The smallest block the attention backend's kernels take."""
    from vllm.v1.attention.backend import MultipleOf

    sizes = backend.get_supported_kernel_block_sizes()
    return min(s.base if isinstance(s, MultipleOf) else int(s) for s in sizes)


def resolve_options(geometry: EngineGeometry) -> None:
    """Replace the runner's symbolic cache options by this engine's numbers:
    ``prefix_match_unit`` "kernel" is the attention kernel's block; a
    retention interval "Nx" is N scheduler blocks (the least common multiple
    of the attention and state blocks this engine will pick)."""
    cache = geometry.vllm_config.cache_config
    if cache.prefix_match_unit == "kernel":
        cache.prefix_match_unit = kernel_block(geometry.backend)
    interval = cache.prefix_cache_retention_interval
    if isinstance(interval, str) and interval.endswith("x"):
        preview = copy.deepcopy(geometry.vllm_config)
        geometry.platform.update_block_size_for_backend(preview)
        block = preview.cache_config.block_size
        scheduler_block = math.lcm(
            block, preview.cache_config.mamba_block_size or block
        )
        cache.prefix_cache_retention_interval = int(interval[:-1]) * scheduler_block


@contextlib.contextmanager
def open_engine(
    request: PlanRequest,
    directory: Path,
    options: EngineOptions,
    tokens: TokenSource | None = None,
    async_scheduling: bool = False,
) -> Iterator[SimEngine]:
    """An engine core for ``request`` with ``options``, closed afterwards.

    For a CUDA plan, vLLM's current platform is the planned device's for the
    engine's lifetime (its code asks, for example, whether CUDA graphs run).
    """
    from vllm.v1.engine.core import EngineCore

    geometry = engine_geometry(request, directory, options, pooled=overlay_active())
    resolve_options(geometry)
    config = geometry.vllm_config
    config.scheduler_config.async_scheduling = async_scheduling
    if tokens is None:
        tokens = counting_tokens(config.model_config.get_vocab_size())
    executor_class = stand_in_executor(geometry, request.kv_cache_memory, tokens)
    core = None
    try:
        with geometry.device_platform():
            core = EngineCore(config, executor_class, log_stats=False)
            yield SimEngine(core, geometry, core.model_executor)
    finally:
        # after the device's platform is gone: the clean-up asks this host's
        # accelerator, not the planned one
        if core is not None:
            core.shutdown()
