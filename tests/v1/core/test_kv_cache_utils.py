"""Tests of the hybrid-aware KV cache helpers.

Specs are built directly, as in upstream's tests/v1/core/test_kv_cache_utils.py.
Where the overlay fixes upstream behaviour, a test runs against both the
overlay's function and upstream's original; the upstream case is a strict
xfail, so the fix is shown to be needed and the test to be able to fail.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    compute_layout_strides,
    get_kv_quant_mode,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import Request

import vllm_hybrid.v1.core.kv_cache_utils as hybrid
from vllm_hybrid.config.hybrid_kv import HybridKVOptions, PageUnificationLimits
from vllm_hybrid.patches import registry
from vllm_hybrid.v1.core import page_unification, token_capacity
from vllm_hybrid.v1.worker import routed_experts

UPSTREAM = "vllm.v1.core.kv_cache_utils"
GiB = 1 << 30


# ---------------------------------------------------------------------------
# Spec builders
# ---------------------------------------------------------------------------


def attention_spec(
    block_size: int = 16,
    num_kv_heads: int = 2,
    head_size: int = 256,
    dtype: torch.dtype = torch.bfloat16,
) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
    )


def turboquant_spec(block_size: int = 16) -> FullAttentionSpec:
    """A TurboQuant k8v4 page built the way the TurboQuant backend builds it."""
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=2,
        head_size=256,
        dtype=torch.uint8,
        kv_quant_mode=get_kv_quant_mode("turboquant_k8v4"),
    )
    return TurboQuantAttentionBackend.customize_spec(spec)


def gdn_spec(
    ssm_dtype: torch.dtype = torch.bfloat16,
    block_size: int = 16,
    mode: str = "align",
) -> MambaSpec:
    """A Qwen3.5 GDN state page (16 key heads, 32 value heads, dims 128)."""
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, 16, 32, 128, 128, 4
    )
    return MambaSpec(
        block_size=block_size,
        shapes=shapes,
        dtypes=(torch.bfloat16, ssm_dtype),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=mode,
    )


def mla_spec(block_size: int = 16) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
    )


def hybrid_layers(
    attention: KVCacheSpec, state: KVCacheSpec | None, n_attention: int = 2
) -> dict[str, KVCacheSpec]:
    """A Qwen3.5-like stack: every fourth layer is attention, the rest state."""
    specs: dict[str, KVCacheSpec] = {}
    for i in range(4 * n_attention):
        if i % 4 == 3:
            specs[f"model.layers.{i}.self_attn.attn"] = attention
        elif state is not None:
            specs[f"model.layers.{i}.linear_attn"] = state
    return specs


def assert_kernel_split_legal(spec: KVCacheSpec, kernel_block_size: int) -> None:
    """Raises (AssertionError) when the page cannot hold kernel blocks."""
    compute_layout_strides(
        spec,
        num_blocks=4,
        num_layers=2,
        layout=KVCacheLayout.LBNHC,
        kernel_block_size=kernel_block_size,
    )


# ---------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------


@pytest.fixture
def vllm_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog that also sees the ``vllm`` tree when vLLM stops propagation."""
    vllm_logger = logging.getLogger("vllm")
    caplog.set_level(logging.INFO, logger="vllm")
    attach = not vllm_logger.propagate
    if attach:
        vllm_logger.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        if attach:
            vllm_logger.removeHandler(caplog.handler)


@pytest.fixture(scope="module")
def dense_config(tiny_model_dir: Callable[[str], Path]) -> VllmConfig:
    """A real VllmConfig (dense tiny model, max_model_len 4096)."""
    model = ModelConfig(model=str(tiny_model_dir("dense")), max_model_len=4096)
    return VllmConfig(model_config=model)


@pytest.fixture(scope="module")
def moe_config(tiny_model_dir: Callable[[str], Path]) -> VllmConfig:
    """The tiny qwen3_5 MoE hybrid: 8 layers, 4 experts, top-2, prefix caching."""
    model = ModelConfig(model=str(tiny_model_dir("qwen3_5")), max_model_len=4096)
    return VllmConfig(
        model_config=model, cache_config=CacheConfig(enable_prefix_caching=True)
    )


@pytest.fixture
def patched() -> Iterator[None]:
    """The overlay's registry applied for one test (left as found)."""
    already_applied = bool(registry.applied())
    registry.apply_all()
    try:
        yield
    finally:
        if not already_applied:
            registry.revert_all()


