"""Gated-DeltaNet speculative decoding on CPU with drafts of any length.

With speculative decoding the GDN conv state of a request is a rolling
buffer of ``state_len = width - 1 + num_speculative_tokens`` columns (layout
(dim, state_len)). A step reads the ``width - 1`` columns that precede its
first query token, starting at column ``num_accepted - 1`` (how many tokens
the previous step accepted), and must leave the buffer such that the next
step finds, at column ``a - 1`` for any acceptance ``a``, the ``width - 1``
tokens up to and including its own ``a``-th token. Writing the window it
read plus its ``q`` new tokens, minus the first column, at the start of the
buffer does that: columns ``0 .. width - 2 + q - 1``.

vLLM 0.32's CPU path (``_spec_forward`` in
``vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py``) places the new
tokens at the end of the buffer instead, which is the same layout only when a
request runs a full set of drafts (``q = 1 + num_speculative_tokens``). With
fewer drafts, which n-gram proposes whenever the prompt has no longer match,
the next step reads stale columns, or the buffer slice comes up short and
the step fails (``The size of tensor a (6) must match the size of tensor b
(4)``). Its native conv kernel runs only on AMX/ARM-bf16 hosts and only when
every request has the same length.

:func:`spec_forward` keeps upstream's function for full-draft batches (and
for a ``state_len`` that leaves no room for the conv history) and otherwise
runs the conv itself with the layout above, then the same native
recurrent kernel upstream calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from vllm_hybrid.patches.registry import upstream_of

if TYPE_CHECKING:
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata


def _gdn_module() -> Any:
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    return gdn_attention


def spec_conv_(
    x: torch.Tensor,
    query_start_loc: list[int],
    slots: list[int],
    num_accepted: list[int],
    conv_buf: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
) -> torch.Tensor:
    """Causal conv of each request's ``q`` tokens (rows of ``x``, split by
    ``query_start_loc``) over its rolling buffer ``conv_buf[slot]`` (dim,
    state_len), which it updates in place; returns the conv output, one
    row per token. ``weight`` is (dim, width)."""
    dim, width = weight.shape
    out = torch.empty_like(x)
    kernel = weight.unsqueeze(1)
    for i, slot in enumerate(slots):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q = end - start
        if q == 0:
            continue
        buf = conv_buf[slot]
        first = num_accepted[i] - 1
        history = buf[:, first : first + width - 1]
        window = torch.cat([history, x[start:end].transpose(0, 1).to(buf.dtype)], -1)
        y = F.conv1d(window.unsqueeze(0), kernel, bias, groups=dim)[0]
        if silu:
            y = F.silu(y)
        out[start:end] = y.transpose(0, 1).to(out.dtype)
        buf[:, : width - 2 + q] = window[:, 1:]
    return out


def spec_forward(
    layer: Any,
    attn_metadata_i: GDNAttentionMetadata,
    mixed_qkv_spec: torch.Tensor,
    b_spec: torch.Tensor,
    a_spec: torch.Tensor,
    conv_buf: torch.Tensor,
    ssm_state: torch.Tensor,
    width: int,
    state_len: int,
) -> torch.Tensor:
    """Replacement of ``gdn_attention._spec_forward`` (same arguments)."""
    n = attn_metadata_i.num_spec_decodes
    qsl = [int(v) for v in attn_metadata_i.spec_query_start_loc[: n + 1].tolist()]
    # Tokens of a full set of drafts, from the buffer's size. A ``state_len``
    # below ``width - 1`` describes no rolling buffer (callers that hand the
    # native kernel its own state, or stand-ins): nothing to lay out here.
    full = state_len - width + 2
    if full < 1 or all(qsl[i + 1] - qsl[i] == full for i in range(n)):
        return upstream_of(__name__, "spec_forward")(
            layer,
            attn_metadata_i,
            mixed_qkv_spec,
            b_spec,
            a_spec,
            conv_buf,
            ssm_state,
            width,
            state_len,
        )
    gdn = _gdn_module()
    indices = attn_metadata_i.spec_state_indices_tensor[:n]
    accepted = attn_metadata_i.num_accepted_tokens[:n]
    conv_out = spec_conv_(
        mixed_qkv_spec,
        qsl,
        [int(v) for v in indices[:, 0].tolist()],
        [int(v) for v in accepted.tolist()],
        conv_buf,
        gdn._unpacked_conv_weight(layer),
        layer.conv1d.bias,
        layer.activation == "silu",
    )
    query, key, value = (t.squeeze(0) for t in layer.rearrange_mixed_qkv(conv_out))
    return gdn.ops.fused_sigmoid_gating_delta_rule_update_spec_cpu(
        A_log=layer.A_log,
        dt_bias=layer.dt_bias,
        q=query,
        k=key,
        v=value,
        a=a_spec,
        b=b_spec,
        initial_state_source=ssm_state,
        spec_state_indices=indices.to(torch.int32).contiguous(),
        num_accepted_tokens=accepted.to(torch.int32).contiguous(),
        cu_seqlens=attn_metadata_i.spec_query_start_loc[: n + 1]
        .to(torch.int32)
        .contiguous(),
        use_qk_l2norm_in_kernel=True,
    )
