"""Worker side of the CUDA start-up path: kernel blocks and views.

For every attention backend pooled mode meets on CUDA for a
Qwen3.6-35B-A3B-FP8-shaped model and every KV cache layout upstream resolves
for it, the worker's own functions (``prepare_kernel_block_sizes``,
``allocate_kv_cache``, the metadata builders' kernel block choice and
``map_kv_caches_to_kernel_blocks``) run on the engine core's pooled plan, and
the views are checked at several boundary positions.
"""

from __future__ import annotations

import pytest
from cuda_startup import (
    MiB,
    allocate,
    backend_class,
    backend_context,
    bind_as_runner,
    plan_engine_core,
    resolve_layout,
    start_worker,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_hybrid.v1.core.pooled.spec import PoolKind
from vllm_hybrid.v1.worker.pooled_views import (
    boundary_floors,
    check_pooled_views,
)

BUDGET = 256 * MiB

#: Layouts upstream's resolution accepts for this hybrid, per backend, default
#: first (checked against upstream below). Mixed page shapes restrict every
#: backend to block-compact layouts.
RESOLVED = {
    "FLASH_ATTN": ("LBNHC", "LBHNC", "BLNHC", "BLHNC"),
    # FA4's head-256 kernel on SM100: one 128-token kernel block, preferred
    "FLASH_ATTN_FA4": ("LBNHC", "LBHNC", "BLNHC", "BLHNC"),
    "TRITON_ATTN": ("LBNHC", "LBHNC", "BLNHC", "BLHNC"),
    "FLASHINFER_SM90": ("LBNHC", "LBHNC", "BLNHC", "BLHNC"),
    "FLASHINFER_SM100": ("LBHNC", "BLHNC"),
    "TURBOQUANT": ("LBNHC",),
}
KV_DTYPE = {"TURBOQUANT": "turboquant_k8v4"}
#: --block-size per backend (None: the default, which FA4 raises to 128)
BLOCKS = {"FLASH_ATTN_FA4": (None,)}


@pytest.fixture(autouse=True)
def _as_on_its_gpu(request):
    """Backends answer as on the GPU they stand for, for the whole test."""
    params = getattr(request.node, "callspec", None)
    name = params.params.get("backend", "") if params else ""
    with backend_context(name):
        yield


def _startup(cuda_configs, backend: str, block: int | None, eager: bool):
    request, config = cuda_configs(BUDGET, block, KV_DTYPE.get(backend, "auto"))
    return start_worker(request, backend_class(backend), eager=eager, base=config)


@pytest.mark.parametrize("backend", sorted(RESOLVED))
def test_upstream_resolves_exactly_these_layouts(cuda_configs, monkeypatch, backend):
    block = BLOCKS.get(backend, (16,))[0]
    startup = _startup(cuda_configs, backend, block, eager=False)
    accepted, refused = [], {}
    for layout in KVCacheLayout:
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", layout.name)
        startup.vllm_config.cache_config.kv_cache_layout = None
        try:
            accepted.append(resolve_layout(startup).name)
        except ValueError as exc:
            refused[layout.name] = str(exc)
    assert tuple(accepted) == tuple(sorted(RESOLVED[backend], key=_enum_order))
    # upstream's own refusal names the valid layouts
    for message in refused.values():
        assert "does not satisfy every supported set" in message
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT")
    startup.vllm_config.cache_config.kv_cache_layout = None
    assert resolve_layout(startup).name == RESOLVED[backend][0]


def _enum_order(name: str) -> int:
    return [m.name for m in KVCacheLayout].index(name)


COMBOS = [
    pytest.param(backend, layout, block, eager, id=f"{backend}-{layout}-{block}-{m}")
    for backend, layouts in RESOLVED.items()
    for layout in layouts
    for block in BLOCKS.get(backend, (16, 32))
    for eager, m in ((False, "graphs"), (True, "eager"))
]


@pytest.mark.parametrize(("backend", "layout", "block", "eager"), COMBOS)
def test_views_are_disjoint_and_inside_the_arena(
    cuda_configs, monkeypatch, backend, layout, block, eager
):
    """``eager``: no CUDA graphs on the V1 runner, where the null blocks
    overlap owned blocks (Model Runner V2 writes through state id 0 in
    eager mode too: see the next test)."""
    requested = block
    startup = _startup(cuda_configs, backend, block, eager)
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", layout)
    if eager:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert resolve_layout(startup).name == layout
    config = plan_engine_core(startup).worker_configs[0]
    worker = allocate(config, startup.backend, KVCacheLayout[layout])
    block = startup.vllm_config.cache_config.block_size
    assert block == (128 if backend == "FLASH_ATTN_FA4" else requested)
    # pooled token blocks are never split; the state block is the checkpoint
    assert worker.kernel_block_sizes == [block, block]
    bound = bind_as_runner(worker)
    assert all(bound[name] is view for name, view in worker.kv_caches.items())
    token = config.pool_by_kind(PoolKind.TOKEN)
    state = config.pool_by_kind(PoolKind.STATE)
    for name in config.kv_cache_groups[0].layer_names:
        assert worker.kv_caches[name].shape[0] == token.num_blocks
    for name in config.kv_cache_groups[1].layer_names:
        assert worker.kv_caches[name].shape[0] == state.num_blocks
    layout_geometry = config.layout
    checks = check_pooled_views(config, worker.kv_caches)
    assert [c.state_floor for c in checks] == list(boundary_floors(layout_geometry))
    assert checks[0].state_floor == layout_geometry.min_state_floor
    assert checks[-1].state_floor == layout_geometry.max_state_floor
    for check in checks:
        # one dense run per layer and block: every layout keeps a page whole
        assert check.owned_runs == 10 * len(check.token_ids) + 30 * len(check.state_ids)
        assert check.null_runs == (0 if eager else 40)
        assert len(check.token_ids) > 0 and len(check.state_ids) >= 1


def test_eager_on_model_runner_v2_keeps_the_null_region_clear(
    cuda_configs, monkeypatch
):
    """vLLM's CUDA default runner without CUDA graphs: the plan reserves the
    null region as with graphs (40 layer pages of the null blocks, clear of
    owned blocks), and the token pool starts after one state block."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    startup = _startup(cuda_configs, "FLASH_ATTN", 16, eager=True)
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBNHC")
    resolve_layout(startup)
    config = plan_engine_core(startup).worker_configs[0]
    assert not config.layout.null_blocks_overlap
    assert config.layout.first_token_id == 197
    worker = allocate(config, startup.backend, KVCacheLayout.LBNHC)
    checks = check_pooled_views(config, worker.kv_caches)
    assert [c.null_runs for c in checks] == [40] * len(checks)


def test_flashinfer_stand_ins_answer_like_the_real_class():
    """Where FlashInfer is installed (GPU hosts), its class reports what the
    stand-ins report: kernel blocks without a model config (no trtllm-gen
    large pages), layouts by the device's generation."""
    pytest.importorskip("flashinfer")
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend

    hopper = backend_class("FLASHINFER_SM90")
    assert FlashInferBackend.get_name() == hopper.get_name()
    sizes = FlashInferBackend.get_supported_kernel_block_sizes()
    assert sizes == hopper.get_supported_kernel_block_sizes()
    capability = current_platform.get_device_capability()
    generation = "FLASHINFER_SM100" if capability and capability.major == 10 else None
    stand_in = backend_class(generation) if generation else hopper
    assert (
        FlashInferBackend.supported_kv_cache_layouts()
        == stand_in.supported_kv_cache_layouts()
    )
