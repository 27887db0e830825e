"""The overlay's gated-DeltaNet core reading prefill states out of place
(``vllm_hybrid.model_executor.layers.mamba.gdn_out_of_place``) against
upstream's own ``QwenGatedDeltaNetAttention._forward_core`` run after align
mode's copy.

One mixed batch: two decodes, then prefill chunks that continue from a
checkpoint in another block (5 and 20 tokens: read out of place), a 2-token
chunk (shorter than the conv state: the runner copies it first, so it reads
in place), a fresh prompt and a chunk continuing in its own block. Upstream's
core runs on states where every out-of-place row's state was first copied
from its read block to its write block; the overlay's core runs on the same
states without those copies. Outputs and both state tensors must be bitwise
equal afterwards: the read blocks still hold their checkpoints, the write
blocks the advanced states. Small head sizes (the kernels are shape-generic)
keep the interpreter to seconds.
"""

from __future__ import annotations

import pytest
import torch
from arena_views import DEVICE
from state_ops import causal_conv1d, conv_metadata, query_start_loc, seeded
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
from vllm.third_party.flash_linear_attention.ops import chunk_gated_delta_rule
from vllm.third_party.flash_linear_attention.ops.index import (
    prepare_chunk_indices,
    prepare_chunk_offsets,
)
from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from vllm_hybrid.model_executor.layers.mamba import gdn_out_of_place
from vllm_hybrid.patches import registry

H, HV, K, V, WIDTH = 2, 4, 16, 16, 4
CONV_DIM = 2 * H * K + HV * V
BLOCKS = 16
PREFIX = "model.layers.0.linear_attn"
UPSTREAM_CORE = (
    "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:"
    "QwenGatedDeltaNetAttention._forward_core"
)

#: (tokens, has initial state, read block, write block) per row, decodes first
ROWS = [
    (1, True, 3, 3),
    (1, True, 4, 4),
    (5, True, 5, 9),  # continues from a checkpoint: reads out of place
    (20, True, 6, 10),  # the same, over several conv tiles
    (2, True, 11, 11),  # shorter than the conv state: copied by the runner
    (9, False, 12, 12),  # fresh prompt
    (7, True, 13, 13),  # continues in its own block
]
OUT_OF_PLACE = [(r, w) for _, _, r, w in ROWS if r != w]


class _Layer:
    """The attributes ``_forward_core`` reads of a QwenGatedDeltaNetAttention."""

    rearrange_mixed_qkv = gdn.QwenGatedDeltaNetAttention.rearrange_mixed_qkv

    def __init__(self) -> None:
        from vllm.model_executor.layers.mamba.mamba_utils import (
            is_conv_state_dim_first,
        )

        self.prefix = PREFIX
        self.tp_size = 1
        self.num_k_heads, self.head_k_dim, self.head_v_dim = H, K, V
        self.key_dim, self.value_dim = H * K, HV * V
        self.activation = "silu"
        self.enable_packed_recurrent_decode = False
        self.conv1d = torch.nn.Conv1d(CONV_DIM, CONV_DIM, WIDTH, bias=False)
        self.conv1d.weight.data = seeded((CONV_DIM, 1, WIDTH), 4, scale=0.5)
        self.A_log = seeded((HV,), 5, scale=0.5, dtype=torch.float32)
        self.dt_bias = seeded((HV,), 6, scale=0.5, dtype=torch.float32)
        conv = seeded((BLOCKS, WIDTH - 1, CONV_DIM), 7)
        if is_conv_state_dim_first():
            conv = conv.transpose(1, 2).contiguous()
        ssm = seeded((BLOCKS, HV, V, K), 8, scale=0.1, dtype=torch.float32)
        self.kv_cache = (conv, ssm)

    @staticmethod
    def chunk_gated_delta_rule(aiter_prefill_metadata=None, **kwargs):
        return chunk_gated_delta_rule(**kwargs)


def _metadata() -> GDNAttentionMetadata:
    lens = [n for n, _, _, _ in ROWS]
    decodes = sum(1 for n in lens if n == 1)
    decode_tokens = decodes
    qsl = query_start_loc(lens)
    prefill_qsl = qsl[decodes:] - decode_tokens
    has_initial = torch.tensor([h for _, h, _, _ in ROWS], device=DEVICE)
    write = torch.tensor([w for *_, w in ROWS], dtype=torch.int32, device=DEVICE)
    conv = conv_metadata(qsl)
    metadata = GDNAttentionMetadata(
        num_prefills=len(lens) - decodes,
        num_prefill_tokens=sum(lens) - decode_tokens,
        num_decodes=decodes,
        num_decode_tokens=decode_tokens,
        num_spec_decodes=0,
        num_spec_decode_tokens=0,
        num_actual_tokens=sum(lens),
        has_initial_state=has_initial,
        non_spec_query_start_loc=qsl.to(DEVICE),
        non_spec_state_indices_tensor=write,
        chunk_indices=prepare_chunk_indices(prefill_qsl, FLA_CHUNK_SIZE).to(DEVICE),
        chunk_offsets=prepare_chunk_offsets(prefill_qsl, FLA_CHUNK_SIZE).to(DEVICE),
        prefill_query_start_loc=prefill_qsl.to(DEVICE),
        prefill_state_indices=write[decodes:],
        prefill_has_initial_state=has_initial[decodes:],
        nums_dict=conv.nums_dict,
        batch_ptr=conv.batch_ptr,
        token_chunk_offset_ptr=conv.token_chunk_offset_ptr,
    )
    return metadata


