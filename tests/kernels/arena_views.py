"""Pooled arena views as a CUDA worker builds them, and their single-pool twins.

:func:`build_arena` plans a pooled config with the overlay's planner for
Qwen3.6-35B-A3B's per-layer shapes (fewer layers), then lets upstream's
``allocate_kv_cache`` turn it into per-layer views of one int8 allocation,
exactly as every worker does. State views are unpacked by upstream's
``MambaBase.bind_kv_cache``, as the model's GDN layers do.

A kernel conformance test runs a kernel twice: on these views, and on
:func:`contiguous_twin` copies (each layer its own dense tensor, the way
upstream's single pool lays layers out). Then it compares the pages the
requests own and checks that no byte outside them changed
(:meth:`ArenaViews.fill_canary` / :meth:`ArenaViews.bytes_changed_outside`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from vllm_hybrid.v1.core.pooled.layers import split_layers
from vllm_hybrid.v1.core.pooled.planner import (
    PooledBudget,
    plan_pooled_kv_cache,
)
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind

MiB = 2**20

#: Qwen3.6-35B-A3B (Qwen3_5MoeTextConfig defaults) at TP=1, per layer.
QWEN36_ATTENTION = {"num_kv_heads": 2, "head_size": 256}
QWEN36_GDN = {
    "num_k_heads": 16,
    "num_v_heads": 32,
    "head_k_dim": 128,
    "head_v_dim": 128,
    "conv_kernel_size": 4,
}

CANARY = 0x5A

#: Where the tier runs: real CUDA tensors and compiled kernels on a GPU
#: runner, CPU tensors in Triton's interpreter everywhere else.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def attention_spec(
    block_size: int, dtype: torch.dtype = torch.bfloat16, **overrides
) -> FullAttentionSpec:
    """Qwen3.6-35B-A3B's attention layer spec (bf16 unless overridden)."""
    return FullAttentionSpec(
        block_size=block_size, dtype=dtype, **{**QWEN36_ATTENTION, **overrides}
    )


def gdn_spec(
    block_size: int, mode: str = "align", num_spec: int = 0, **overrides
) -> MambaSpec:
    """Qwen3.6-35B-A3B's gated-DeltaNet layer spec: bf16 conv state, float32
    recurrent state (what the checkpoint's config hook selects)."""
    dims = {**QWEN36_GDN, **overrides}
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, num_spec=num_spec, **dims
    )
    return MambaSpec(
        block_size=block_size,
        shapes=tuple(tuple(s) for s in shapes),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode=mode,
        num_speculative_blocks=num_spec,
    )


#: Nemotron-H's Mamba2 mixer (head dim, state size, groups, conv kernel), with
#: far fewer heads: Qwen3.6 has no Mamba2 layers, and the interpreter's cost
#: grows with the head count.
NEMOTRON_H_MAMBA2 = {
    "num_heads": 4,
    "head_dim": 64,
    "n_groups": 1,
    "state_size": 128,
    "conv_kernel": 4,
}


def mamba2_spec(block_size: int, mode: str = "align", **overrides) -> MambaSpec:
    """A Mamba2 layer spec: bf16 conv state, float32 SSM state (the
    ``mamba_ssm_cache_dtype`` Nemotron-H checkpoints ask for)."""
    dims = {**NEMOTRON_H_MAMBA2, **overrides}
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        1, intermediate_size=dims["num_heads"] * dims["head_dim"], **dims
    )
    return MambaSpec(
        block_size=block_size,
        shapes=tuple(tuple(s) for s in shapes),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
        mamba_cache_mode=mode,
    )


