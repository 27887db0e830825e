"""Qwen3.6's gated-DeltaNet layer core, as it runs on CUDA, on given states.

Mirrors ``QwenGatedDeltaNet._forward_core`` (non-speculative batches) in
``vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py``:

* a batch with prefills (decodes first, then prefills): ``causal_conv1d_fn``
  over every token with the conv-state views and state ids, then the decodes
  through ``fused_sigmoid_gating_delta_rule_update`` (in place on the SSM
  state views) and the prefills through ``fused_post_conv_prep`` and the FLA
  chunked ``chunk_gated_delta_rule`` on states gathered from the views, which
  are scattered back afterwards;
* a decode-only batch (``_forward_core_decode_non_spec``, the default with
  ``VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=1``): ``causal_conv1d_update``
  and ``fused_recurrent_gated_delta_rule_packed_decode``, both in place on
  the views; CUDA-graph padding rows carry state id 0.

Weights and token inputs are random but fixed; every layer gets the same
ones (its states differ).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from arena_views import QWEN36_GDN
from state_ops import (
    INTERPRETING,
    causal_conv1d,
    conv_metadata,
    conv_view,
    query_start_loc,
    same_inputs_same_outputs,
    seeded,
)
from vllm.third_party.flash_linear_attention.ops import (
    chunk_gated_delta_rule,
    fused_post_conv_prep,
    fused_recurrent_gated_delta_rule_packed_decode,
    fused_sigmoid_gating_delta_rule_update,
)
from vllm.third_party.flash_linear_attention.ops.index import (
    prepare_chunk_indices,
    prepare_chunk_offsets,
)
from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE

H = QWEN36_GDN["num_k_heads"]
HV = QWEN36_GDN["num_v_heads"]
K = QWEN36_GDN["head_k_dim"]
V = QWEN36_GDN["head_v_dim"]
CONV_DIM = 2 * H * K + HV * V

#: The chunked prefill kernels see gathered states only (see
#: ``same_inputs_same_outputs``); the interpreter needs seconds per call, so
#: there equal inputs reuse the outputs. Compiled on a GPU they run each time.
if INTERPRETING:
    chunk_prefill = same_inputs_same_outputs(chunk_gated_delta_rule)
    post_conv_prep = same_inputs_same_outputs(fused_post_conv_prep)
else:
    chunk_prefill = chunk_gated_delta_rule
    post_conv_prep = fused_post_conv_prep


@dataclass(frozen=True)
class GDNWeights:
    conv: torch.Tensor  # (CONV_DIM, width), the layer's conv1d weight viewed 2-D
    A_log: torch.Tensor  # (HV,) float32
    dt_bias: torch.Tensor  # (HV,) float32


def gdn_weights(seed: int = 7) -> GDNWeights:
    width = QWEN36_GDN["conv_kernel_size"]
    return GDNWeights(
        conv=seeded((CONV_DIM, width), seed, scale=0.5),
        A_log=seeded((HV,), seed + 1, scale=0.5, dtype=torch.float32),
        dt_bias=seeded((HV,), seed + 2, scale=0.5, dtype=torch.float32),
    )


@dataclass
class GDNBatch:
    """One scheduler step's GDN inputs: ``lens`` tokens per request, decodes
    (one token) first; ``has_initial_state`` per request."""

    lens: list[int]
    has_initial_state: list[bool]
    seed: int = 11
    mixed_qkv: torch.Tensor = field(init=False)
    a: torch.Tensor = field(init=False)
    b: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        tokens = sum(self.lens)
        self.mixed_qkv = seeded((tokens, CONV_DIM), self.seed)
        self.a = seeded((tokens, HV), self.seed + 1)
        self.b = seeded((tokens, HV), self.seed + 2)

    @property
    def num_decodes(self) -> int:
        return next((i for i, n in enumerate(self.lens) if n != 1), len(self.lens))


def split_qkv(mixed_qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``rearrange_mixed_qkv``: dense ``(1, tokens, heads, dim)`` q, k, v."""
    q, k, v = torch.split(mixed_qkv, [H * K, H * K, HV * V], dim=-1)
    tokens = mixed_qkv.shape[0]
    return (
        q.contiguous().view(1, tokens, H, K),
        k.contiguous().view(1, tokens, H, K),
        v.contiguous().view(1, tokens, HV, V),
    )


