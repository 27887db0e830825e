"""A Mamba2 mixer's state kernels, as they run on CUDA, on given states.

Mirrors the part of ``MambaMixer2.forward`` in
``vllm/model_executor/layers/mamba/mamba_mixer2.py`` that touches the state
views (no speculative decoding, no ReplaySSM, no prefill checkpoints):

* prefills: ``causal_conv1d_fn`` with the conv-state views and
  ``state_indices_tensor_p``, then ``mamba_chunk_scan_combined_varlen`` on
  initial states gathered from the SSM views (``torch.where(has_initial,
  ssm_state[ids], 0)``), whose final states are scattered back;
* decodes: ``causal_conv1d_update`` and ``selective_state_update`` in place
  on the views with ``state_indices_tensor_d`` (shape ``(decodes, 1)``, as the
  builder slices it); CUDA-graph padding rows carry state id 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from arena_views import NEMOTRON_H_MAMBA2
from state_ops import (
    INTERPRETING,
    causal_conv1d,
    conv_metadata,
    conv_view,
    mamba_ssm,
    query_start_loc,
    same_inputs_same_outputs,
    seeded,
    ssd_combined,
)
from vllm.v1.attention.backends.mamba2_attn import compute_varlen_chunk_metadata

NH = NEMOTRON_H_MAMBA2["num_heads"]
HD = NEMOTRON_H_MAMBA2["head_dim"]
NG = NEMOTRON_H_MAMBA2["n_groups"]
DS = NEMOTRON_H_MAMBA2["state_size"]
CONV_DIM = NH * HD + 2 * NG * DS
#: Nemotron-H's ``chunk_size``.
CHUNK_SIZE = 128


@dataclass(frozen=True)
class Mamba2Weights:
    conv: torch.Tensor  # (CONV_DIM, width)
    conv_bias: torch.Tensor  # (CONV_DIM,)
    A: torch.Tensor  # (NH,) float32, negative
    D: torch.Tensor  # (NH,) float32
    dt_bias: torch.Tensor  # (NH,) float32


def mamba2_weights(seed: int = 31) -> Mamba2Weights:
    width = NEMOTRON_H_MAMBA2["conv_kernel"]
    return Mamba2Weights(
        conv=seeded((CONV_DIM, width), seed, scale=0.5),
        conv_bias=seeded((CONV_DIM,), seed + 1, scale=0.1),
        A=-seeded((NH,), seed + 2, dtype=torch.float32).abs(),
        D=seeded((NH,), seed + 3, dtype=torch.float32),
        dt_bias=seeded((NH,), seed + 4, scale=0.5, dtype=torch.float32),
    )


@dataclass
class Mamba2Batch:
    """One step's mixer inputs after ``in_proj``: decodes first."""

    lens: list[int]
    has_initial_state: list[bool]
    seed: int = 41
    xbc: torch.Tensor = field(init=False)  # hidden_states_B_C
    dt: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        tokens = sum(self.lens)
        self.xbc = seeded((tokens, CONV_DIM), self.seed)
        self.dt = seeded((tokens, NH), self.seed + 1)

    @property
    def num_decodes(self) -> int:
        return next((i for i, n in enumerate(self.lens) if n != 1), len(self.lens))


@same_inputs_same_outputs
def chunk_scan(x, dt, A, B, C, D, dt_bias, initial_states, qsl, state_dtype):
    """``mamba_chunk_scan_combined_varlen`` as the mixer calls it; returns the
    final states and the output it writes into its ``out`` argument."""
    cu_chunk, last_chunk, seq_idx = compute_varlen_chunk_metadata(qsl, CHUNK_SIZE)
    out = torch.empty_like(x)
    states = ssd_combined.mamba_chunk_scan_combined_varlen(
        x,
        dt,
        A,
        B,
        C,
        chunk_size=CHUNK_SIZE,
        D=D,
        z=None,
        dt_bias=dt_bias,
        seq_idx=seq_idx,
        cu_seqlens=qsl,
        cu_chunk_seqlens=cu_chunk,
        last_chunk_indices=last_chunk,
        initial_states=initial_states,
        return_intermediate_states=False,
        dt_softplus=True,
        dt_limit=(0.0, float("inf")),
        out=out,
        state_dtype=state_dtype,
    )
    return states, out


