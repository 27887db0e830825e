"""Full CUDA graphs sized to the states on Model Runner V2.

V2 resolves the graph mode with the same ``CompilationConfig`` method as V1
(``use_v2_model_runner=True``), then builds its ``CudaGraphManager``, whose
``_init_candidates`` lists the descriptors it captures and, per token
count, those a batch may run. The flagship's pooled plan at 8 GiB holds 131
requests' states (test_cudagraph_capacity.py derives it by hand): with
``max_num_seqs`` 256 V2 would capture decode graphs of up to 256 rows.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
from test_cudagraph_capacity import CASES, _plan, _startup
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig
from vllm_hybrid.v1.worker import cudagraph_capacity

REPLACEMENT = "vllm_hybrid.v1.worker.cudagraph_capacity"


def resolve_as_v2(startup, kv_cache_config) -> CUDAGraphMode:
    """``GPUModelRunner.initialize_kv_cache`` (V2): GDN's support is the
    least of the groups' (uniform decode batches in full graphs)."""
    from cuda_startup import gdn_backend

    config = startup.vllm_config
    builder = gdn_backend().get_builder_cls()
    state = next(
        g.kv_cache_spec
        for g in kv_cache_config.kv_cache_groups
        if not hasattr(g.kv_cache_spec, "num_kv_heads")
    )
    return config.compilation_config.resolve_cudagraph_mode_and_sizes(
        builder.get_cudagraph_support(config, state),
        gdn_backend().__name__,
        1,
        use_v2_model_runner=True,
        kv_cache_config=kv_cache_config,
        max_num_reqs=config.scheduler_config.max_num_seqs,
        is_profiling=False,
    )


def v2_manager(startup, mode: CUDAGraphMode, patched: bool = True):
    """A ``CudaGraphManager`` with what ``_init_candidates`` reads (its
    constructor also asks the distributed state and the graph pool)."""
    config = startup.vllm_config
    manager = object.__new__(CudaGraphManager)
    manager.__dict__.update(
        vllm_config=config,
        compilation_config=config.compilation_config,
        max_num_reqs=config.scheduler_config.max_num_seqs,
        cudagraph_mode=mode,
        decode_query_len=1,
        varlen_decode=False,
        lora_capture_cases=[0],
        ubatch_runner=None,
        _candidates={},
        _capture_descs={},
    )
    init = (
        CudaGraphManager._init_candidates
        if patched
        else upstream_of(REPLACEMENT, "init_candidates")
    )
    init(manager)
    return manager


def _full_rows(manager) -> list[int]:
    return sorted(d.num_reqs for d in manager._capture_descs[CUDAGraphMode.FULL])


@pytest.mark.parametrize("name", ["8g-256", "2g-32", "8g-128"])
def test_v2_captures_no_full_graph_above_the_states(graph_configs, name):
    case = CASES[name]
    startup = _startup(graph_configs, case)
    config = _plan(startup)
    assert isinstance(config, PooledKVCacheConfig)
    mode = resolve_as_v2(startup, config)
    assert mode.has_full_cudagraphs()
    compilation = startup.vllm_config.compilation_config
    assert cudagraph_capacity.full_graph_row_cap(compilation) == case.cap
    ours = v2_manager(startup, mode)
    theirs = v2_manager(startup, mode, patched=False)
    # upstream's manager: full decode graphs up to max_num_seqs rows
    assert max(_full_rows(theirs)) == case.rows
    assert max(_full_rows(ours)) == max(
        rows for rows in _full_rows(theirs) if rows <= (case.cap or case.rows)
    )
    assert max(_full_rows(ours)) <= case.states
    assert (
        ours._capture_descs[CUDAGraphMode.PIECEWISE]
        == theirs._capture_descs[CUDAGraphMode.PIECEWISE]
    )


def test_a_batch_above_the_cap_runs_its_piecewise_graph(graph_configs):
    startup = _startup(graph_configs, CASES["8g-256"])
    mode = resolve_as_v2(startup, _plan(startup))
    ours = v2_manager(startup, mode)
    ours._graphs_captured = True
    ours._lora_dispatch_map = {}
    for rows, expected in [(128, CUDAGraphMode.FULL), (200, CUDAGraphMode.PIECEWISE)]:
        desc = ours.dispatch(rows, rows, 1, 0, max_query_len=1)
        assert desc.cg_mode == expected, rows
    # 131 rows run the 136-token piecewise graph: the full graphs stop at 128
    assert ours.dispatch(131, 131, 1, 0, max_query_len=1).num_tokens == 136


def test_the_cap_is_per_compilation_config(graph_configs):
    """A manager of another config (no cap recorded) keeps every graph."""
    startup = _startup(graph_configs, CASES["8g-256"])
    mode = resolve_as_v2(startup, _plan(startup))
    other = dataclasses.replace(startup, vllm_config=copy.deepcopy(startup.vllm_config))
    assert (
        cudagraph_capacity.full_graph_row_cap(other.vllm_config.compilation_config)
        is None
    )
    assert max(_full_rows(v2_manager(other, mode))) == 256
