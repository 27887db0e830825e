"""What pooled mode cannot serve on the CUDA start-up path, and how it says so.

* A block the attention backend cannot run unsplit: refused when the worker
  aligns its block size (before profiling and allocation), naming the
  backend, the kernel block sizes and the options. Without that check the
  same configurations fail later inside upstream's worker code, with advice
  that does not apply to pooled mode; the tests show both.
* A KV cache layout whose pages are not contiguous: upstream's resolution
  rejects such a layout for hybrid models itself; a layout preset on the
  cache config makes the engine use upstream's single pool (one log line),
  because pooled views cannot express it (the checker shows why).
"""

from __future__ import annotations

import json
import re

import pytest
from cuda_startup import (
    MiB,
    allocate,
    attention_groups,
    backend_class,
    backend_context,
    bind_as_runner,
    captured,
    current_platform_as,
    plan_engine_core,
    resolve_layout,
    start_worker,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_hybrid.tools.plan import main as plan_main
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig
from vllm_hybrid.v1.worker.pooled_views import (
    PooledViewError,
    check_pooled_views,
    view_runs,
)

BUDGET = 256 * MiB

#: (backend, --block-size, KV dtype, the kernel blocks the message names)
REFUSED = [
    pytest.param("TURBOQUANT", 256, "turboquant_k8v4", "16, 32, 64, 128", id="tq-256"),
    pytest.param("FLASHINFER_SM90", 128, "auto", "16, 32, 64", id="fi-sm90-128"),
    pytest.param("FLASH_ATTN_FA4", 16, "auto", "128", id="fa4-16"),
    pytest.param("FLASH_ATTN_FA4", 256, "auto", "128", id="fa4-256"),
    pytest.param("FLASH_ATTN", 24, "auto", "any multiple of 16", id="fa-24"),
]

#: The same backends at blocks they run as they are.
ACCEPTED = [
    pytest.param("TURBOQUANT", 128, "turboquant_k8v4", id="tq-128"),
    pytest.param("FLASHINFER_SM90", 64, "auto", id="fi-sm90-64"),
    pytest.param("FLASHINFER_SM100", 128, "auto", id="fi-sm100-128"),
    pytest.param("FLASH_ATTN_FA4", None, "auto", id="fa4-default"),
    pytest.param("FLASH_ATTN", 48, "auto", id="fa-48"),
]


@pytest.mark.parametrize(("backend", "block", "dtype", "sizes"), REFUSED)
def test_unsplittable_block_is_refused_when_the_worker_aligns(
    cuda_configs, backend, block, dtype, sizes
):
    request, config = cuda_configs(BUDGET, block, dtype)
    with backend_context(backend), pytest.raises(PooledViewError) as refused:
        start_worker(request, backend_class(backend), base=config)
    message = str(refused.value)
    name = backend.removesuffix("_FA4").removesuffix("_SM90")
    assert f"attention backend {name} runs kernel blocks of {sizes} tokens" in message
    assert f"keeps the attention block at {block} tokens" in message
    assert "Set --block-size to one of those" in message
    assert "VLLM_KV_CACHE_LAYOUT does not change this" in message
    assert '{"hybrid_kv": {"pooled": false}}' in message


@pytest.mark.parametrize(("backend", "block", "dtype"), ACCEPTED)
def test_block_the_backend_runs_is_allocated(cuda_configs, backend, block, dtype):
    request, config = cuda_configs(BUDGET, block, dtype)
    with backend_context(backend):
        startup = start_worker(request, backend_class(backend), base=config)
        chosen = startup.vllm_config.cache_config.block_size
        assert chosen == (block or 128)
        pooled = plan_engine_core(startup).worker_configs[0]
        layout = KVCacheLayout[startup.vllm_config.cache_config.kv_cache_layout]
        worker = allocate(pooled, startup.backend, layout)
        assert worker.kernel_block_sizes == [chosen, chosen]
        bound = bind_as_runner(worker)
    assert all(bound[name] is view for name, view in worker.kv_caches.items())
    assert check_pooled_views(pooled, worker.kv_caches)


def _without_the_check(monkeypatch) -> None:
    import vllm_hybrid.platforms.hybrid_block_size as alignment

    monkeypatch.setattr(alignment, "check_kernel_blocks", lambda *_: None)


@pytest.mark.parametrize(
    ("backend", "block", "dtype", "upstream_error"),
    [
        pytest.param(
            "TURBOQUANT",
            256,
            "turboquant_k8v4",
            re.escape("VLLM_KV_CACHE_LAYOUT to a layer-compact layout (e.g. LBNHC)"),
            id="tq-256",
        ),
        pytest.param(
            "FLASHINFER_SM90",
            128,
            "auto",
            "cannot be split into",
            id="fi-sm90-128",
        ),
        pytest.param(
            "FLASH_ATTN_FA4", 16, "auto", "No common block size for 16", id="fa4-16"
        ),
    ],
)
def test_without_the_check_upstream_fails_while_binding(
    cuda_configs, monkeypatch, backend, block, dtype, upstream_error
):
    """What the check spares: the plan and the allocation succeed, then the
    metadata builders' kernel block choice or the mapping of bound caches
    raises in the worker (TurboQuant's advice names LBNHC, the layout already
    in use)."""
    _without_the_check(monkeypatch)
    request, config = cuda_configs(BUDGET, block, dtype)
    with backend_context(backend):
        startup = start_worker(request, backend_class(backend), base=config)
        pooled = plan_engine_core(startup).worker_configs[0]
        layout = startup.vllm_config.cache_config.kv_cache_layout
        worker = allocate(pooled, startup.backend, KVCacheLayout[layout])
        assert worker.kernel_block_sizes[0] == block
        with pytest.raises(ValueError, match=upstream_error):
            bind_as_runner(worker)
    assert layout == "LBNHC"


def test_without_the_check_fa4_fails_already_in_cuda_graph_profiling(
    cuda_configs, monkeypatch
):
    """V1's CUDA-graph memory profiling allocates a minimal KV cache through
    upstream's grouping before the engine core plans: attention blocks are
    scaled to cover a state page (16 x 66 = 1,056 tokens here), which FA4's
    128-token kernel cannot split. The alignment check runs before it."""
    import vllm.v1.core.kv_cache_utils as kvu
    from vllm.v1.worker.utils import prepare_kernel_block_sizes

    _without_the_check(monkeypatch)
    request, config = cuda_configs(BUDGET, 16, "auto")
    with backend_context("FLASH_ATTN_FA4"):
        startup = start_worker(request, backend_class("FLASH_ATTN_FA4"), base=config)
        minimal = _profiling_kv_cache(startup, kvu)
        blocks = {g.kv_cache_spec.block_size for g in minimal.kv_cache_groups}
        assert blocks == {16, 1056}
        groups = attention_groups(minimal, startup.backend)
        with pytest.raises(ValueError, match="No common block size for 1056"):
            prepare_kernel_block_sizes(minimal, groups)


def _profiling_kv_cache(startup, kvu) -> KVCacheConfig:
    """``GPUModelRunner._init_minimal_kv_cache_for_profiling``'s config: the
    worker's specs grouped by upstream, one block per captured sequence."""
    config = startup.vllm_config
    resolve_layout(startup)
    cache = config.cache_config
    with current_platform_as(startup.platform()):
        groups = kvu.get_kv_cache_groups(config, startup.specs)
        cache.num_gpu_blocks_override = 128
        try:
            return kvu.get_kv_cache_config_from_groups(config, groups, 0)
        finally:
            cache.num_gpu_blocks_override = None


@pytest.mark.parametrize(
    ("backend", "dtype", "kernel_block"),
    [
        pytest.param("FLASH_ATTN", "auto", 1056, id="fa"),
        pytest.param("FLASHINFER_SM90", "auto", 32, id="fi-sm90"),
        pytest.param("TURBOQUANT", "turboquant_k8v4", 16, id="tq"),
    ],
)
def test_cuda_graph_profiling_kv_cache_is_allocated(
    cuda_configs, backend, dtype, kernel_block
):
    """The minimal single-pool KV cache V1 profiles CUDA graphs with, from
    pooled mode's natural-size specs: upstream's grouping unifies the pages
    (attention blocks scaled, state pages padded) and the worker allocates
    and binds it (kernel blocks split inside dense pages)."""
    import vllm.v1.core.kv_cache_utils as kvu

    request, config = cuda_configs(BUDGET, 16, dtype)
    startup = start_worker(request, backend_class(backend), base=config)
    minimal = _profiling_kv_cache(startup, kvu)
    assert not isinstance(minimal, PooledKVCacheConfig)
    assert minimal.num_blocks == 128
    layout = KVCacheLayout[startup.vllm_config.cache_config.kv_cache_layout]
    worker = allocate(minimal, startup.backend, layout)
    assert sorted(set(worker.kernel_block_sizes)) == sorted({16, kernel_block})
    bind_as_runner(worker)
    size = minimal.kv_cache_tensors[0].size
    for name, view in worker.kv_caches.items():
        first, end = view_runs(name, view).extent
        assert first >= 0 and end <= size


# ---------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------


def _fallback(cuda_configs, layout: str, budget: int):
    import vllm.v1.core.kv_cache_utils as kvu

    request, config = cuda_configs(budget, 16, "auto")
    startup = start_worker(request, backend_class("FLASH_ATTN"), base=config)
    startup.vllm_config.cache_config.kv_cache_layout = layout
    with (
        current_platform_as(startup.platform()),
        captured("vllm.hybrid.v1.core.pooled.engine") as lines,
    ):
        try:
            (plan,) = kvu.get_kv_cache_configs(
                startup.vllm_config, [startup.specs], [budget]
            )
        except ValueError as exc:
            plan = exc
    (line,) = [line for line in lines if "block-compact" in line]
    assert f"got {layout}" in line
    assert "(LBHNC, LBNHC, BLHNC, BLNHC)" in line
    assert "using upstream's single shared KV pool" in line
    return startup, plan


def test_preset_layer_outer_layout_uses_the_single_pool(cuda_configs):
    """LHBNC preset: upstream's single pool expresses it (uniform pages). Its
    attention block is inflated to 1,056 tokens, so one 2,048-token request
    needs more than 256 MiB there; 1 GiB here."""
    startup, plan = _fallback(cuda_configs, "LHBNC", 1024 * MiB)
    assert type(plan) is KVCacheConfig
    worker = allocate(plan, startup.backend, KVCacheLayout.LHBNC)
    size = plan.kv_cache_tensors[0].size
    for name, view in worker.kv_caches.items():
        first, end = view_runs(name, view).extent
        assert first >= 0 and end <= size


def test_preset_block_outer_head_split_layout_gets_upstreams_error(cuda_configs):
    """BHLNC preset: upstream's single pool packs block-outer for mixed pages
    and refuses this layout itself, naming the fix."""
    _, error = _fallback(cuda_configs, "BHLNC", 1024 * MiB)
    assert isinstance(error, ValueError)
    assert "KV cache layout BHLNC cannot express" in str(error)
    assert "VLLM_KV_CACHE_LAYOUT=BLHNC" in str(error)


@pytest.mark.parametrize(
    ("layout", "fault"),
    [
        pytest.param("LHBNC", "outside the arena", id="LHBNC"),
        # heads one block apart: head 1 of a block is the next block's head 0,
        # and the last block's head 1 lies past the arena
        pytest.param("BHLNC", "outside the arena", id="BHLNC"),
    ],
)
def test_pooled_views_in_such_a_layout_would_be_wrong(cuda_configs, layout, fault):
    """Why the fallback: the pooled plan viewed with a layout whose head dim
    sits outside the block dim puts heads in other blocks or past the arena
    (``meta`` tensors do not check bounds; the checker does)."""
    request, config = cuda_configs(BUDGET, 16, "auto")
    startup = start_worker(request, backend_class("FLASH_ATTN"), base=config)
    pooled = plan_engine_core(startup).worker_configs[0]
    worker = allocate(pooled, startup.backend, KVCacheLayout[layout])
    with pytest.raises(PooledViewError, match=fault):
        check_pooled_views(pooled, worker.kv_caches)


def test_plan_tool_reports_the_refusal(qwen36_dir, capsys):
    argv = [str(qwen36_dir), "--device", "cuda", "--kv-cache-memory", str(BUDGET)]
    argv += ["--max-model-len", "2048", "--block-size", "256"]
    argv += ["--kv-cache-dtype", "turboquant_k8v4", "--json"]
    capsys.readouterr()
    assert plan_main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (
        "attention backend TURBOQUANT runs kernel blocks"
        in (printed["pooled"]["error"])
    )
    assert printed["upstream"]["error"] is None
