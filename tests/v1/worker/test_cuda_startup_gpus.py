"""``vllm serve Qwen/Qwen3.6-35B-A3B-FP8 --kv-cache-dtype turboquant_k8v4`` on
the GPUs users run it on, through the CUDA start-up path, with vLLM's CUDA
defaults for each GPU size.

Per GPU (24 GiB x 2 at TP 2, 48, 80 and 141 GiB) the planner's budget
(``--gpu-memory`` x 0.92 - 35 GiB of weights / TP) and ``vllm serve``'s
``max_num_seqs`` (256 below 70 GiB, 1,024 above) and capture sizes (up to
512) go through the worker's alignment and specs, the engine core's plan,
the runner's CUDA graph resolution and vLLM's dispatcher, in pooled mode and
in the single shared pool. Every one starts: where the largest full graph
has more sequences than the KV cache has states, the full graphs are capped
there and the piecewise graphs stay as vLLM keys them. The planner prints
the same cap. A budget too small for upstream (its ``max_num_seqs >
num_blocks`` refusal) starts with the overlay too.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest
from cuda_startup import (
    Startup,
    backend_class,
    conv_state_rows,
    cuda_config,
    dispatcher_keys,
    plan_engine_core,
    plan_upstream,
    resolve_as_runner,
    start_worker,
)
from vllm.config.compilation import CUDAGraphMode

from vllm_hybrid.tools.plan import PRESETS, PlanRequest, kv_budget_from_gpu
from vllm_hybrid.tools.plan import main as plan_main
from vllm_hybrid.tools.plan.config import overlay_off
from vllm_hybrid.tools.plan.cuda_defaults import (
    set_cuda_graph_sizes,
    with_serve_defaults,
)
from vllm_hybrid.tools.plan.request import VLLM_GPU_MEMORY_UTILIZATION
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind
from vllm_hybrid.v1.worker import cudagraph_capacity

GiB = 2**30
MODEL = "qwen3.6-35b-a3b-fp8"
DTYPE = "turboquant_k8v4"


@dataclasses.dataclass(frozen=True)
class Gpu:
    memory_gib: float
    tp: int
    #: vllm serve's max_num_seqs there, the largest full graph's sequences
    max_num_seqs: int
    rows: int
    #: requests' states pooled mode's arena holds, and its cap (None: none)
    pooled_states: int
    pooled_cap: int | None
    #: the single pool's blocks (every state view's rows)
    single_blocks: int

    @property
    def budget(self) -> int:
        weights = PRESETS[MODEL].weights_bytes
        return kv_budget_from_gpu(
            self.memory_gib, VLLM_GPU_MEMORY_UTILIZATION, weights, self.tp
        )


#: TurboQuant k8v4 at TP 1: 776 B per token and layer (2 KV heads x 388 B),
#: state 2,146,304 B per layer; a pooled state block holds 30 layers
#: (64,389,120 B), the single pool unifies 10 layers' pages per block.
GPUS = {
    "24x2-tp2": Gpu(24, 2, 256, 256, 150, 150, 457),
    "48": Gpu(48, 1, 256, 256, 150, 150, 457),
    "80": Gpu(80, 1, 1024, 512, 641, None, 1929),
    "141": Gpu(141, 1, 1024, 512, 1577, None, 4734),
}


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """``started(gpu, pooled, budget=None) -> (startup, kv_cache_config)``
    after the engine core's plan (``pooled=None``: upstream, overlay off)."""
    directory = PRESETS[MODEL].write_config(tmp_path_factory.mktemp(MODEL))
    configs: dict[tuple, object] = {}
    done: dict[tuple, tuple] = {}

    def get(name: str, pooled: bool | None, budget: int | None = None):
        gpu = GPUS[name]
        key = (name, pooled, budget)
        if key not in done:
            request = with_serve_defaults(
                PlanRequest(
                    model=str(directory),
                    kv_cache_memory=budget or gpu.budget,
                    device="cuda",
                    kv_cache_dtype=DTYPE,
                    tensor_parallel_size=gpu.tp,
                    gpu_memory_gib=gpu.memory_gib,
                )
            )
            if (name, budget) not in configs:
                config = cuda_config(request)
                set_cuda_graph_sizes(config, gpu.memory_gib)
                configs[(name, budget)] = config
            config = copy.deepcopy(configs[(name, budget)])
            backend = backend_class("TURBOQUANT")
            if pooled is None:
                startup = Startup(request, config, backend, None)
                done[key] = plan_upstream(startup)
            else:
                if not pooled:
                    config.additional_config = {"hybrid_kv": {"pooled": False}}
                startup = start_worker(request, backend, base=config)
                core = plan_engine_core(startup)
                done[key] = (startup, core.worker_configs[0])
        startup, kv_cache_config = done[key]
        return copy.deepcopy(startup), kv_cache_config

    return get


