"""The gated-DeltaNet core of Qwen3.5/3.6 and Qwen3-Next for batches whose
prefill chunks read their state in one block and write it into another.

:mod:`vllm_hybrid.v1.worker.state_reads` explains why: a prefill chunk that
continues from a kept checkpoint needs no copy of the whole state if the
layer reads the checkpoint's block and writes the advanced state into the
block the step ends in. The metadata builder hands the layer, per
non-speculative row, the block it reads (``read_state_indices``, equal to the
block it writes for every other row); this core then

* runs the conv over every row in the conv kernel's prefix-caching form:
  block columns ``[read, write]`` per row, the initial conv state taken from
  the first and the final one stored in the second (rows that read out of
  place are at least as long as the conv state, so none takes the kernel's
  short-chunk branch, which writes where it read);
* advances the decode rows in place, as upstream does;
* gathers the prefill rows' initial recurrent states from the read blocks,
  runs the chunked delta rule and scatters the final states into the write
  blocks.

A batch of decodes only reads out of place as well (``_decodes_only``:
the conv update's prefix-caching form, the recurrent update's speculative
form), taking upstream's unpacked decode kernel where upstream would take
its packed one. Every other batch (speculative rows, or metadata without
read blocks) runs upstream's core unchanged. The kernels are upstream's; which
arguments each takes is checked in ``tests/kernels/test_state_out_of_place.py``
and the whole core against upstream's after a copy in
``tests/kernels/test_gdn_out_of_place.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import vllm.forward_context as forward_context
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from vllm_hybrid.patches.registry import upstream_of

if TYPE_CHECKING:
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

#: ``causal_conv1d_fn`` divides positions by this when the prefix-caching form
#: is on; no intermediate block states are stored (first == last column), so
#: any multiple of the kernel's 8-token tile does.
_CONV_ALIGN_TOKENS = 8


def _gdn_metadata(layer: QwenGatedDeltaNetAttention) -> GDNAttentionMetadata | None:
    raw = forward_context.get_forward_context().attn_metadata
    metadata = raw.get(layer.prefix) if isinstance(raw, dict) else None
    return metadata if isinstance(metadata, GDNAttentionMetadata) else None


def reads_elsewhere(metadata: GDNAttentionMetadata | None) -> bool:
    """Whether this core (rather than upstream's) runs the batch."""
    return (
        metadata is not None
        and getattr(metadata, "read_state_indices", None) is not None
        and metadata.spec_sequence_masks is None
        and (metadata.num_prefills > 0 or metadata.num_decodes > 0)
    )


def forward_core(
    self: QwenGatedDeltaNetAttention,
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    core_attn_out: torch.Tensor,
) -> None:
    """``QwenGatedDeltaNetAttention._forward_core`` with prefill chunks
    reading out of place (module docstring)."""
    metadata = _gdn_metadata(self)
    if not reads_elsewhere(metadata):
        upstream_of(__name__, "forward_core")(self, mixed_qkv, b, a, core_attn_out)
        return
    n = metadata.num_actual_tokens
    core = _with_prefills if metadata.num_prefills > 0 else _decodes_only
    core_attn_out[:n] = core(self, metadata, mixed_qkv[:n], b[:n], a[:n]).squeeze(0)


def _conv_state(self: QwenGatedDeltaNetAttention) -> torch.Tensor:
    """The layer's conv states as the conv kernels take them, ``(..., dim,
    width - 1)``: stored so in the dim-first layout, transposed otherwise."""
    cache = self.kv_cache[0]
    return cache if gdn.is_conv_state_dim_first() else cache.transpose(-1, -2)


def _conv_weight(self: QwenGatedDeltaNetAttention) -> torch.Tensor:
    """The conv1d weight as the conv kernels take it, ``(dim, width)``."""
    weight = self.conv1d.weight
    return weight.view(weight.size(0), weight.size(2))


def _recurrent_decode(
    self: QwenGatedDeltaNetAttention,
    conv_out: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    accepted: torch.Tensor | None = None,
) -> torch.Tensor:
    """Upstream's unpacked recurrent update of one token per row: in place
    with one state id per row, or in its speculative form with ``[write,
    read]`` columns and ``accepted`` tokens."""
    q, k, v = self.rearrange_mixed_qkv(conv_out)
    out, _ = gdn.fused_sigmoid_gating_delta_rule_update(
        A_log=self.A_log,
        a=a,
        b=b,
        dt_bias=self.dt_bias,
        q=q,
        k=k,
        v=v,
        initial_state=self.kv_cache[1],
        inplace_final_state=True,
        cu_seqlens=cu_seqlens,
        ssm_state_indices=state_indices,
        num_accepted_tokens=accepted,
        use_qk_l2norm_in_kernel=True,
    )
    return out


def _decodes_only(
    self: QwenGatedDeltaNetAttention,
    metadata: GDNAttentionMetadata,
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
) -> torch.Tensor:
    """A batch of decodes only (full CUDA graphs replay these): the conv
    update in its prefix-caching form, the recurrent update in its
    speculative-decoding form with one token per row, two accepted tokens
    and columns ``[write, read]`` (it reads column ``accepted - 1``, writes
    column 0). Rows whose two blocks are one advance in place; padded rows
    carry the null block in both, which the kernels skip."""
    n = metadata.num_actual_tokens
    write = metadata.non_spec_state_indices_tensor[:n]
    read = metadata.read_state_indices[:n].to(write.dtype)
    zeros = torch.zeros(n, dtype=torch.int32, device=write.device)
    conv_out = gdn.causal_conv1d_update(
        mixed_qkv,
        _conv_state(self),
        _conv_weight(self),
        self.conv1d.bias,
        self.activation,
        conv_state_indices=torch.stack((read, write), dim=1),
        initial_state_idx=zeros,
        block_idx_last_scheduled_token=zeros + 1,
        validate_data=False,
    )
    return _recurrent_decode(
        self,
        conv_out,
        b,
        a,
        metadata.non_spec_query_start_loc[: n + 1],
        torch.stack((write, read), dim=1),
        zeros + 2,
    )


def _conv(
    self: QwenGatedDeltaNetAttention,
    metadata: GDNAttentionMetadata,
    mixed_qkv: torch.Tensor,
) -> torch.Tensor:
    write = metadata.non_spec_state_indices_tensor
    read = metadata.read_state_indices
    rows = write.shape[0]
    zeros = torch.zeros(rows, dtype=torch.int32, device=write.device)
    return gdn.causal_conv1d_fn(
        mixed_qkv.transpose(0, 1),
        _conv_weight(self),
        self.conv1d.bias,
        activation=self.activation,
        conv_states=_conv_state(self),
        has_initial_state=metadata.has_initial_state,
        cache_indices=torch.stack((read.to(write.dtype), write), dim=1),
        query_start_loc=metadata.non_spec_query_start_loc,
        initial_state_idx=zeros,
        block_idx_first_scheduled_token=zeros + 1,
        block_idx_last_scheduled_token=zeros + 1,
        num_computed_tokens=zeros,
        block_size_to_align=_CONV_ALIGN_TOKENS,
        metadata=metadata,
    ).transpose(0, 1)


def _decodes(
    self: QwenGatedDeltaNetAttention,
    metadata: GDNAttentionMetadata,
    conv_out: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
) -> torch.Tensor:
    """The decode rows (first in the batch), advanced in place."""
    n = metadata.num_decode_tokens
    return _recurrent_decode(
        self,
        conv_out[:n],
        b[:n],
        a[:n],
        metadata.non_spec_query_start_loc[: metadata.num_decodes + 1],
        metadata.non_spec_state_indices_tensor,
    )


def _prefills(
    self: QwenGatedDeltaNetAttention,
    metadata: GDNAttentionMetadata,
    conv_out: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
) -> torch.Tensor:
    """The prefill rows: initial states from the read blocks, final states
    into the write blocks."""
    n = metadata.num_decode_tokens
    q, k, v, g, beta = gdn.fused_post_conv_prep(
        conv_output=conv_out[n:],
        a=a[n:],
        b=b[n:],
        A_log=self.A_log,
        dt_bias=self.dt_bias,
        num_k_heads=self.num_k_heads // self.tp_size,
        head_k_dim=self.head_k_dim,
        head_v_dim=self.head_v_dim,
        apply_l2norm=True,
        output_g_exp=False,
    )
    ssm_state = self.kv_cache[1]
    read = metadata.read_state_indices[metadata.num_decodes :]
    initial_state = ssm_state[read.long()]
    initial_state[~metadata.prefill_has_initial_state, ...] = 0
    out, final_state = self.chunk_gated_delta_rule(
        q=q.unsqueeze(0),
        k=k.unsqueeze(0),
        v=v.unsqueeze(0),
        g=g.unsqueeze(0),
        beta=beta.unsqueeze(0),
        initial_state=initial_state,
        output_final_state=True,
        cu_seqlens=metadata.prefill_query_start_loc,
        chunk_indices=metadata.chunk_indices,
        chunk_offsets=metadata.chunk_offsets,
        use_qk_l2norm_in_kernel=False,
        aiter_prefill_metadata=metadata.aiter_prefill_metadata,
    )
    ssm_state[metadata.prefill_state_indices] = final_state.to(ssm_state.dtype)
    return out


def _with_prefills(
    self: QwenGatedDeltaNetAttention,
    metadata: GDNAttentionMetadata,
    mixed_qkv: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
) -> torch.Tensor:
    """A batch with prefill rows: decodes first, in place, as upstream
    orders both the kernels and the output rows; then the prefills."""
    conv_out = _conv(self, metadata, mixed_qkv)
    decoded = _decodes(self, metadata, conv_out, b, a) if metadata.num_decodes else None
    out = _prefills(self, metadata, conv_out, b, a)
    return out if decoded is None else torch.cat((decoded, out), dim=1)
