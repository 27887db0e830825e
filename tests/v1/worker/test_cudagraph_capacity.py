"""Full CUDA graphs of a hybrid: the largest full graph against the requests'
states the KV cache holds, capped there instead of refused (why:
:mod:`vllm_hybrid.v1.worker.cudagraph_capacity`).

A Qwen3.6-35B-A3B-FP8-shaped model on the CUDA path (FlashAttention, 16-token
blocks, align mode, FULL_AND_PIECEWISE), by hand:

* state block: 30 GDN layers x 2,146,304 B = 64,389,120 B; token block: 10
  attention layers x 16 tokens x 2,048 B = 327,680 B;
* with CUDA graphs the null region is one state block, so the first token id
  is 197 and the token pool's minimum (1 block) ends at byte 198 x 327,680 =
  64,880,640: the lowest state floor is 2;
* a decoding request holds one state block (align mode, no drafts), so the
  arena holds ``arena // 64,389,120 - 2`` requests' states at once:
  2 GiB: 33 - 2 = 31; 8 GiB: 133 - 2 = 131; 40 GiB: 667 - 2 = 665.

Upstream with the same inputs (overlay off) groups 10 layers per block of
1,056 tokens: 99, 397 and 1,985 blocks, compares ``max_num_seqs`` with them
and refuses above; with the overlay, the same single pool caps its full
graphs at those blocks and starts.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch
from cuda_startup import (
    Startup,
    backend_class,
    captured,
    conv_state_rows,
    current_platform_as,
    dispatcher_keys,
    gdn_backend,
    plan_upstream,
    resolve_as_runner,
    resolve_layout,
    start_worker,
)
from vllm.config.compilation import CUDAGraphMode

from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.tools.plan.config import overlay_off
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind
from vllm_hybrid.v1.worker import cudagraph_capacity
from vllm_hybrid.v1.worker.cudagraph_capacity import full_graph_states

GiB = 2**30
STATE_BLOCK = 64_389_120
REPLACEMENT = "resolve_cudagraph_mode_and_sizes"


@dataclasses.dataclass(frozen=True)
class Case:
    budget: int
    max_num_seqs: int
    #: --max-cudagraph-capture-size (None: vLLM's default, 2 x max_num_seqs
    #: up to 512)
    max_capture: int | None
    #: sequences of the largest full decode graph, requests' states the arena
    #: holds, and the cap the overlay puts on the full graphs (None: none)
    rows: int
    states: int
    cap: int | None
    #: upstream's num_blocks for the same inputs, and whether upstream starts
    upstream_blocks: int
    upstream_starts: bool


#: 8g-131 (--max-num-seqs 131: vLLM then captures a 131-sequence decode
#: graph) and 8g-256-cap131 (--max-cudagraph-capture-size 131: vLLM
#: truncates it to 128, its last size on the 8-token stride) fit without a
#: cap; 8g-256 is capped at the 131 states.
CASES = {
    "2g-16": Case(2 * GiB, 16, None, 16, 31, None, 99, True),
    "2g-31": Case(2 * GiB, 31, None, 31, 31, None, 99, True),
    "2g-32": Case(2 * GiB, 32, None, 32, 31, 31, 99, True),
    "2g-128": Case(2 * GiB, 128, None, 128, 31, 31, 99, False),
    "8g-128": Case(8 * GiB, 128, None, 128, 131, None, 397, True),
    "8g-256": Case(8 * GiB, 256, None, 256, 131, 131, 397, True),
    "8g-256-cap": Case(8 * GiB, 256, 128, 128, 131, None, 397, True),
    "8g-131": Case(8 * GiB, 131, None, 131, 131, None, 397, True),
    "8g-256-cap131": Case(8 * GiB, 256, 131, 128, 131, None, 397, True),
    "8g-1024-cap": Case(8 * GiB, 1024, 128, 128, 131, None, 397, False),
    "40g-256": Case(40 * GiB, 256, None, 256, 665, None, 1985, True),
    "40g-1024": Case(40 * GiB, 1024, None, 512, 665, None, 1985, True),
}
ALL_CASES = pytest.mark.parametrize(
    "case", [pytest.param(case, id=name) for name, case in CASES.items()]
)


def _startup(graph_configs, case: Case) -> Startup:
    request, config = graph_configs(case.max_num_seqs, case.max_capture)
    request = dataclasses.replace(request, kv_cache_memory=case.budget)
    return start_worker(request, backend_class("FLASH_ATTN"), base=config)


def _plan(startup: Startup):
    """The engine core's ``get_kv_cache_configs`` for the worker's specs."""
    import vllm.v1.core.kv_cache_utils as kvu

    if startup.vllm_config.cache_config.kv_cache_layout is None:
        resolve_layout(startup)
    with current_platform_as(startup.platform()):
        (config,) = kvu.get_kv_cache_configs(
            startup.vllm_config,
            [startup.specs],
            [startup.request.kv_cache_memory],
        )
    return config


def _states(startup: Startup, config: PooledKVCacheConfig, max_num_seqs: int):
    compilation = startup.vllm_config.compilation_config
    return full_graph_states(
        config,
        CUDAGraphMode.FULL_AND_PIECEWISE,
        compilation.cudagraph_capture_sizes,
        max_num_seqs,
    )


@ALL_CASES
def test_hand_derived_states(graph_configs, case: Case):
    startup = _startup(graph_configs, case)
    config = _plan(startup)
    assert isinstance(config, PooledKVCacheConfig)
    layout = config.layout
    assert layout.state_block_bytes == STATE_BLOCK
    assert layout.num_state_ids == case.budget // STATE_BLOCK
    assert layout.min_state_floor == 2
    states = _states(startup, config, case.max_num_seqs)
    assert (states.state_blocks, states.blocks_per_request) == (case.states, 1)
    assert states.max_states == case.states
    # the largest full graph is the dispatcher's largest decode graph
    assert states.graph_rows == case.rows == max(_decode_graph_sizes(startup))


@ALL_CASES
def test_pooled_full_graphs_are_sized_to_the_states(graph_configs, case: Case):
    """Every case starts: the full graphs are capped at the states where the
    largest one has more rows, the piecewise graphs stay as vLLM keys them."""
    startup = _startup(graph_configs, case)
    config = _plan(startup)
    mode = resolve_as_runner(startup, config)
    assert mode == CUDAGraphMode.FULL_AND_PIECEWISE
    compilation = startup.vllm_config.compilation_config
    assert cudagraph_capacity.full_graph_row_cap(compilation) == case.cap
    keys = dispatcher_keys(startup)
    full_rows = max(key.num_reqs for key in keys[CUDAGraphMode.FULL])
    assert full_rows == max(s for s in _sizes(startup) if s <= (case.cap or case.rows))
    assert full_rows <= case.states
    assert (
        keys[CUDAGraphMode.PIECEWISE]
        == dispatcher_keys(startup, capped=False)[CUDAGraphMode.PIECEWISE]
    )


def test_cap_line(graph_configs):
    """8 GiB, max_num_seqs 256: decode graphs up to 256 sequences, 131
    states; the arena needs 125 more state blocks for all of them:
    8,589,926,400 B (the budget rounded down to 256 B) + 125 x 64,389,120 B."""
    from vllm.logger import _print_info_once

    startup = _startup(graph_configs, CASES["8g-256"])
    config = _plan(startup)
    needed = 8 * GiB + 125 * STATE_BLOCK
    assert needed == 16_638_574_592
    _print_info_once.cache_clear()
    with captured("vllm.hybrid.v1.worker.cudagraph_capacity") as lines:
        resolve_as_runner(startup, config)
    assert lines == [
        "vllm-hybrid: full CUDA graphs capped at 131 sequences (of 256: capture "
        "size 256, max_num_seqs 256), because the KV cache arena of 8.00 GiB "
        "holds at most 131 requests' states at once (131 state blocks of 61.41 "
        "MiB, 1 per running request); no more run at once, and larger batches "
        "run the piecewise graphs (captured as before). --max-num-seqs 131 "
        "matches the scheduler to it; --kv-cache-memory-bytes 16638574592 "
        "(15.50 GiB, or --gpu-memory-utilization to match) gives all 256 "
        "sequences a full graph."
    ]


def test_the_named_budget_needs_no_cap(graph_configs):
    """The budget the 8 GiB cap line names serves 256 states exactly."""
    case = dataclasses.replace(CASES["8g-256"], budget=16_638_574_592)
    startup = _startup(graph_configs, case)
    config = _plan(startup)
    assert _states(startup, config, 256).max_states == 256
    assert resolve_as_runner(startup, config) == CUDAGraphMode.FULL_AND_PIECEWISE
    compilation = startup.vllm_config.compilation_config
    assert cudagraph_capacity.full_graph_row_cap(compilation) is None


def test_no_state_at_all_is_refused():
    """Only a KV cache without one request's state cannot start; the planner
    refuses such budgets before this point, so the case is built directly."""
    states = cudagraph_capacity.FullGraphStates(
        max_num_seqs=256,
        graph_tokens=256,
        graph_rows=256,
        decode_query_len=1,
        state_blocks=0,
        blocks_per_request=1,
        state_block_bytes=STATE_BLOCK,
        arena_bytes=GiB,
    )
    compilation = SimpleNamespace()
    with pytest.raises(ValueError) as refused:
        cudagraph_capacity.size_full_graphs(
            compilation, states, CUDAGraphMode.FULL_AND_PIECEWISE
        )
    assert "need at least one request's recurrent state" in str(refused.value)
    assert f"--kv-cache-memory-bytes to at least {GiB + STATE_BLOCK}" in str(
        refused.value
    )
    assert cudagraph_capacity.full_graph_row_cap(compilation) is None


def test_max_num_seqs_above_the_states_is_logged(graph_configs):
    from vllm.logger import _print_info_once

    startup = _startup(graph_configs, CASES["40g-1024"])
    config = _plan(startup)
    # logged once per process; other tests may have logged it already
    _print_info_once.cache_clear()
    with captured("vllm.hybrid.v1.worker.cudagraph_capacity") as lines:
        resolve_as_runner(startup, config)
    assert lines == [
        "vllm-hybrid: the KV cache arena holds at most 665 requests' states at "
        "once, so at most 665 of max_num_seqs 1024 run concurrently; full CUDA "
        "graphs (up to 512 sequences) fit"
    ]


@pytest.mark.parametrize(
    ("mode", "profiling"),
    [
        (CUDAGraphMode.PIECEWISE, False),
        (CUDAGraphMode.NONE, False),
        (CUDAGraphMode.FULL_AND_PIECEWISE, True),
    ],
)
def test_no_full_graphs_or_profiling_are_not_capped(graph_configs, mode, profiling):
    """Piecewise graphs run the state kernels eagerly; the profiling run's KV
    cache is a throwaway (upstream skips it too)."""
    startup = _startup(graph_configs, CASES["2g-128"])
    config = _plan(startup)
    compilation = startup.vllm_config.compilation_config
    compilation.cudagraph_mode = mode
    resolved = compilation.resolve_cudagraph_mode_and_sizes(
        gdn_backend().get_builder_cls()._cudagraph_support,
        "GDNAttentionBackend",
        kv_cache_config=config,
        max_num_reqs=128,
        is_profiling=profiling,
    )
    assert resolved == mode
    assert cudagraph_capacity.full_graph_row_cap(compilation) is None


# ---------------------------------------------------------------------------
# Capture: the state rows and ids of every full decode graph
# ---------------------------------------------------------------------------


def _sizes(startup: Startup) -> list[int]:
    return startup.vllm_config.compilation_config.cudagraph_capture_sizes


def _decode_graph_sizes(startup: Startup) -> list[int]:
    """The full decode graphs vLLM's dispatcher keys for this config before
    any cap (FULL_DECODE_ONLY: the same decode graphs, no piecewise
    compilation needed to build the dispatcher here)."""
    config = copy.deepcopy(startup.vllm_config)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    decode = Startup(startup.request, config, startup.backend, startup.platform)
    keys = dispatcher_keys(decode, capped=False)[CUDAGraphMode.FULL]
    return sorted(key.num_tokens for key in keys)


def _capture_state_ids(startup: Startup, config, rows: int) -> torch.Tensor:
    """GDN's state indices for a capture batch of ``rows`` decodes, built as
    ``_dummy_run`` builds it: the state group's block table of an empty input
    batch (all zero), one token per sequence, ``seq_len`` 1, no prefills."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.block_table import BlockTable

    vllm_config = startup.vllm_config
    scheduler = vllm_config.scheduler_config
    state = config.pool_by_kind(PoolKind.STATE)
    group = config.kv_cache_groups[state.group_ids[0]]
    spec = group.kv_cache_spec
    cpu = torch.device("cpu")
    max_len = vllm_config.model_config.max_model_len
    width = spec.max_num_blocks_per_req(vllm_config, max_len)
    tokens = scheduler.max_num_batched_tokens
    table = BlockTable(
        spec.block_size, scheduler.max_num_seqs, width, tokens, False, cpu, 1
    )
    table.commit_block_table(rows)
    starts = torch.arange(rows + 1, dtype=torch.int32)
    ones = torch.ones(rows, dtype=torch.int32)
    metadata = CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts,
        seq_lens=ones,
        seq_lens_cpu_upper_bound=ones,
        is_prefilling=torch.zeros(rows, dtype=torch.bool),
        num_reqs=rows,
        num_actual_tokens=rows,
        max_query_len=1,
        max_seq_len=max_len,
        block_table_tensor=table.get_device_tensor(rows),
        slot_mapping=torch.full((rows,), -1, dtype=torch.int64),
    )
    with set_current_vllm_config(vllm_config), current_platform_as(startup.platform()):
        builder = gdn_backend().get_builder_cls()(
            spec, list(group.layer_names), vllm_config, cpu
        )
        built = builder.build_for_cudagraph_capture(metadata)
    assert built.num_decodes == rows
    return built.non_spec_state_indices_tensor