@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "single-pool"])
@pytest.mark.parametrize("name", list(GPUS))
def test_every_gpu_starts_with_full_graphs_sized_to_its_states(started, name, pooled):
    gpu = GPUS[name]
    startup, kv_cache_config = started(name, pooled)
    config = startup.vllm_config
    assert config.scheduler_config.max_num_seqs == gpu.max_num_seqs
    assert max(config.compilation_config.cudagraph_capture_sizes) == 512
    assert isinstance(kv_cache_config, PooledKVCacheConfig) == pooled
    assert resolve_as_runner(startup, kv_cache_config) == (
        CUDAGraphMode.FULL_AND_PIECEWISE
    )
    if pooled:
        states = cudagraph_capacity.full_graph_states(
            kv_cache_config,
            CUDAGraphMode.FULL_AND_PIECEWISE,
            config.compilation_config.cudagraph_capture_sizes,
            gpu.max_num_seqs,
        )
        assert (states.graph_rows, states.max_states) == (gpu.rows, gpu.pooled_states)
        cap = gpu.pooled_cap
        view_rows = kv_cache_config.pool_by_kind(PoolKind.STATE).num_blocks
    else:
        assert kv_cache_config.num_blocks == gpu.single_blocks
        cap = gpu.rows if gpu.rows <= gpu.single_blocks else gpu.single_blocks
        cap = None if cap == gpu.rows else cap
        view_rows = kv_cache_config.num_blocks
    compilation = config.compilation_config
    assert cudagraph_capacity.full_graph_row_cap(compilation) == cap
    keys = dispatcher_keys(startup)
    full_rows = max(key.num_reqs for key in keys[CUDAGraphMode.FULL])
    sizes = compilation.cudagraph_capture_sizes
    assert full_rows == max(s for s in sizes if s <= (cap or gpu.rows))
    # every full graph's state rows exist in each state layer's view
    assert full_rows <= view_rows
    if pooled:
        assert conv_state_rows(startup, kv_cache_config) == view_rows
    # the piecewise (prefill) graphs are not touched
    uncapped = dispatcher_keys(startup, capped=False)
    assert keys[CUDAGraphMode.PIECEWISE] == uncapped[CUDAGraphMode.PIECEWISE]
    assert len(keys[CUDAGraphMode.PIECEWISE]) == len(sizes)


@pytest.mark.parametrize("name", list(GPUS))
def test_the_planner_prints_the_same_cap(started, name, capsys):
    gpu = GPUS[name]
    argv = [MODEL, "--gpu-memory", str(gpu.memory_gib), "-tp", str(gpu.tp)]
    capsys.readouterr()
    assert plan_main([*argv, "--kv-cache-dtype", DTYPE, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_cache_memory"] == gpu.budget
    assert plan["max_num_seqs"] == gpu.max_num_seqs
    graphs = plan["pooled"]["cuda_graphs"]
    assert (graphs["graph_rows"], graphs["states"]) == (gpu.rows, gpu.pooled_states)
    assert graphs["cap"] == gpu.pooled_cap
    upstream = plan["upstream"]["cuda_graphs"]
    assert upstream["refused"] is False and upstream["cap"] is None


#: 24 GiB cards at TP 2 after ~2 GiB of activations, CUDA graphs and context:
#: 2.5 GiB of KV cache. Upstream's single pool has 249 blocks of 10,739,840 B
#: there (10 layers' pages at TP 2) and refuses max_num_seqs 256. The
#: overlay starts: pooled mode's arena has 83 state blocks of 32,194,560 B
#: (30 layers at TP 2), 2 below the lowest state floor, so 81 states; the
#: single pool caps its full graphs at its 249 blocks.
TIGHT = int(2.5 * GiB)


def test_a_budget_upstream_refuses_starts_with_the_overlay(started):
    upstream, plan = started("24x2-tp2", None, TIGHT)
    refusal = "max_num_seqs (256) exceeds available Mamba cache blocks (249)"
    with overlay_off(), pytest.raises(ValueError, match=re.escape(refusal)):
        resolve_as_runner(upstream, plan)
    for pooled, cap in ((True, 81), (False, 249)):
        startup, kv_cache_config = started("24x2-tp2", pooled, TIGHT)
        assert resolve_as_runner(startup, kv_cache_config).has_full_cudagraphs()
        compilation = startup.vllm_config.compilation_config
        assert cudagraph_capacity.full_graph_row_cap(compilation) == cap