def _inputs(tokens: int | None = None):
    tokens = tokens or sum(n for n, _, _, _ in ROWS)
    return (
        seeded((tokens, CONV_DIM), 11),
        seeded((tokens, HV), 12),
        seeded((tokens, HV), 13),
    )


@pytest.fixture
def triton_conv(monkeypatch):
    """The layer module's conv entry points as CUDA binds them (on a CPU
    platform upstream rebinds them to CPU versions)."""
    monkeypatch.setattr(gdn, "causal_conv1d_fn", causal_conv1d.causal_conv1d_fn)
    monkeypatch.setattr(gdn, "causal_conv1d_update", causal_conv1d.causal_conv1d_update)


def _run(core, layer: _Layer, metadata, monkeypatch, tokens=None) -> torch.Tensor:
    from types import SimpleNamespace

    import vllm.forward_context as fc

    context = SimpleNamespace(attn_metadata={PREFIX: metadata})
    monkeypatch.setattr(gdn, "get_forward_context", lambda: context)
    monkeypatch.setattr(fc, "get_forward_context", lambda: context)
    mixed_qkv, b, a = _inputs(tokens)
    out = torch.zeros((mixed_qkv.shape[0], HV, V), dtype=mixed_qkv.dtype, device=DEVICE)
    core(layer, mixed_qkv=mixed_qkv, b=b, a=a, core_attn_out=out)
    return out


def test_prefill_rows_read_out_of_place_as_upstream_after_a_copy(
    triton_conv, monkeypatch
):
    ref, ours = _Layer(), _Layer()
    before = tuple(t.clone() for t in ours.kv_cache)
    for state in ref.kv_cache:
        for read, write in OUT_OF_PLACE:
            state[write] = state[read]
    ref_out = _run(registry.upstream(UPSTREAM_CORE), ref, _metadata(), monkeypatch)

    metadata = _metadata()
    metadata.read_state_indices = torch.tensor(
        [r for _, _, r, _ in ROWS], dtype=torch.int32, device=DEVICE
    )
    assert gdn_out_of_place.reads_elsewhere(metadata)
    out = _run(gdn_out_of_place.forward_core, ours, metadata, monkeypatch)

    assert torch.equal(out, ref_out)
    assert out.abs().sum() > 0
    for state, ref_state, old in zip(ours.kv_cache, ref.kv_cache, before, strict=True):
        assert torch.equal(state, ref_state)
        for read, write in OUT_OF_PLACE:
            # the checkpoint stayed, the write block moved on
            assert torch.equal(state[read], old[read])
            assert not torch.equal(state[write], old[read])


def test_a_batch_without_read_blocks_runs_upstreams_core(triton_conv, monkeypatch):
    """No ``read_state_indices`` (a decode-only batch, another engine): the
    overlay's entry point is upstream's core."""
    ref, ours = _Layer(), _Layer()
    ref_out = _run(registry.upstream(UPSTREAM_CORE), ref, _metadata(), monkeypatch)
    metadata = _metadata()
    assert not gdn_out_of_place.reads_elsewhere(metadata)
    out = _run(gdn_out_of_place.forward_core, ours, metadata, monkeypatch)
    assert torch.equal(out, ref_out)
    for state, ref_state in zip(ours.kv_cache, ref.kv_cache, strict=True):
        assert torch.equal(state, ref_state)


#: A batch of decodes only, as full CUDA graphs replay it: (read, write) per
#: row; the second row crosses into a kept checkpoint's block (the turn end),
#: the last is a padded row (null block in both).
DECODES = [(3, 3), (5, 9), (6, 6), (0, 0)]


def _decode_metadata(packed_reference: bool) -> GDNAttentionMetadata:
    rows = len(DECODES)
    write = torch.tensor([w for _, w in DECODES], dtype=torch.int32, device=DEVICE)
    return GDNAttentionMetadata(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=rows - 1,
        num_decode_tokens=rows - 1,
        num_spec_decodes=0,
        num_spec_decode_tokens=0,
        num_actual_tokens=rows,
        has_initial_state=torch.ones(rows, dtype=torch.bool, device=DEVICE),
        non_spec_query_start_loc=query_start_loc([1] * rows).to(DEVICE),
        non_spec_state_indices_tensor=write,
    )


def test_decode_rows_read_out_of_place_as_upstream_after_a_copy(
    triton_conv, monkeypatch
):
    """Upstream's unpacked decode path after the copy, against the overlay's
    decode-only core without it: bitwise equal outputs and states."""
    ref, ours = _Layer(), _Layer()
    before = tuple(t.clone() for t in ours.kv_cache)
    for state in ref.kv_cache:
        state[9] = state[5]
    rows = len(DECODES)
    upstream_core = registry.upstream(UPSTREAM_CORE)
    ref_out = _run(upstream_core, ref, _decode_metadata(True), monkeypatch, rows)

    metadata = _decode_metadata(False)
    metadata.read_state_indices = torch.tensor(
        [r for r, _ in DECODES], dtype=torch.int32, device=DEVICE
    )
    out = _run(gdn_out_of_place.forward_core, ours, metadata, monkeypatch, rows)
    # the kernels skip the padded row, its output is left as allocated
    assert torch.equal(out[: rows - 1], ref_out[: rows - 1])
    assert out[: rows - 1].abs().sum() > 0
    for state, ref_state, old in zip(ours.kv_cache, ref.kv_cache, before, strict=True):
        assert torch.equal(state[1:], ref_state[1:])  # block 0: padding's
        assert torch.equal(state[5], old[5])  # the turn end stayed
        assert not torch.equal(state[9], old[5])
