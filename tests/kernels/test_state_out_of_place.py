"""Upstream's GDN state kernels can read a state in one block and write the
advanced state into another, with no change to the kernels.

Align mode keeps a checkpoint by copying the running state into a fresh
block before the step and advancing the copy in place, so the block left
behind keeps the state at its edge. Each such copy moves a whole state
(61.4 MiB for Qwen3.6-35B-A3B). A runner that hands each kernel a *read*
block and a *write* block instead would keep the same checkpoint with no
copy. These tests check, for every kernel the GDN layer calls, that the
arguments upstream already accepts do exactly that:

* ``causal_conv1d_update`` (decode) and ``causal_conv1d_fn`` (prefill) in
  their prefix-caching form: a 2-D index tensor per request plus
  ``initial_state_idx`` (the column read) and
  ``block_idx_last_scheduled_token`` (the column written); a prefill chunk
  shorter than the conv state is the exception (it is shifted where it was
  read);
* ``fused_recurrent_gated_delta_rule`` and
  ``fused_sigmoid_gating_delta_rule_update`` (decode) in their
  speculative-decoding form: 2-D indices, the state read from column
  ``num_accepted_tokens - 1`` and the state after token ``t`` written to
  column ``t``; one token with ``num_accepted_tokens = 2`` reads column 1
  and writes column 0;
* the chunked prefill gathers its initial states and scatters its final
  states in the layer (no kernel change at all; not tested here).

Each case runs the out-of-place call and the copy-then-in-place reference on
equal state tensors and requires bitwise equal outputs and bitwise equal
state tensors afterwards: the read block still holds the checkpoint, the
write block the advanced state, nothing else changed. Shapes are small
(the kernels are shape-generic) so the interpreter takes seconds.
"""

from __future__ import annotations

import pytest
import torch
from arena_views import DEVICE
from state_ops import causal_conv1d, conv_metadata, query_start_loc, seeded
from vllm.third_party.flash_linear_attention.ops import (
    fused_recurrent_gated_delta_rule,
    fused_sigmoid_gating_delta_rule_update,
)

H, HV, K, V = 2, 4, 16, 16
CONV_DIM = 2 * H * K + HV * V
WIDTH = 4
#: state blocks in the cache; block 0 is the null block
BLOCKS = 8
#: (read, write) block per request
PAIRS = [(2, 5), (3, 7)]


def _ids(column: int) -> torch.Tensor:
    return torch.tensor([p[column] for p in PAIRS], dtype=torch.int32, device=DEVICE)


def _columns(*order: int) -> torch.Tensor:
    """Per request, the read/write block ids in the given column order."""
    rows = [[p[c] for c in order] for p in PAIRS]
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def _per_request(value: int) -> torch.Tensor:
    return torch.full((len(PAIRS),), value, dtype=torch.int32, device=DEVICE)


def _copy_read_to_write(state: torch.Tensor) -> None:
    """What align mode's runner does before the step."""
    state[_ids(1).long()] = state[_ids(0).long()]


def _conv_states() -> torch.Tensor:
    # (blocks, dim, width - 1): the dim-first view the conv kernels take
    return seeded((BLOCKS, WIDTH - 1, CONV_DIM), 3).transpose(1, 2)


def _assert_same(out, ref_out, state, ref_state) -> None:
    assert torch.equal(out, ref_out)
    assert torch.equal(state, ref_state)
    # the checkpoint stayed where it was read, the write block moved on
    read, write = _ids(0).long(), _ids(1).long()
    assert not torch.equal(state[read], state[write])


def test_conv_update_reads_one_block_writes_another():
    weight = seeded((CONV_DIM, WIDTH), 4, scale=0.5)
    x = seeded((len(PAIRS), CONV_DIM), 5)
    state, ref_state = _conv_states(), _conv_states()

    _copy_read_to_write(ref_state)
    ref_out = causal_conv1d.causal_conv1d_update(
        x.clone(), ref_state, weight, None, "silu", conv_state_indices=_ids(1)
    )
    out = causal_conv1d.causal_conv1d_update(
        x.clone(),
        state,
        weight,
        None,
        "silu",
        conv_state_indices=_columns(0, 1),
        initial_state_idx=_per_request(0),
        block_idx_last_scheduled_token=_per_request(1),
    )
    _assert_same(out, ref_out, state, ref_state)


def _conv_prefill(lens: list[int], state: torch.Tensor, **indices) -> torch.Tensor:
    """``causal_conv1d_fn`` over one chunk per request, each continuing
    from its state."""
    qsl = query_start_loc(lens)
    return causal_conv1d.causal_conv1d_fn(
        seeded((sum(lens), CONV_DIM), 6).transpose(0, 1),
        seeded((CONV_DIM, WIDTH), 4, scale=0.5),
        None,
        activation="silu",
        conv_states=state,
        has_initial_state=torch.ones(len(lens), dtype=torch.bool, device=DEVICE),
        query_start_loc=qsl.to(DEVICE),
        metadata=conv_metadata(qsl),
        **indices,
    )