def overlay_unify(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    return hybrid.unify_kv_cache_spec_page_size(specs)


def upstream_unify(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    return registry.upstream(f"{UPSTREAM}:unify_kv_cache_spec_page_size")(specs)


def _upstream_fails(reason: str, raises: type[Exception] | None = None):
    return pytest.param(
        upstream_unify,
        id="upstream",
        marks=pytest.mark.xfail(strict=True, reason=reason, raises=raises),
    )


# ---------------------------------------------------------------------------
# Page size unification
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "specs",
    [
        pytest.param({"a": attention_spec(), "b": attention_spec()}, id="equal"),
        pytest.param(
            {"a": attention_spec(), "b": attention_spec(num_kv_heads=1)},
            id="attention-divides",
        ),
        pytest.param(
            {
                "a": attention_spec(block_size=544),
                "m": gdn_spec(),
                "w": attention_spec(num_kv_heads=1),
            },
            id="state-padded-attention-divides",
        ),
        pytest.param(
            {"a": mla_spec(block_size=64), "b": mla_spec(block_size=16)},
            id="mla-divides",
        ),
    ],
)
def test_unify_fast_path_returns_upstream_specs(
    specs: dict[str, KVCacheSpec],
) -> None:
    assert overlay_unify(dict(specs)) == upstream_unify(dict(specs))


def test_unify_fast_path_numbers() -> None:
    """The divisible case scales blocks and pads the state page, as upstream."""
    specs = {
        "a": attention_spec(block_size=544),
        "m": gdn_spec(),
        "w": attention_spec(num_kv_heads=1),
    }
    unified = overlay_unify(specs)
    assert unified["a"] is specs["a"]
    assert unified["w"].block_size == 16 * 68
    assert unified["m"].page_size_bytes == 1_114_112
    assert unified["m"].page_size_padded == 1_114_112


@pytest.mark.parametrize(
    "unify",
    [
        pytest.param(overlay_unify, id="overlay"),
        _upstream_fails("upstream pads the TurboQuant page 88x instead"),
    ],
)
def test_turboquant_next_to_gdn_state(unify) -> None:
    tq, gdn = turboquant_spec(), gdn_spec()
    assert tq.page_size_bytes == 12_416
    assert gdn.page_size_bytes == 1_097_728
    assert gdn.page_size_bytes % tq.page_size_bytes != 0

    unified = unify(hybrid_layers(tq, gdn))

    attn = unified["model.layers.3.self_attn.attn"]
    state = unified["model.layers.0.linear_attn"]
    # 89 TurboQuant pages of 16 tokens; the GDN page is padded by 7,296 B.
    assert attn.block_size == 16 * 89 == 1424
    assert attn.page_size_padded is None
    assert attn.page_size_bytes == state.page_size_bytes == 1_105_024
    assert state.page_size_padded == 1_105_024
    assert_kernel_split_legal(attn, kernel_block_size=16)


def test_turboquant_plan_padding_is_below_one_percent() -> None:
    plan = page_unification.plan_page_size_unification(
        hybrid_layers(turboquant_spec(), gdn_spec())
    )
    assert plan.scalable_lcm == 12_416
    assert plan.state_padding == {
        f"model.layers.{i}.linear_attn": 7_296 for i in (0, 1, 2, 4, 5, 6)
    }
    assert plan.max_padding_pct == pytest.approx(0.6603, abs=1e-4)
    assert plan.page_growth == pytest.approx(1_105_024 / 1_097_728)


def small_state_spec(block_size: int = 16) -> MambaSpec:
    """A state page far below the attention pages (384 B), so that the
    attention pages decide the common page of a hybrid stack."""
    return MambaSpec(block_size=block_size, shapes=((3, 64),), dtypes=(torch.bfloat16,))


def _overlay_unify_lifted(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """The overlay's unification with both limits at 100."""
    lifted = PageUnificationLimits(max_page_padding_pct=100, max_page_growth=100)
    return hybrid.unify_kv_cache_spec_page_size(specs, lifted)


@pytest.mark.parametrize(
    "unify",
    [
        pytest.param(_overlay_unify_lifted, id="overlay"),
        _upstream_fails("upstream pads the TurboQuant pages to the bf16 page"),
    ],
)
def test_bf16_skip_layers_next_to_turboquant(unify) -> None:
    """Skip layers keep bf16 pages next to TurboQuant ones in a hybrid stack:
    lcm(12,416, 32,768) = 3,178,496 B (97x the bf16 page); the state page is
    the only one padded (limits lifted as ``--additional-config`` would)."""
    specs = {
        "model.layers.0.self_attn.attn": attention_spec(),
        "model.layers.1.self_attn.attn": turboquant_spec(),
        "model.layers.2.self_attn.attn": turboquant_spec(),
        "model.layers.3.self_attn.attn": attention_spec(),
        "model.layers.4.linear_attn": small_state_spec(),
    }
    unified = unify(specs)

    skip, tq = (
        unified["model.layers.0.self_attn.attn"],
        unified["model.layers.1.self_attn.attn"],
    )
    assert skip.block_size == 16 * 97
    assert tq.block_size == 16 * 256
    assert skip.page_size_bytes == tq.page_size_bytes == 3_178_496
    assert skip.page_size_padded is None and tq.page_size_padded is None
    assert unified["model.layers.4.linear_attn"].page_size_bytes == 3_178_496
    assert_kernel_split_legal(tq, kernel_block_size=16)


def test_plan_beyond_the_limits_falls_back_to_upstreams_padding(
    vllm_log: pytest.LogCaptureFixture,
) -> None:
    """With a state page the 3,178,496 B common page pads GDN by 65.46%, beyond
    the default 2%: upstream's unification (the bf16 and TurboQuant pages
    padded to the GDN page) is used, with one line naming the option that
    accepts the LCM plan."""
    specs = {
        "model.layers.0.linear_attn": gdn_spec(),
        "model.layers.1.self_attn.attn": attention_spec(),
        "model.layers.2.self_attn.attn": turboquant_spec(),
    }
    unified = overlay_unify(dict(specs))
    assert unified == upstream_unify(dict(specs))
    assert {s.page_size_bytes for s in unified.values()} == {1_097_728}
    lines = [
        r.getMessage() for r in vllm_log.records if "beyond its limits" in r.message
    ]
    assert len(lines) == 1
    assert "65.46%" in lines[0] and "using upstream's page unification" in lines[0]
    assert '"max_page_padding_pct": 65.47' in lines[0]
    # Growth stays within the default: 3,178,496 / 1,097,728 = 2.9x.
    assert "max_page_growth" not in lines[0]

    accepted = hybrid.unify_kv_cache_spec_page_size(
        specs, PageUnificationLimits(max_page_padding_pct=65.47)
    )
    assert {s.page_size_bytes for s in accepted.values()} == {3_178_496}


def test_plan_beyond_the_limits_fails_where_upstream_gives_up_too() -> None:
    """MLA (18,432 B) next to GDN: upstream cannot pad MLA; the LCM plan pads
    GDN by 0.74%, beyond a 0.5% limit: start-up fails naming the option."""
    specs = {"model.layers.0.linear_attn": gdn_spec(), "mla": mla_spec()}
    with pytest.raises(page_unification.PageSizeUnificationError) as info:
        hybrid.unify_kv_cache_spec_page_size(
            specs, PageUnificationLimits(max_page_padding_pct=0.5)
        )
    message = str(info.value)
    assert "0.74%" in message and '"max_page_padding_pct": 0.75' in message
    assert "1,097,728 B per page, MambaSpec x1" in message


def test_plan_with_blocks_longer_than_max_model_len_keeps_upstreams_plan(
    vllm_log: pytest.LogCaptureFixture,
) -> None:
    """Within the padding limit the LCM plan gives the TurboQuant layer
    4,096-token blocks (16 x 256); with max_model_len 2,048 no request ever
    fills one, so upstream's plan is used, and the warning offers no option
    (none accepts such blocks)."""
    specs = {
        "model.layers.0.linear_attn": gdn_spec(),
        "model.layers.1.self_attn.attn": attention_spec(),
        "model.layers.2.self_attn.attn": turboquant_spec(),
    }
    roomy = PageUnificationLimits(max_page_padding_pct=65.47, max_block_tokens=4096)
    lcm = hybrid.unify_kv_cache_spec_page_size(dict(specs), roomy)
    assert max(s.block_size for s in lcm.values()) == 4096

    short = PageUnificationLimits(max_page_padding_pct=65.47, max_block_tokens=2048)
    unified = hybrid.unify_kv_cache_spec_page_size(dict(specs), short)
    assert unified == upstream_unify(dict(specs))
    lines = [
        r.getMessage() for r in vllm_log.records if "beyond its limits" in r.message
    ]
    assert len(lines) == 1
    assert (
        "layer model.layers.2.self_attn.attn would get blocks of 4,096 tokens, "
        "longer than max_model_len (2,048)"
    ) in lines[0]
    assert "To use the LCM plan" not in lines[0]


def test_long_blocks_are_kept_where_upstream_has_no_plan() -> None:
    """MLA next to GDN: upstream cannot unify; 960-token MLA blocks beyond a
    512-token max_model_len still beat no engine."""
    specs = {"model.layers.0.linear_attn": gdn_spec(), "mla": mla_spec()}
    unified = hybrid.unify_kv_cache_spec_page_size(
        dict(specs), PageUnificationLimits(max_block_tokens=512)
    )
    assert unified["mla"].block_size == 960
    assert len({s.page_size_bytes for s in unified.values()}) == 1


def test_max_model_len_bounds_blocks_of_the_planning_in_progress(
    moe_config: VllmConfig,
) -> None:
    token = hybrid._planning_config.set(moe_config)
    try:
        limits = hybrid.page_unification_limits()
    finally:
        hybrid._planning_config.reset(token)
    assert limits.max_block_tokens == 4096
    assert HybridKVOptions().page_limits.max_block_tokens is None


@pytest.mark.parametrize(
    "unify",
    [
        pytest.param(overlay_unify, id="overlay"),
        _upstream_fails("MLA is not padded", raises=NotImplementedError),
    ],
)
def test_mla_next_to_non_divisible_state_page(unify) -> None:
    mla, gdn = mla_spec(), gdn_spec()
    assert mla.page_size_bytes == 18_432
    unified = unify(hybrid_layers(mla, gdn))

    attn = unified["model.layers.3.self_attn.attn"]
    state = unified["model.layers.0.linear_attn"]
    assert attn.block_size == 16 * 60
    assert attn.page_size_padded is None
    assert state.page_size_bytes == attn.page_size_bytes == 18_432 * 60


def _outcome(unify, specs: dict[str, KVCacheSpec]):
    try:
        return unify(dict(specs))
    except NotImplementedError as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize(
    "specs",
    [
        pytest.param({"mla": mla_spec(), "attn": attention_spec()}, id="mla+attn"),
        pytest.param(
            {"skip": attention_spec(), "tq": turboquant_spec()}, id="bf16+turboquant"
        ),
        pytest.param(
            {
                "a": attention_spec(num_kv_heads=1, head_size=97),
                "b": attention_spec(num_kv_heads=1, head_size=101),
            },
            id="heads-97+101",
        ),
        pytest.param(
            {
                "skip": replace(attention_spec(), page_size_padded=3 * 12_416),
                "tq": turboquant_spec(block_size=32),
            },
            id="padded+turboquant",
        ),
        pytest.param(
            {"a": attention_spec(head_size=192), "b": attention_spec(head_size=128)},
            id="draft-head-192+128",
        ),
    ],
)
def test_attention_only_mixes_keep_upstreams_result(specs) -> None:
    """Models without state layers are planned exactly as upstream plans
    them: its padding where it pads, its error (and so its grouping
    fallback) where it gives up; no LCM block scaling."""
    assert _outcome(overlay_unify, specs) == _outcome(upstream_unify, specs)


def test_already_padded_attention_page_scales_with_its_padding() -> None:
    """A page padded upstream of here (e.g. skip layers) keeps its padding
    ratio in a hybrid stack."""
    padded = replace(attention_spec(), page_size_padded=3 * 12_416)
    tq = turboquant_spec(block_size=32)  # 24,832 B
    specs = {"skip": padded, "tq": tq, "state": small_state_spec(block_size=32)}
    unified = hybrid.unify_kv_cache_spec_page_size(
        specs, PageUnificationLimits(max_page_padding_pct=100)
    )
    # lcm(37,248, 24,832) = 74,496 B: the padded page doubles, TQ blocks triple.
    assert unified["skip"].block_size == 32
    assert unified["skip"].page_size_padded == 74_496
    assert unified["tq"].block_size == 96
    assert unified["tq"].page_size_padded is None
    assert unified["state"].page_size_bytes == 74_496


def test_absurd_lcm_with_state_page_names_both_options() -> None:
    specs = {
        "model.layers.0.linear_attn": gdn_spec(),
        "model.layers.1.self_attn.attn": attention_spec(num_kv_heads=1, head_size=97),
        "model.layers.2.self_attn.attn": attention_spec(num_kv_heads=1, head_size=101),
    }
    limits = PageUnificationLimits(max_page_padding_pct=1, max_page_growth=1)
    plan = page_unification.plan_page_size_unification(specs)
    violations = page_unification.page_plan_violations(plan, limits)
    assert violations is not None
    # 2 x 627,008 = 1,254,016 B; GDN padding 156,288 B = 12.46%; growth 1.14x.
    assert plan.page_size == 1_254_016
    problems = "; ".join(violations.problems)
    assert "12.46%" in problems and "1.14x" in problems
    hint = violations.accept_hint()
    assert '"max_page_padding_pct": 12.47, "max_page_growth": 1.15' in hint
    # upstream pads both attention pages to the GDN page: its plan is used
    unified = hybrid.unify_kv_cache_spec_page_size(dict(specs), limits)
    assert unified == upstream_unify(dict(specs))


def test_unification_error_keeps_upstream_fallback_contract() -> None:
    """get_kv_cache_groups catches NotImplementedError to try its fallback."""
    assert issubclass(page_unification.PageSizeUnificationError, NotImplementedError)


def test_padding_is_logged_once_at_info(vllm_log: pytest.LogCaptureFixture) -> None:
    specs = hybrid_layers(turboquant_spec(block_size=32), gdn_spec(torch.float32))
    for _ in range(2):
        hybrid.unify_kv_cache_spec_page_size(dict(specs))
    padding = [r for r in vllm_log.records if "padded 6 state layer(s)" in r.message]
    assert len(padding) == 1
    assert padding[0].levelno == logging.INFO
    # fp32 GDN page 2,146,304 B; 87 TQ pages of 32 tokens = 2,160,384 B.
    assert "2,160,384 B" in padding[0].getMessage()
    assert "(0.65% of the page)" in padding[0].getMessage()


# -- limits ------------------------------------------------------------------


def test_limits_default_and_additional_config() -> None:
    assert HybridKVOptions.from_vllm_config(None).page_limits == (
        PageUnificationLimits(2.0, 16.0)
    )
    config = VllmConfig(
        additional_config={
            "hybrid_kv": {"max_page_padding_pct": 3, "max_page_growth": 64}
        }
    )
    assert HybridKVOptions.from_vllm_config(config).page_limits == (
        PageUnificationLimits(3.0, 64.0)
    )


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"max_page_padding_pct": 101}, "hybrid_kv.max_page_padding_pct=101"),
        ({"max_page_growth": 0.5}, "hybrid_kv.max_page_growth=0.5"),
        ({"max_page_growth": "lots"}, "hybrid_kv.max_page_growth='lots'"),
    ],
)
def test_invalid_limits_name_their_source(options, needle) -> None:
    config = VllmConfig(additional_config={"hybrid_kv": options})
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        HybridKVOptions.from_vllm_config(config)