@pytest.mark.parametrize("case_id", ["8g-128", "8g-256", "8g-256-cap", "40g-1024"])
def test_capture_uses_only_existing_state_ids(graph_configs, case_id):
    """Every full graph a config keeps after the resolution: its sequences fit
    the conv state view (GDN asserts ``num_cache_lines >= batch``), and every
    state id it captures is the null block 0, below the state pool's ids."""
    case = CASES[case_id]
    startup = _startup(graph_configs, case)
    config = _plan(startup)
    resolve_as_runner(startup, config)
    rows = sorted(key.num_reqs for key in dispatcher_keys(startup)[CUDAGraphMode.FULL])
    assert rows[-1] == max(s for s in _sizes(startup) if s <= (case.cap or case.rows))
    num_state_ids = config.pool_by_kind(PoolKind.STATE).num_blocks
    assert num_state_ids == case.budget // STATE_BLOCK
    assert conv_state_rows(startup, config) == num_state_ids
    assert rows[-1] <= case.states < num_state_ids
    for batch in rows:
        ids = _capture_state_ids(startup, config, batch)
        assert ids.shape == (batch,)
        assert int(ids.max()) == 0 < num_state_ids


# ---------------------------------------------------------------------------
# Upstream with the same inputs
# ---------------------------------------------------------------------------