def gdn_step(
    states: Mapping[str, tuple[torch.Tensor, ...]],
    state_ids: torch.Tensor,
    batch: GDNBatch,
    weights: GDNWeights,
) -> torch.Tensor:
    """A batch with prefills through every layer; returns the core outputs."""
    return _every_layer(_gdn_core, states, state_ids, batch, weights)


def _every_layer(core, states, state_ids, batch, weights) -> torch.Tensor:
    """``core`` on each layer's states, outputs concatenated in layer order."""
    return torch.cat(
        [core(states[layer], state_ids, batch, weights) for layer in states]
    )


def _gdn_core(
    layer_states: tuple[torch.Tensor, ...],
    state_ids: torch.Tensor,
    batch: GDNBatch,
    w: GDNWeights,
) -> torch.Tensor:
    conv_state, ssm_state = conv_view(layer_states[0]), layer_states[1]
    device = state_ids.device
    qsl_cpu = query_start_loc(batch.lens)
    has_initial = torch.tensor(batch.has_initial_state, device=device)
    conv_out = causal_conv1d.causal_conv1d_fn(
        batch.mixed_qkv.transpose(0, 1),
        w.conv,
        None,
        activation="silu",
        conv_states=conv_state,
        has_initial_state=has_initial,
        cache_indices=state_ids,
        query_start_loc=qsl_cpu.to(device),
        metadata=conv_metadata(qsl_cpu),
    ).transpose(0, 1)
    nd = batch.num_decodes
    outputs = []
    if nd:
        q, k, v = split_qkv(conv_out[:nd])
        out_decode, _ = fused_sigmoid_gating_delta_rule_update(
            A_log=w.A_log,
            a=batch.a[:nd],
            b=batch.b[:nd],
            dt_bias=w.dt_bias,
            q=q,
            k=k,
            v=v,
            initial_state=ssm_state,
            inplace_final_state=True,
            cu_seqlens=qsl_cpu[: nd + 1].to(device),
            ssm_state_indices=state_ids,
            use_qk_l2norm_in_kernel=True,
        )
        outputs.append(out_decode)
    if nd < len(batch.lens):
        prefill_ids = state_ids[nd:]
        outputs.append(chunked_prefill(conv_out[nd:], ssm_state, prefill_ids, batch, w))
    return torch.cat([o.reshape(-1).float() for o in [conv_out, *outputs]])


def chunked_prefill(
    conv_out: torch.Tensor,
    ssm_state: torch.Tensor,
    prefill_ids: torch.Tensor,
    batch: GDNBatch,
    w: GDNWeights,
) -> torch.Tensor:
    """The prefills of ``batch`` (after its decodes) through the FLA chunked
    kernels: initial states gathered from ``ssm_state`` at ``prefill_ids``,
    final states scattered back."""
    nd, device = batch.num_decodes, prefill_ids.device
    q, k, v, g, beta = post_conv_prep(
        conv_output=conv_out,
        a=batch.a[nd:],
        b=batch.b[nd:],
        A_log=w.A_log,
        dt_bias=w.dt_bias,
        num_k_heads=H,
        head_k_dim=K,
        head_v_dim=V,
        apply_l2norm=True,
        output_g_exp=False,
    )
    qsl_cpu = query_start_loc(batch.lens[nd:])
    initial_state = ssm_state[prefill_ids]
    has_initial = torch.tensor(batch.has_initial_state[nd:], device=device)
    initial_state[~has_initial, ...] = 0
    out, last_state = chunk_prefill(
        q=q.unsqueeze(0),
        k=k.unsqueeze(0),
        v=v.unsqueeze(0),
        g=g.unsqueeze(0),
        beta=beta.unsqueeze(0),
        initial_state=initial_state,
        output_final_state=True,
        cu_seqlens=qsl_cpu.to(device),
        chunk_indices=prepare_chunk_indices(qsl_cpu, FLA_CHUNK_SIZE).to(device),
        chunk_offsets=prepare_chunk_offsets(qsl_cpu, FLA_CHUNK_SIZE).to(device),
        use_qk_l2norm_in_kernel=False,
    )
    ssm_state[prefill_ids] = last_state.to(ssm_state.dtype)
    return out