def test_additional_config_reaches_unification_through_get_kv_cache_groups(
    patched: None,
) -> None:
    """Upstream calls the unification without the config; the wrapper fills in."""
    import vllm.v1.core.kv_cache_utils as kv_cache_utils

    specs = {
        "model.layers.0.linear_attn": gdn_spec(),
        "model.layers.1.self_attn.attn": attention_spec(),
        "model.layers.2.self_attn.attn": turboquant_spec(),
    }

    def planning_config(**additional_config) -> VllmConfig:
        config = VllmConfig(additional_config=additional_config)
        config.cache_config.kv_cache_layout = "LBNHC"  # the engine core resolves it
        return config

    strict = planning_config()
    groups = kv_cache_utils.get_kv_cache_groups(strict, dict(specs))
    # beyond the default padding limit: upstream's unification, GDN's page
    assert {g.kv_cache_spec.page_size_bytes for g in groups} == {1_097_728}

    relaxed = planning_config(hybrid_kv={"max_page_padding_pct": 65.47})
    groups = kv_cache_utils.get_kv_cache_groups(relaxed, dict(specs))
    assert {g.kv_cache_spec.page_size_bytes for g in groups} == {3_178_496}
    assert sorted(g.kv_cache_spec.block_size for g in groups) == [16, 1552, 4096]