@ALL_CASES
def test_upstream_with_the_same_inputs(graph_configs, case: Case):
    request, config = graph_configs(case.max_num_seqs, case.max_capture)
    request = dataclasses.replace(request, kv_cache_memory=case.budget)
    startup = Startup(request, config, backend_class("FLASH_ATTN"), None)
    upstream, plan = plan_upstream(startup)
    assert not isinstance(plan, PooledKVCacheConfig)
    assert plan.num_blocks == case.upstream_blocks
    blocks = {g.kv_cache_spec.block_size for g in plan.kv_cache_groups}
    assert blocks == {1056}
    refusal = (
        f"max_num_seqs ({case.max_num_seqs}) exceeds available Mamba cache "
        f"blocks ({case.upstream_blocks}). Each decode sequence requires one "
        "Mamba cache block, so CUDA graph capture cannot proceed. Please lower "
        f"max_num_seqs to at most {case.upstream_blocks} or increase "
        "gpu_memory_utilization."
    )
    with overlay_off():
        assert _outcome(upstream, plan) == (None if case.upstream_starts else refusal)
    # the overlay, given upstream's single-pool config: it starts and caps the
    # full graphs at the blocks each state view has
    assert _outcome(upstream, plan) is None
    compilation = upstream.vllm_config.compilation_config
    cap = cudagraph_capacity.full_graph_row_cap(compilation)
    assert cap == (case.upstream_blocks if case.rows > case.upstream_blocks else None)