def mamba2_step(
    states: Mapping[str, tuple[torch.Tensor, ...]],
    state_ids: torch.Tensor,
    batch: Mamba2Batch,
    weights: Mamba2Weights,
) -> torch.Tensor:
    """The batch through every layer; returns the SSM outputs."""
    return torch.cat(
        [
            _mixer(states[layer], state_ids, batch, weights).reshape(-1)
            for layer in states
        ]
    )


def _mixer(
    layer_states, state_ids, batch: Mamba2Batch, w: Mamba2Weights
) -> torch.Tensor:
    conv_state, ssm_state = conv_view(layer_states[0]), layer_states[1]
    nd = batch.num_decodes
    out = torch.zeros(
        (batch.xbc.shape[0], NH, HD), dtype=batch.xbc.dtype, device=state_ids.device
    )
    if nd < len(batch.lens):
        out[nd:] = _prefill(conv_state, ssm_state, state_ids[nd:], batch, w)
    if nd:
        out[:nd] = _decode(
            conv_state, ssm_state, state_ids[:nd].unsqueeze(-1), batch, w
        )
    return out


def _split(xbc: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.split(xbc, [NH * HD, NG * DS, NG * DS], dim=-1)


def _prefill(conv_state, ssm_state, ids_p, batch: Mamba2Batch, w: Mamba2Weights):
    nd, device = batch.num_decodes, ids_p.device
    xbc = batch.xbc[nd:]
    tokens = xbc.shape[0]
    qsl_cpu = query_start_loc(batch.lens[nd:])
    has_initial = torch.tensor(batch.has_initial_state[nd:], device=device)
    conv_out = causal_conv1d.causal_conv1d_fn(
        xbc.transpose(0, 1),
        w.conv,
        w.conv_bias,
        activation="silu",
        conv_states=conv_state,
        has_initial_state=has_initial,
        cache_indices=ids_p,
        metadata=conv_metadata(qsl_cpu),
        query_start_loc=qsl_cpu.to(device),
    ).transpose(0, 1)[:tokens]
    x, B, C = _split(conv_out)
    initial = None
    if any(batch.has_initial_state[nd:]):
        initial = torch.where(has_initial[:, None, None, None], ssm_state[ids_p], 0)
    final, out = chunk_scan(
        x.reshape(tokens, NH, HD),
        batch.dt[nd:],
        w.A,
        B.reshape(tokens, NG, DS),
        C.reshape(tokens, NG, DS),
        w.D,
        w.dt_bias,
        initial,
        qsl_cpu.to(device),
        ssm_state.dtype,
    )
    ssm_state[ids_p] = final
    return out


def _decode(conv_state, ssm_state, ids_d, batch: Mamba2Batch, w: Mamba2Weights):
    nd = batch.num_decodes
    conv_out = causal_conv1d.causal_conv1d_update(
        batch.xbc[:nd].clone(),
        conv_state,
        w.conv,
        w.conv_bias,
        "silu",
        conv_state_indices=ids_d,
        num_accepted_tokens=None,
        query_start_loc=None,
        max_query_len=ids_d.size(-1),
    )
    x, B, C = _split(conv_out)
    out = torch.empty((nd, NH, HD), dtype=x.dtype, device=x.device)
    with _interpreter_block_size():
        mamba_ssm.selective_state_update(
            ssm_state,
            x.reshape(nd, NH, HD),
            batch.dt[:nd, :, None].expand(-1, -1, HD),
            w.A[:, None, None].expand(-1, HD, DS).to(torch.float32),
            B.reshape(nd, NG, DS),
            C.reshape(nd, NG, DS),
            w.D[:, None].expand(-1, HD),
            w.dt_bias[:, None].expand(-1, HD),
            dt_softplus=True,
            state_batch_indices=ids_d,
            dst_state_batch_indices=ids_d,
            out=out,
            num_accepted_tokens=None,
            cu_seqlens=None,
            is_blackwell=False,
        )
    return out


def _interpreter_block_size():
    """One program per (request, head) in the interpreter, through
    upstream's own config hook; compiled runs keep the tuned config."""
    if INTERPRETING:
        return mamba_ssm.override_ssm_config((HD, 4))
    return nullcontext()