# ---------------------------------------------------------------------------
# Token capacity
# ---------------------------------------------------------------------------

ATTN = attention_spec(block_size=256)  # 524,288 B per page
NONE_STATE = MambaSpec(
    block_size=1 << 20,
    shapes=((3, 1024), (4, 128, 128)),
    dtypes=(torch.bfloat16, torch.float32),
    page_size_padded=ATTN.page_size_bytes,
    mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    mamba_cache_mode="none",
)
ALIGN_STATE = MambaSpec(
    block_size=256,
    shapes=((3, 1024), (4, 128, 128)),
    dtypes=(torch.bfloat16, torch.float32),
    page_size_padded=ATTN.page_size_bytes,
    mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    mamba_cache_mode="align",
)


def kv_config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
    )


def upstream_capacity(vllm_config: VllmConfig, config: KVCacheConfig):
    return registry.upstream(f"{UPSTREAM}:get_kv_cache_capacity")(vllm_config, config)


def upstream_update(vllm_config: VllmConfig, config: KVCacheConfig) -> None:
    registry.upstream(f"{UPSTREAM}:update_kv_cache_capacity")(vllm_config, config)


@pytest.mark.parametrize(
    ("specs", "expected"),
    [
        pytest.param((ATTN,), [0], id="dense"),
        pytest.param((ATTN, NONE_STATE, NONE_STATE, NONE_STATE), [0], id="1+3"),
        pytest.param((NONE_STATE, ATTN), [1], id="1+1"),
        pytest.param((NONE_STATE, NONE_STATE), [0, 1], id="state-only"),
        pytest.param((), [], id="empty"),
        pytest.param(
            (
                attention_spec(block_size=64),
                SlidingWindowSpec(
                    block_size=64,
                    num_kv_heads=2,
                    head_size=256,
                    dtype=torch.bfloat16,
                    sliding_window=128,
                ),
                ChunkedLocalAttentionSpec(
                    block_size=64,
                    num_kv_heads=2,
                    head_size=256,
                    dtype=torch.bfloat16,
                    attention_chunk_size=128,
                ),
                mla_spec(block_size=64),
                SlidingWindowMLASpec(
                    block_size=64,
                    num_kv_heads=1,
                    head_size=576,
                    dtype=torch.bfloat16,
                    sliding_window=128,
                ),
                CrossAttentionSpec(
                    block_size=64, num_kv_heads=2, head_size=256, dtype=torch.bfloat16
                ),
                CircularBufferSpec(
                    block_size=64, num_kv_heads=2, head_size=256, dtype=torch.bfloat16
                ),
                NONE_STATE,
            ),
            [0, 1, 2, 3, 4],
            id="spec-kinds",
        ),
    ],
)
def test_token_capacity_kv_cache_groups(
    dense_config: VllmConfig, specs, expected: list[int]
) -> None:
    config = kv_config(100, *specs)
    groups = token_capacity.token_capacity_kv_cache_groups(dense_config, config)
    assert [config.kv_cache_groups.index(g) for g in groups] == expected