def _conv_prefill_out_of_place(lens: list[int], state: torch.Tensor) -> torch.Tensor:
    return _conv_prefill(
        lens,
        state,
        cache_indices=_columns(0, 1),
        initial_state_idx=_per_request(0),
        block_idx_first_scheduled_token=_per_request(1),
        block_idx_last_scheduled_token=_per_request(1),
        num_computed_tokens=_per_request(64),
        block_size_to_align=64,
    )


@pytest.mark.parametrize("lens", [[3, 3], [9, 20]], ids=["state-long", "longer"])
def test_conv_prefill_reads_one_block_writes_another(lens):
    """A prefill chunk continuing from a checkpoint, at least as long as the
    conv state (``WIDTH - 1`` tokens)."""
    state, ref_state = _conv_states(), _conv_states()
    _copy_read_to_write(ref_state)
    ref_out = _conv_prefill(lens, ref_state, cache_indices=_ids(1))
    out = _conv_prefill_out_of_place(lens, state)
    _assert_same(out, ref_out, state, ref_state)


def test_conv_prefill_shorter_than_its_state_writes_where_it_read():
    """A chunk shorter than the conv state shifts the state in place: the
    kernel's short-chunk branch writes the block it read, whatever column
    ``block_idx_last_scheduled_token`` names. A runner writing out of place
    copies the (small) conv state for such chunks first."""
    lens = [2, 1]
    state, ref_state, before = _conv_states(), _conv_states(), _conv_states()
    _copy_read_to_write(ref_state)
    ref_out = _conv_prefill(lens, ref_state, cache_indices=_ids(1))
    out = _conv_prefill_out_of_place(lens, state)
    read, write = _ids(0).long(), _ids(1).long()
    assert torch.equal(out, ref_out)
    assert torch.equal(state[read], ref_state[write])
    assert torch.equal(state[write], before[write])
    assert not torch.equal(state[read], before[read])


def _decode_inputs(seed: int):
    n = len(PAIRS)
    q = seeded((1, n, H, K), seed)
    k = seeded((1, n, H, K), seed + 1)
    v = seeded((1, n, HV, V), seed + 2)
    return q, k, v


def _ssm_states() -> torch.Tensor:
    return seeded((BLOCKS, HV, V, K), 9, scale=0.1, dtype=torch.float32)


def test_recurrent_decode_reads_one_block_writes_another():
    q, k, v = _decode_inputs(12)
    n = len(PAIRS)
    g = seeded((1, n, HV), 15, scale=0.1, dtype=torch.float32).sigmoid().log()
    beta = seeded((1, n, HV), 16).sigmoid()
    cu = query_start_loc([1] * n).to(DEVICE)
    state, ref_state = _ssm_states(), _ssm_states()
    common = dict(q=q, k=k, v=v, g=g, beta=beta, inplace_final_state=True)

    _copy_read_to_write(ref_state)
    ref_out, _ = fused_recurrent_gated_delta_rule(
        **common, initial_state=ref_state, cu_seqlens=cu, ssm_state_indices=_ids(1)
    )
    out, _ = fused_recurrent_gated_delta_rule(
        **common,
        initial_state=state,
        cu_seqlens=cu,
        ssm_state_indices=_columns(1, 0),
        num_accepted_tokens=_per_request(2),
    )
    _assert_same(out, ref_out, state, ref_state)


def test_sigmoid_gating_decode_reads_one_block_writes_another():
    """The decode kernel of batches that also hold prefills."""
    q, k, v = _decode_inputs(22)
    n = len(PAIRS)
    a = seeded((n, HV), 25)
    b = seeded((n, HV), 26)
    A_log = seeded((HV,), 27, scale=0.5, dtype=torch.float32)
    dt_bias = seeded((HV,), 28, scale=0.5, dtype=torch.float32)
    cu = query_start_loc([1] * n).to(DEVICE)
    state, ref_state = _ssm_states(), _ssm_states()
    common = dict(
        A_log=A_log,
        a=a,
        b=b,
        dt_bias=dt_bias,
        q=q,
        k=k,
        v=v,
        inplace_final_state=True,
        cu_seqlens=cu,
        use_qk_l2norm_in_kernel=True,
    )

    _copy_read_to_write(ref_state)
    ref_out, _ = fused_sigmoid_gating_delta_rule_update(
        **common, initial_state=ref_state, ssm_state_indices=_ids(1)
    )
    out, _ = fused_sigmoid_gating_delta_rule_update(
        **common,
        initial_state=state,
        ssm_state_indices=_columns(1, 0),
        num_accepted_tokens=_per_request(2),
    )
    _assert_same(out, ref_out, state, ref_state)