def _outcome(startup: Startup, kv_cache_config) -> str | None:
    """None when the resolution passes, else the error's text."""
    try:
        assert resolve_as_runner(startup, kv_cache_config).has_full_cudagraphs()
    except ValueError as exc:
        return str(exc)
    return None


def test_upstream_check_on_a_pooled_config_compares_token_ids(graph_configs):
    """Upstream's own check, given the pooled config, compares 256 with the
    token pool's 26,214 ids and passes, while each state view has 133 blocks:
    the 256-sequence capture would then fail GDN's ``num_cache_lines >=
    batch`` on the GPU."""
    startup = _startup(graph_configs, CASES["8g-256"])
    config = _plan(startup)
    assert config.num_blocks == 26_214
    assert conv_state_rows(startup, config) == 133
    upstream = upstream_of(cudagraph_capacity.__name__, REPLACEMENT)
    compilation = startup.vllm_config.compilation_config
    mode = upstream(
        compilation,
        gdn_backend().get_builder_cls()._cudagraph_support,
        "GDNAttentionBackend",
        kv_cache_config=config,
        max_num_reqs=256,
    )
    assert mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert max(_decode_graph_sizes(startup)) == 256


def test_upstream_reads_kv_cache_config_for_the_block_check_only():
    """The replacement passes ``kv_cache_config=None`` for pooled configs;
    that must skip upstream's single-pool block check and nothing else."""
    import ast
    import textwrap

    upstream = upstream_of(cudagraph_capacity.__name__, REPLACEMENT)
    tree = ast.parse(textwrap.dedent(inspect.getsource(upstream)))
    reads = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and node.id == "kv_cache_config"
    ]
    checks = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "kv_cache_config" in ast.unparse(node.test)
    ]
    (check,) = checks
    assert "exceeds available Mamba cache" in ast.unparse(check.body)
    inside = {id(node) for node in ast.walk(check)}
    assert len(reads) == 5
    assert [node for node in reads if id(node) not in inside] == []


@pytest.mark.parametrize("name", [REPLACEMENT, "initialize_cudagraph_keys"])
def test_replacement_has_upstreams_parameters(name):
    ours = getattr(cudagraph_capacity, name)
    upstream = upstream_of(cudagraph_capacity.__name__, name)
    params = [inspect.signature(f).parameters.values() for f in (ours, upstream)]
    shapes = [[(p.name, p.kind, p.default) for p in ps] for ps in params]
    assert shapes[0] == shapes[1]