def test_uniform_type_group_is_classified_by_its_layers() -> None:
    uniform = UniformTypeKVCacheSpecs(
        block_size=16, kv_cache_specs={"a": attention_spec(), "b": attention_spec()}
    )
    assert token_capacity.is_token_capacity_spec(uniform)
    assert not token_capacity.is_token_capacity_spec(
        UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={})
    )


CAPACITY_FNS = [
    pytest.param(hybrid.get_kv_cache_capacity, id="overlay"),
    pytest.param(
        upstream_capacity,
        id="upstream",
        marks=pytest.mark.xfail(strict=True, reason="upstream weighs state groups"),
    ),
]


@pytest.mark.parametrize("capacity", CAPACITY_FNS)
@pytest.mark.parametrize(
    ("specs", "mode", "expected"),
    [
        # (100 blocks - null - 3 state) x 256 tokens
        pytest.param(
            (ATTN, NONE_STATE, NONE_STATE, NONE_STATE), "none", 24_576, id="1+3"
        ),
        pytest.param((NONE_STATE, ATTN), "none", 25_088, id="1+1"),
        # align: each state group holds up to 2 blocks per request
        pytest.param(
            (ATTN, ALIGN_STATE, ALIGN_STATE, ALIGN_STATE),
            "align",
            23_808,
            id="1+3-align",
        ),
        # two token groups share the pool: (99 - 3) // 2 x 256
        pytest.param(
            (ATTN, ATTN, NONE_STATE, NONE_STATE, NONE_STATE), "none", 12_288, id="2+3"
        ),
    ],
)
def test_hybrid_token_capacity(
    dense_config: VllmConfig,
    monkeypatch: pytest.MonkeyPatch,
    capacity,
    specs,
    mode: str,
    expected: int,
) -> None:
    monkeypatch.setattr(dense_config.cache_config, "mamba_cache_mode", mode)
    tokens, _ = capacity(dense_config, kv_config(100, *specs))
    assert tokens == expected