def gdn_decode(
    states: Mapping[str, tuple[torch.Tensor, ...]],
    state_ids: torch.Tensor,
    batch: GDNBatch,
    weights: GDNWeights,
) -> torch.Tensor:
    """A decode-only batch (padded rows: state id 0) through every layer."""
    return _every_layer(_gdn_decode, states, state_ids, batch, weights)


def _gdn_decode(
    layer_states: tuple[torch.Tensor, ...],
    state_ids: torch.Tensor,
    batch: GDNBatch,
    w: GDNWeights,
) -> torch.Tensor:
    rows = state_ids.shape[0]
    mixed_qkv = conv_update(layer_states, state_ids, batch.mixed_qkv.clone(), w)
    out = torch.zeros((rows, 1, HV, V), dtype=mixed_qkv.dtype, device=state_ids.device)
    packed_decode(layer_states, state_ids, mixed_qkv, batch, w, out)
    return torch.cat([mixed_qkv.reshape(-1).float(), out.reshape(-1).float()])


def conv_update(
    layer_states: tuple[torch.Tensor, ...],
    state_ids: torch.Tensor,
    mixed_qkv: torch.Tensor,
    w: GDNWeights,
) -> torch.Tensor:
    """``causal_conv1d_update`` of one decode token per row, in place on the
    layer's conv-state view (``mixed_qkv`` is overwritten and returned)."""
    return causal_conv1d.causal_conv1d_update(
        mixed_qkv,
        conv_view(layer_states[0]),
        w.conv,
        None,
        "silu",
        conv_state_indices=state_ids,
        validate_data=False,
    )


def packed_decode(
    layer_states: tuple[torch.Tensor, ...],
    state_ids: torch.Tensor,
    mixed_qkv: torch.Tensor,
    batch: GDNBatch,
    w: GDNWeights,
    out: torch.Tensor,
) -> None:
    """The packed recurrent decode, in place on the layer's SSM-state view."""
    fused_recurrent_gated_delta_rule_packed_decode(
        mixed_qkv=mixed_qkv,
        a=batch.a,
        b=batch.b,
        A_log=w.A_log,
        dt_bias=w.dt_bias,
        scale=K**-0.5,
        initial_state=layer_states[1],
        out=out,
        ssm_state_indices=state_ids,
        use_qk_l2norm_in_kernel=True,
    )


def out_of_place_decode(
    layer_states: tuple[torch.Tensor, ...],
    read_ids: torch.Tensor,
    write_ids: torch.Tensor,
    batch: GDNBatch,
    w: GDNWeights,
) -> torch.Tensor:
    """A decode-only batch as the overlay's core runs it when rows read their
    state in one block and write another
    (``vllm_hybrid.model_executor.layers.mamba.gdn_out_of_place``): the conv
    update in its prefix-caching form, then the unpacked recurrent update in
    its speculative form (columns ``[write, read]``, two accepted tokens)."""
    rows = write_ids.shape[0]
    zeros = torch.zeros(rows, dtype=torch.int32, device=write_ids.device)
    conv = causal_conv1d.causal_conv1d_update(
        batch.mixed_qkv.clone(),
        conv_view(layer_states[0]),
        w.conv,
        None,
        "silu",
        conv_state_indices=torch.stack((read_ids, write_ids), dim=1),
        initial_state_idx=zeros,
        block_idx_last_scheduled_token=zeros + 1,
        validate_data=False,
    )
    q, k, v = split_qkv(conv)
    out, _ = fused_sigmoid_gating_delta_rule_update(
        A_log=w.A_log,
        a=batch.a,
        b=batch.b,
        dt_bias=w.dt_bias,
        q=q,
        k=k,
        v=v,
        initial_state=layer_states[1],
        inplace_final_state=True,
        cu_seqlens=query_start_loc([1] * rows).to(write_ids.device),
        ssm_state_indices=torch.stack((write_ids, read_ids), dim=1),
        num_accepted_tokens=zeros + 2,
        use_qk_l2norm_in_kernel=True,
    )
    return out


def decode_batch(rows: int, seed: int = 21) -> GDNBatch:
    return GDNBatch(lens=[1] * rows, has_initial_state=[True] * rows, seed=seed)