@dataclass
class ArenaViews:
    """One worker's pooled KV cache: the backing allocation and its views."""

    config: PooledKVCacheConfig
    #: The single int8 allocation every view aliases.
    raw: torch.Tensor
    #: ``allocate_kv_cache``'s per-layer manager views (``[B, H, N, C]``).
    views: dict[str, torch.Tensor]
    token_layers: tuple[str, ...]
    state_layers: tuple[str, ...]
    #: State floor (boundary) the owned ids are taken at.
    state_floor: int
    #: Typed per-layer state views (conv, ssm), as the GDN layer binds them.
    states: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    @property
    def token_ids(self) -> range:
        """Token ids the token pool owns at this boundary."""
        return self.config.layout.token_ids_at(self.state_floor)

    @property
    def state_ids(self) -> range:
        """State ids the state pool owns at this boundary."""
        return self.config.layout.state_ids_at(self.state_floor)

    def pick(self, kind: PoolKind, n: int, seed: int = 0) -> list[int]:
        """``n`` distinct owned ids of one pool, scattered, including the ids
        next to the null region and next to the boundary."""
        ids = self.token_ids if kind == PoolKind.TOKEN else self.state_ids
        if n > len(ids):
            raise ValueError(f"{kind} pool owns {len(ids)} ids, {n} asked")
        edges = [ids[0], ids[-1]][:n]
        rest = [i for i in ids if i not in edges]
        chosen = edges + random.Random(seed).sample(rest, n - len(edges))
        random.Random(seed + 1).shuffle(chosen)
        return chosen

    def pool_layers(self, kind: PoolKind) -> tuple[str, ...]:
        return self.token_layers if kind == PoolKind.TOKEN else self.state_layers

    def page_ranges(self, kind: PoolKind, ids: list[int]) -> list[tuple[int, int]]:
        """Arena byte ranges of the pages of ``ids`` for every layer of the
        pool (each page is one dense run in a block-compact layout)."""
        layers = self.pool_layers(kind)
        tensor = next(t for t in self.config.kv_cache_tensors if t.layers[0] in layers)
        group = self.config.pool_by_kind(kind).group_ids[0]
        page = self.config.kv_cache_groups[group].kv_cache_spec.page_size_bytes
        ranges = []
        for block in ids:
            for layer in range(len(tensor.layers)):
                start = (
                    tensor.offset
                    + block * tensor.block_stride
                    + layer * tensor.layer_stride
                )
                ranges.append((start, start + page))
        return ranges

    def fill_canary(self) -> None:
        self.raw.fill_(CANARY)

    def bytes_changed_outside(self, ranges: list[tuple[int, int]]) -> int:
        """Bytes that differ from the canary outside ``ranges``."""
        changed = self.raw.view(torch.uint8) != CANARY
        for start, end in ranges:
            changed[start:end] = False
        return int(changed.sum())


def build_arena(
    token_spec: KVCacheSpec,
    state_spec: MambaSpec,
    *,
    num_token_layers: int = 2,
    num_state_layers: int = 3,
    arena_bytes: int = 64 * MiB,
    null_blocks_overlap: bool = True,
    state_floor: int | None = None,
    max_model_len: int = 256,
    layout: KVCacheLayout = KVCacheLayout.LBHNC,
) -> ArenaViews:
    """Plan and allocate a pooled arena on :data:`DEVICE`; ``state_floor``
    None keeps the planner's initial boundary."""
    specs: dict[str, KVCacheSpec] = {}
    for i in range(num_token_layers + num_state_layers):
        name = f"model.layers.{i}"
        specs[name] = token_spec if i < num_token_layers else state_spec
    split = split_layers(specs)
    assert split.token is not None, split.reason
    budget = PooledBudget(
        arena_bytes=arena_bytes,
        max_model_len=max_model_len,
        max_num_seqs=4,
        null_blocks_overlap=null_blocks_overlap,
    )
    config = plan_pooled_kv_cache(split, budget)
    views = allocate_kv_cache(config, DEVICE, layout)
    storage = next(iter(views.values())).untyped_storage()
    raw = torch.empty(0, dtype=torch.int8, device=DEVICE).set_(storage)
    assert raw.numel() == config.arena_bytes
    arena = config.layout
    floor = arena.initial_state_floor if state_floor is None else state_floor
    assert arena.min_state_floor <= floor <= arena.max_state_floor
    result = ArenaViews(
        config=config,
        raw=raw,
        views=views,
        token_layers=split.token.layer_names,
        state_layers=split.state.layer_names,
        state_floor=floor,
    )
    result.states = {
        name: bind_state(views[name], state_spec) for name in result.state_layers
    }
    return result


def bind_state(view: torch.Tensor, spec: MambaSpec) -> tuple[torch.Tensor, ...]:
    """The typed state tensors a GDN/Mamba layer binds from its page view
    (upstream's ``MambaBase.bind_kv_cache`` on a stand-in layer)."""
    layer = SimpleNamespace(
        get_state_shape=lambda: spec.shapes, get_state_dtype=lambda: spec.dtypes
    )
    MambaBase.bind_kv_cache(layer, view)
    return layer.kv_cache


def contiguous_twin(tensor: torch.Tensor) -> torch.Tensor:
    """A dense copy with the same shape, dtype and values: one layer of
    upstream's single pool, where each layer has its own contiguous run."""
    return tensor.contiguous().clone()