def test_hybrid_max_concurrency_still_counts_every_group(
    dense_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dense_config.cache_config, "mamba_cache_mode", "none")
    config = kv_config(100, ATTN, NONE_STATE, NONE_STATE, NONE_STATE)
    _, concurrency = hybrid.get_kv_cache_capacity(dense_config, config)
    # 4096 tokens = 16 attention blocks + 3 state blocks per request.
    assert concurrency == pytest.approx(100 / 19)
    assert concurrency == upstream_capacity(dense_config, config)[1]


def _fits(config: KVCacheConfig, num_tokens: int) -> bool:
    """Whether upstream's KV cache manager admits one request of that length."""
    manager = KVCacheManager(
        config,
        max_model_len=1 << 20,
        scheduler_block_size=1 << 20,
        hash_block_size=1 << 20,
        enable_caching=False,
    )
    request = Request("r", list(range(num_tokens)), SamplingParams(max_tokens=1), None)
    return manager.allocate_slots(request, num_tokens) is not None


@pytest.mark.parametrize("capacity", CAPACITY_FNS)
@pytest.mark.parametrize("num_state_groups", [1, 3])
def test_token_capacity_is_what_one_request_fits(
    dense_config: VllmConfig,
    monkeypatch: pytest.MonkeyPatch,
    capacity,
    num_state_groups: int,
) -> None:
    monkeypatch.setattr(dense_config.cache_config, "mamba_cache_mode", "none")
    config = kv_config(100, ATTN, *([NONE_STATE] * num_state_groups))
    tokens, _ = capacity(dense_config, config)
    assert _fits(config, tokens)
    assert not _fits(config, tokens + 1)


