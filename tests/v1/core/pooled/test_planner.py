"""Pooled planning from specs at natural page sizes; no engine."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from vllm_hybrid.v1.core.pooled.capacity import (
    max_state_blocks_per_request,
    min_state_blocks_per_request,
    pooled_capacity,
)
from vllm_hybrid.v1.core.pooled.layers import split_layers
from vllm_hybrid.v1.core.pooled.planner import (
    PooledBudget,
    PooledPlanError,
    describe_plan,
    plan_pooled_kv_cache,
)
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig

MiB = 2**20


def attn(block_size: int = 128, heads: int = 2, head_size: int = 256):
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=heads,
        head_size=head_size,
        dtype=torch.bfloat16,
    )


def gdn(mode: str = "align", block_size: int = 128, ckpt: int = 0):
    # qwen3_5 tiny: conv (3, 1024) bf16 + ssm (4, 128, 128) fp32
    return MambaSpec(
        block_size=block_size,
        shapes=((3, 1024), (4, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode=mode,
        num_prefill_checkpoint_blocks=ckpt,
    )


def qwen3_5_specs(mode: str = "align"):
    specs = {}
    for i in range(8):
        name = f"model.layers.{i}"
        specs[name] = attn() if i % 4 == 3 else gdn(mode)
    return specs


def test_split_groups_all_state_layers_in_one_pool():
    split = split_layers(qwen3_5_specs())
    assert split.token is not None and split.state is not None
    assert split.token.layer_names == ("model.layers.3", "model.layers.7")
    assert len(split.state.layer_names) == 6
    # natural pages: 128 tokens x 2 heads x 256 x 2 (K,V) x 2 B
    assert split.token.spec.page_size_bytes == 262_144
    assert split.state.spec.page_size_bytes == 3 * 1024 * 2 + 4 * 128 * 128 * 4
    assert split.token.block_bytes == 2 * 262_144
    assert split.state.block_bytes == 6 * 268_288


def test_split_rejects_padded_or_mixed_specs():
    specs = qwen3_5_specs()
    specs["model.layers.3"] = attn(block_size=64)
    assert "different types or block sizes" in split_layers(specs).reason
    specs = qwen3_5_specs()
    specs["model.layers.0"] = gdn(ckpt=1)
    assert split_layers(specs).reason == "state layers have different specs"
    dense = {f"l{i}": attn() for i in range(4)}
    assert split_layers(dense).token is None


def test_attention_layers_of_two_dtypes_share_one_token_block():
    """A TurboQuant-like layer (1 B per value) next to a native bf16 skip
    layer: one token block id covers both pages, each at its own stride."""
    specs = qwen3_5_specs()
    specs["model.layers.7"] = FullAttentionSpec(
        block_size=128, num_kv_heads=2, head_size=256, dtype=torch.uint8
    )
    split = split_layers(specs)
    assert split.token is not None and split.token.spec.block_size == 128
    runs = split.token.runs
    assert [(r.layer_names, r.page_bytes, r.offset) for r in runs] == [
        (("model.layers.3",), 262_144, 0),
        (("model.layers.7",), 131_072, 262_144),
    ]
    assert split.token.block_bytes == 262_144 + 131_072
    assert split.token.padding_bytes == 0
    budget = PooledBudget(arena_bytes=48 * MiB, max_model_len=4096, max_num_seqs=64)
    config = plan_pooled_kv_cache(split, budget)
    token_tensors = [t for t in config.kv_cache_tensors if t.block_stride == 393_216]
    assert [
        (t.layers, t.offset, t.layer_stride, t.block_stride) for t in token_tensors
    ] == [
        (["model.layers.3"], 0, 262_144, 393_216),
        (["model.layers.7"], 262_144, 131_072, 393_216),
    ]
    assert config.pool_by_kind("token").num_blocks == 48 * MiB // 393_216 == 128
    assert (
        "pages 262144 B x 1 + 131072 B x 1, block 393216 B, 128 ids"
        in describe_plan(config)
    )


@pytest.mark.parametrize("mode,per_req", [("align", 2), ("none", 1)])
def test_plan_has_zero_padding_and_natural_block(mode, per_req):
    split = split_layers(qwen3_5_specs(mode))
    budget = PooledBudget(arena_bytes=48 * MiB, max_model_len=4096, max_num_seqs=64)
    config = plan_pooled_kv_cache(split, budget)
    assert isinstance(config, PooledKVCacheConfig)
    token, state = config.pool_by_kind("token"), config.pool_by_kind("state")
    assert token.num_blocks == 48 * MiB // (2 * 262_144) == 96
    assert state.num_blocks == 48 * MiB // (6 * 268_288) == 31
    assert config.max_state_blocks_per_request == per_req
    # no padding anywhere: every layer stride is the exact page
    for tensor in config.kv_cache_tensors:
        assert tensor.size == 48 * MiB
        assert tensor.offset == 0
    assert config.kv_cache_tensors[0].layer_stride == 262_144
    assert config.kv_cache_tensors[1].layer_stride == 268_288
    assert config.kv_cache_groups[0].kv_cache_spec.block_size == 128
    assert config.num_blocks_of(config.kv_cache_tensors[0]) == 96
    assert config.num_blocks_of(config.kv_cache_tensors[1]) == 31
    # the worker's log line (the TP test matches it)
    assert config.describe_pools() == (
        f"token pool 96 ids x 524288 B; state pool 31 ids x 1609728 B; "
        f"arena {48 * MiB} B"
    )
    assert "0 B padding" in describe_plan(config)


def test_capacity_counts_token_pool_after_one_request_state():
    split = split_layers(qwen3_5_specs("align"))
    config = plan_pooled_kv_cache(
        split, PooledBudget(arena_bytes=8 * MiB, max_model_len=512, max_num_seqs=8)
    )
    cap = pooled_capacity(config, 512)
    tb, sb = 2 * 262_144, 6 * 268_288
    # 5 state ids; a lone request runs on 1 state block even in align mode
    # (checkpoints skipped, state advanced in place when memory is short), so
    # the state pool's floor is 1 -> boundary at 4 * sb; token ids start past
    # the null region [0, sb) and end below the boundary
    first_token, token_limit = -(-sb // tb), (4 * sb) // tb
    assert (first_token, token_limit) == (4, 12)
    assert cap.token_capacity == (token_limit - first_token) * 128 == 1024
    assert config.arena.min_state_blocks == 1
    # concurrency still counts align mode's two state blocks per request
    assert config.max_state_blocks_per_request == 2


def test_lone_request_state_blocks():
    align = split_layers(qwen3_5_specs("align")).state.spec
    none = split_layers(qwen3_5_specs("none")).state.spec
    assert (
        max_state_blocks_per_request(align),
        min_state_blocks_per_request(align),
    ) == (
        2,
        1,
    )
    assert (max_state_blocks_per_request(none), min_state_blocks_per_request(none)) == (
        1,
        1,
    )


def test_budget_too_small_names_the_fix():
    split = split_layers(qwen3_5_specs("align"))
    with pytest.raises(PooledPlanError) as err:
        plan_pooled_kv_cache(
            split, PooledBudget(arena_bytes=8 * MiB, max_model_len=4096, max_num_seqs=8)
        )
    message = str(err.value)
    assert "max_model_len=4096" in message and "--kv-cache-memory-bytes" in message
    assert "--max-model-len to 1024" in message
    with pytest.raises(PooledPlanError, match="no --max-model-len fits"):
        plan_pooled_kv_cache(
            split, PooledBudget(arena_bytes=3 * MiB, max_model_len=4096, max_num_seqs=8)
        )


def test_overlapping_null_blocks_free_a_whole_state_block():
    split = split_layers(qwen3_5_specs("none"))
    kwargs = dict(arena_bytes=5 * MiB, max_model_len=256, max_num_seqs=8)
    apart = plan_pooled_kv_cache(split, PooledBudget(**kwargs))
    overlap = plan_pooled_kv_cache(
        split, PooledBudget(**kwargs, null_blocks_overlap=True)
    )
    tb, sb = 2 * 262_144, 6 * 268_288
    assert apart.null_region_bytes == sb and not apart.null_blocks_overlap
    assert overlap.null_region_bytes == tb and overlap.null_blocks_overlap
    # apart: null region [0, sb), state at id 2 -> token ids 4..5
    assert pooled_capacity(apart, 256).token_capacity == 2 * 128
    # overlap: the state view is aligned to the arena's top (offset T % sb),
    # state id 2 starts at 413,696 + 2 * sb -> token ids 1..5
    assert overlap.kv_cache_tensors[1].offset == 5 * MiB % sb == 413_696
    assert pooled_capacity(overlap, 256).token_capacity == 5 * 128


def planner_vllm_config():
    """The fields of a ``VllmConfig`` that pooled planning reads, for a
    hybrid model with nothing pooled mode leaves to upstream."""
    from types import SimpleNamespace

    return SimpleNamespace(
        model_config=SimpleNamespace(is_hybrid=True, max_model_len=2048),
        scheduler_config=SimpleNamespace(
            max_num_seqs=16, scheduler_cls=None, async_scheduling=False
        ),
        cache_config=SimpleNamespace(
            kv_cache_layout=None,
            num_gpu_blocks_override=None,
            prefix_cache_retention_interval=None,
            mamba_cache_mode="align",
        ),
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1,
            decode_context_parallel_size=1,
            prefill_context_parallel_size=1,
        ),
        attention_config=SimpleNamespace(hisparse_config=None),
        kv_transfer_config=None,
        speculative_config=None,
        additional_config={},
    )


def test_every_rank_gets_the_same_plan_from_the_smallest_budget():
    from vllm_hybrid.v1.core.pooled import engine as glue

    config = planner_vllm_config()
    specs = qwen3_5_specs("align")
    configs = glue.plan_pooled_configs(config, [specs, specs], [48 * MiB, 40 * MiB])
    assert configs is not None and len(configs) == 2
    assert configs[0] == configs[1] and configs[0] is not configs[1]
    assert configs[0].arena_bytes == 40 * MiB


def test_checkpoint_interval_default_and_multiples():
    from vllm_hybrid.platforms.hybrid_block_size import checkpoint_interval

    assert checkpoint_interval(128, None) == 128
    assert checkpoint_interval(128, 128) == 128
    assert checkpoint_interval(128, 512) == 512
    # a value copied from an earlier, smaller block size is not a request
    assert checkpoint_interval(128, 16) == 128
    with pytest.raises(ValueError, match="--mamba-block-size 200 must be a multiple"):
        checkpoint_interval(128, 200)


@pytest.mark.parametrize(
    "method, pooled",
    [("ngram", True), ("mtp", True), ("eagle", True), ("draft_model", False)],
)
def test_scope_guard_takes_ngram_mtp_and_eagle_drafts(method, pooled):
    from types import SimpleNamespace

    from vllm_hybrid.v1.core.pooled.scope import pooled_mode_decision

    config = planner_vllm_config()
    config.speculative_config = SimpleNamespace(method=method)
    decision = pooled_mode_decision(config)
    assert decision.enabled is pooled
    if not pooled:
        assert decision.reason == (
            "unsupported: speculative decoding with a separate draft model "
            "(draft_model)"
        )


def _stages(specs: dict, cuts: list[int]) -> list[dict]:
    names = list(specs)
    bounds = [0, *cuts, len(names)]
    return [
        {n: specs[n] for n in names[a:b]}
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]


def test_pipeline_stages_with_equal_bytes_get_one_plan_with_their_own_layers():
    from vllm_hybrid.v1.core.pooled import engine as glue

    config = planner_vllm_config()
    config.parallel_config.pipeline_parallel_size = 2
    stages = _stages(qwen3_5_specs("align"), [4])  # 3 GDN + 1 attention each
    configs = glue.plan_pooled_configs(config, stages, [48 * MiB, 48 * MiB])
    assert configs is not None and len(configs) == 2
    first, second = configs
    assert first.layout == second.layout and first.num_blocks == second.num_blocks
    # each stage's arena holds its own four layers, twice the blocks of a
    # whole-model plan of the same budget
    whole = glue.plan_pooled_configs(
        planner_vllm_config(), [qwen3_5_specs("align")], [48 * MiB]
    )[0]
    assert first.layout.token_block_bytes * 2 == whole.layout.token_block_bytes
    assert first.layout.state_block_bytes * 2 == whole.layout.state_block_bytes
    for stage, cfg in zip(stages, configs, strict=True):
        layers = {n for g in cfg.kv_cache_groups for n in g.layer_names}
        assert layers == set(stage)


def test_pipeline_stages_with_other_bytes_get_blocks_padded_to_the_largest(caplog):
    from vllm_hybrid.v1.core.pooled import engine as glue

    config = planner_vllm_config()
    config.parallel_config.pipeline_parallel_size = 2
    # stage 0: layers 0-2 (GDN) + 3 (attention) + 4 (GDN); stage 1: 5, 6 (GDN), 7
    stages = _stages(qwen3_5_specs("align"), [5])
    with caplog.at_level("INFO"):
        configs = glue.plan_pooled_configs(config, stages, [48 * MiB] * 2)
    assert configs is not None and len(configs) == 2
    state_page, token_page = 268_288, 262_144
    heavy = 4 * state_page  # stage 0's state block; stage 1's is 2 pages
    assert (
        "stage 0: token 262,144 of 262,144 B, state 1,073,152 of 1,073,152 B; "
        "stage 1: token 262,144 of 262,144 B, state 536,576 of 1,073,152 B"
    ) in caplog.text
    first, second = configs
    assert first.layout == second.layout
    assert first.layout.token_block_bytes == token_page
    assert first.layout.state_block_bytes == heavy
    for stage, cfg in zip(stages, configs, strict=True):
        layers = {n for g in cfg.kv_cache_groups for n in g.layer_names}
        assert layers == set(stage)
        token_tensor, state_tensor = cfg.kv_cache_tensors
        # each stage's layers sit inside the shared block stride
        for tensor in cfg.kv_cache_tensors:
            assert len(tensor.layers) * tensor.layer_stride <= tensor.block_stride
        # the highest ids of both pools end inside the stage's buffer
        layout = cfg.layout
        assert layout.num_token_ids * token_tensor.block_stride <= token_tensor.size
        assert (
            state_tensor.offset + layout.num_state_ids * state_tensor.block_stride
            <= state_tensor.size
        )
        # and at every boundary position the scheduler may choose, the token
        # blocks end at or below the state pool's first byte on this stage
        for floor in range(layout.min_state_floor, layout.max_state_floor + 1):
            token_end = layout.token_limit_at(floor) * token_tensor.block_stride
            state_start = state_tensor.offset + floor * state_tensor.block_stride
            assert token_end <= state_start
    # the cost: what the padded stage could hold alone at the same budget
    own = [
        glue.plan_pooled_configs(planner_vllm_config(), [stage], [48 * MiB])[0]
        for stage in stages
    ]
    assert own[0].layout == first.layout  # the heaviest stage loses nothing
    assert own[1].layout.num_state_ids == 2 * first.layout.num_state_ids + 1


@pytest.mark.parametrize("pooled", [True, False])
def test_skip_layer_alignment_keeps_natural_pages_in_pooled_mode(pooled, monkeypatch):
    """On CUDA upstream's platform raises the block and pads skip layers'
    pages (``skip_page_size_padded``) when ``--kv-cache-dtype-skip-layers``
    is set; pooled mode keeps both (the single pool still gets upstream's)."""
    from vllm_hybrid.platforms import hybrid_block_size

    calls = []

    def upstream(cls, vllm_config, backend_cls):
        calls.append(backend_cls)
        vllm_config.cache_config.block_size = 1024
        vllm_config.cache_config.skip_page_size_padded = 99

    monkeypatch.setattr(
        hybrid_block_size,
        "upstream_of",
        lambda module, name: classmethod(upstream),
    )
    config = planner_vllm_config()
    config.cache_config.block_size = 16
    config.cache_config.skip_page_size_padded = None
    config.cache_config.cache_dtype = "turboquant_k8v4"
    config.cache_config.kv_cache_dtype_skip_layers = ["3"]
    if not pooled:
        config.additional_config = {"hybrid_kv": {"pooled": False}}
    align = hybrid_block_size.align_heterogeneous_kv_block_size.__func__
    align(object, config, "backend")
    if pooled:
        assert calls == []
        assert config.cache_config.block_size == 16
        assert config.cache_config.skip_page_size_padded is None
    else:
        assert calls == ["backend"]
        assert config.cache_config.skip_page_size_padded == 99