def test_mixed_block_sizes_match_brute_force(
    dense_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dense_config.cache_config, "mamba_cache_mode", "none")
    a, b = attention_spec(block_size=48), attention_spec(block_size=80)
    config = kv_config(50, a, b, NONE_STATE)
    tokens = hybrid.kv_cache_token_capacity(dense_config, config)
    fitting = [t for t in range(10_000) if -(-t // 48) + -(-t // 80) <= 50 - 1 - 1]
    assert tokens == max(fitting) == 1440


@pytest.mark.parametrize(
    "specs",
    [
        pytest.param((ATTN,), id="dense"),
        pytest.param(
            (
                ATTN,
                SlidingWindowSpec(
                    block_size=256,
                    num_kv_heads=2,
                    head_size=256,
                    dtype=torch.bfloat16,
                    sliding_window=1024,
                ),
            ),
            id="full+swa",
        ),
        pytest.param((NONE_STATE, NONE_STATE), id="state-only"),
    ],
)
def test_models_without_state_groups_keep_upstream_capacity(
    dense_config: VllmConfig, specs
) -> None:
    config = kv_config(1001, *specs)
    assert hybrid.get_kv_cache_capacity(dense_config, config) == upstream_capacity(
        dense_config, config
    )
    upstream_update(dense_config, config)
    expected = (
        dense_config.cache_config.kv_cache_size_tokens,
        dense_config.cache_config.kv_cache_max_concurrency,
    )
    hybrid.update_kv_cache_capacity(dense_config, config)
    cache = dense_config.cache_config
    assert (cache.kv_cache_size_tokens, cache.kv_cache_max_concurrency) == expected


def test_empty_config_has_no_capacity(dense_config: VllmConfig) -> None:
    config = kv_config(10)
    assert token_capacity.token_capacity_kv_cache_groups(dense_config, config) == []
    assert hybrid.kv_cache_token_capacity(dense_config, config) == 0


@pytest.mark.parametrize(
    "update",
    [
        pytest.param(hybrid.update_kv_cache_capacity, id="overlay"),
        pytest.param(
            upstream_update,
            id="upstream",
            marks=pytest.mark.xfail(strict=True, reason="upstream weighs state groups"),
        ),
    ],
)
def test_update_kv_cache_capacity_stores_and_logs_token_groups(
    dense_config: VllmConfig,
    monkeypatch: pytest.MonkeyPatch,
    vllm_log: pytest.LogCaptureFixture,
    update,
) -> None:
    monkeypatch.setattr(dense_config.cache_config, "mamba_cache_mode", "none")
    # 997 blocks: distinct from other tests, so the info_once line is emitted.
    config = kv_config(997, ATTN, NONE_STATE, NONE_STATE, NONE_STATE)
    update(dense_config, config)
    assert dense_config.cache_config.kv_cache_size_tokens == (997 - 1 - 3) * 256
    assert dense_config.cache_config.kv_cache_max_concurrency == pytest.approx(997 / 19)
    lines = [r.getMessage() for r in vllm_log.records if "KV cache size" in r.message]
    assert len(lines) == 1
    assert "KV cache size: 254,208 tokens" in lines[0]
    assert "counting only the 1 of 4 KV cache groups" in lines[0]
    assert "hold 3 block(s) per request" in lines[0]


# ---------------------------------------------------------------------------
# Routed-experts store
# ---------------------------------------------------------------------------

#: tiny qwen3_5: 8 layers x top-2 x 1-byte ids (4 experts).
ROUTING_BYTES_PER_TOKEN = 16


def upstream_default_store_bytes(vllm_config: VllmConfig, config: KVCacheConfig):
    """The default AuxOutputWorkerConnector computes when max_bytes is unset."""
    import vllm.v1.core.kv_cache_utils as kv_cache_utils

    scheduler_block, hash_block = kv_cache_utils.resolve_kv_cache_block_sizes(
        config, vllm_config
    )
    per_hash_block = hash_block * ROUTING_BYTES_PER_TOKEN
    return config.num_blocks * (scheduler_block // hash_block) * per_hash_block


@pytest.fixture
def store_config(moe_config: VllmConfig, monkeypatch: pytest.MonkeyPatch) -> VllmConfig:
    """moe_config with the block size the engine core adopts from the specs."""
    monkeypatch.setattr(moe_config.cache_config, "block_size", 256)
    return moe_config


def test_routing_bytes_per_token(moe_config: VllmConfig) -> None:
    assert (
        routed_experts.routed_experts_bytes_per_token(moe_config)
        == ROUTING_BYTES_PER_TOKEN
    )


@pytest.mark.parametrize(
    "specs",
    [
        pytest.param((ATTN,), id="dense"),
        pytest.param((ATTN, ALIGN_STATE, ALIGN_STATE, ALIGN_STATE), id="hybrid-align"),
    ],
)
def test_store_matches_upstream_when_block_sizes_agree(
    store_config: VllmConfig, specs
) -> None:
    config = kv_config(100, *specs)
    expected = 100 * 256 * ROUTING_BYTES_PER_TOKEN
    assert routed_experts.routed_experts_store_bytes(store_config, config) == expected
    assert upstream_default_store_bytes(store_config, config) == expected


STORE_FNS = [
    pytest.param(routed_experts.routed_experts_store_bytes, id="overlay"),
    pytest.param(
        upstream_default_store_bytes,
        id="upstream",
        marks=pytest.mark.xfail(strict=True, reason="sized by the scheduler LCM"),
    ),
]


@pytest.mark.parametrize("store_bytes", STORE_FNS)
def test_store_ignores_state_block_sizes(
    store_config: VllmConfig, monkeypatch: pytest.MonkeyPatch, store_bytes
) -> None:
    """State groups in "none" mode make the scheduler block 4096 tokens."""
    monkeypatch.setattr(store_config.cache_config, "mamba_cache_mode", "none")
    state = MambaSpec(
        block_size=4096,
        shapes=NONE_STATE.shapes,
        dtypes=NONE_STATE.dtypes,
        page_size_padded=ATTN.page_size_bytes,
    )
    config = kv_config(100, ATTN, state, state, state)
    # 25,600 slots in whole hash blocks of 4096 tokens: 7 objects.
    assert store_bytes(store_config, config) == 7 * 4096 * ROUTING_BYTES_PER_TOKEN


@pytest.mark.parametrize("store_bytes", STORE_FNS)
def test_store_covers_the_largest_token_block(
    store_config: VllmConfig, store_bytes
) -> None:
    """Unified TurboQuant/bf16 blocks (4096/1552) next to GDN blocks of 16."""
    tq = turboquant_spec(block_size=4096)
    skip = attention_spec(block_size=1552)
    state = replace(gdn_spec(block_size=16), page_size_padded=tq.page_size_bytes)
    config = kv_config(100, tq, skip, state)
    # Upstream: lcm(4096, 1552, 16) = 397,312 tokens per block, 97x more.
    assert store_bytes(store_config, config) == 100 * 4096 * ROUTING_BYTES_PER_TOKEN


def test_apply_store_bytes_only_when_enabled_and_unset(
    store_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    aux = store_config.aux_output_config
    config = kv_config(100, ATTN, ALIGN_STATE)
    assert routed_experts.apply_routed_experts_store_bytes(store_config, config) is None
    assert aux.max_bytes is None

    monkeypatch.setattr(aux, "enable_return_routed_experts", True)
    monkeypatch.setattr(aux, "max_bytes", None)
    assert (
        routed_experts.apply_routed_experts_store_bytes(store_config, config) == 409_600
    )
    assert aux.max_bytes == 409_600

    monkeypatch.setattr(aux, "max_bytes", 12_345)
    assert (
        routed_experts.apply_routed_experts_store_bytes(store_config, config) == 12_345
    )
    assert aux.max_bytes == 12_345


def test_worker_sizes_store_before_the_runner_builds_it(
    store_config: VllmConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registry's ``Worker.initialize_from_config`` sets the size, then
    runs upstream's method (here a stand-in that records what it sees)."""
    from vllm_hybrid.patches.registry import upstream_of

    seen: list[int | None] = []
    monkeypatch.setattr(
        routed_experts,
        "upstream_of",
        lambda module, name: (
            (
                lambda self, cfg: seen.append(
                    self.vllm_config.aux_output_config.max_bytes
                )
            )
            if (module, name) == (routed_experts.__name__, "initialize_from_config")
            else upstream_of(module, name)
        ),
    )
    aux = store_config.aux_output_config
    monkeypatch.setattr(aux, "enable_return_routed_experts", True)
    monkeypatch.setattr(aux, "max_bytes", None)
    worker = SimpleNamespace(vllm_config=store_config)
    routed_experts.initialize_from_config(worker, kv_config(100, ATTN, ALIGN_STATE))
    assert seen == [409_600]


def test_every_worker_class_runs_the_store_sizing(patched: None) -> None:
    """The GPU and CPU workers reach the replacement without --worker-cls."""
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    for cls in (Worker, CPUWorker):
        assert cls.initialize_from_config is routed_experts.initialize_from_config


def test_token_groups_are_reachable_at_vllms_name(patched: None) -> None:
    import vllm.v1.core.kv_cache_utils as upstream_utils

    found = upstream_utils.token_capacity_kv_cache_groups
    assert found is token_capacity.token_capacity_kv_cache_groups
    config = kv_config(100, ATTN, ALIGN_STATE)
    assert [g.kv_cache_spec for g in found(None, config)] == [ATTN]


def test_the_added_name_leaves_with_the_overlay() -> None:
    import vllm.v1.core.kv_cache_utils as upstream_utils

    already_applied = bool(registry.applied())
    registry.apply_all()
    registry.revert_all()
    try:
        assert not hasattr(upstream_utils, "token_capacity_kv_cache_groups")
    finally:
        if already_applied:
            registry.apply_all()


def test_cpu_rejects_routed_experts_without_model_runner_v2(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why the store sizing cannot run end to end on this CPU build."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    from vllm.config import AuxOutputConfig

    with pytest.raises(ValueError, match="requires Model Runner V2"):
        VllmConfig(
            model_config=ModelConfig(
                model=str(tiny_model_dir("qwen3_5")), max_model_len=4096
            ),
            aux_output_config=AuxOutputConfig(enable_return_routed_experts=True),
        )


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------


def test_registry_entries_of_kv_cache_utils() -> None:
    entries = {
        e.target: e
        for e in registry.PATCHES
        if e.replacement.startswith(f"{hybrid.__name__}:")
    }
    assert set(entries) == {
        f"{UPSTREAM}:get_kv_cache_configs",
        f"{UPSTREAM}:unify_kv_cache_spec_page_size",
        f"{UPSTREAM}:get_kv_cache_groups",
        f"{UPSTREAM}:get_kv_cache_capacity",
        f"{UPSTREAM}:update_kv_cache_capacity",
    }
    assert entries[f"{UPSTREAM}:update_kv_cache_capacity"].bindings == (
        "vllm.v1.engine.core",
    )
    for entry in entries.values():
        assert entry.why and entry.how and entry.upstream_status and entry.removal
        assert registry.load_object(entry.replacement).__name__ == entry.name


def test_engine_core_binding_is_replaced_and_restored() -> None:
    import vllm.v1.core.kv_cache_utils as kv_cache_utils
    import vllm.v1.engine.core as engine_core

    already_applied = bool(registry.applied())
    registry.revert_all()
    try:
        original = engine_core.update_kv_cache_capacity
        assert original is kv_cache_utils.update_kv_cache_capacity
        assert original is not hybrid.update_kv_cache_capacity
        registry.apply_all()
        assert engine_core.update_kv_cache_capacity is hybrid.update_kv_cache_capacity
        assert (
            kv_cache_utils.update_kv_cache_capacity is hybrid.update_kv_cache_capacity
        )
        assert kv_cache_utils.get_kv_cache_capacity is hybrid.get_kv_cache_capacity
        assert kv_cache_utils.get_kv_cache_groups is hybrid.get_kv_cache_groups
        assert (
            kv_cache_utils.unify_kv_cache_spec_page_size
            is hybrid.unify_kv_cache_spec_page_size
        )
        registry.revert_all()
        assert engine_core.update_kv_cache_capacity is original
        assert kv_cache_utils.update_kv_cache_capacity is original
    finally:
        if already_applied:
            registry.apply_all()


def test_mla_next_to_sliding_window_keeps_upstreams_fallback(patched) -> None:
    """MLA pages (18,432 B) that do not divide a sliding-window page (32,768 B):
    upstream's unification gives up and its grouping allocates the windows as
    full attention in one group at MLA's block size. The overlay gives up the
    same way instead of scaling MLA blocks to the LCM (x16)."""
    import vllm.v1.core.kv_cache_utils as kv_cache_utils

    swa = SlidingWindowSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=256,
        dtype=torch.bfloat16,
        sliding_window=128,
    )
    specs = {"mla": mla_spec(), "swa": swa}
    with pytest.raises(NotImplementedError):
        overlay_unify(dict(specs))
    config = VllmConfig()
    config.cache_config.kv_cache_layout = "LBNHC"  # the engine core resolves it
    groups = kv_cache_utils.get_kv_cache_groups(config, dict(specs))
    assert [sorted(g.layer_names) for g in groups] == [["mla", "swa"]]
    assert groups[0].kv_cache_spec.block_size == 16
