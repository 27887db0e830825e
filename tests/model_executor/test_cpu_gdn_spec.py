"""The GDN conv of speculative decoding on CPU, for drafts of any length.

A request's rolling conv buffer must give each step the ``width - 1`` tokens
that precede its first query token, whatever the previous step proposed and
accepted. The reference is the plain causal conv over the accepted history;
vLLM 0.32's CPU fallback agrees with it only when every step runs a full set
of drafts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_hybrid.model_executor.layers.mamba.ops.cpu.gdn_spec import spec_conv_

DIM, WIDTH, NUM_SPEC = 8, 4, 3
STATE_LEN = WIDTH - 1 + NUM_SPEC


def reference(history: torch.Tensor, x: torch.Tensor, weight, bias) -> torch.Tensor:
    """Conv output of each query token over the accepted history (dim, n)."""
    seq = torch.cat([history[:, -(WIDTH - 1) :], x.T], -1).unsqueeze(0)
    return F.silu(F.conv1d(seq, weight.unsqueeze(1), bias, groups=DIM)[0]).T


def run(steps: list[tuple[int, int]], seed: int = 0) -> list[float]:
    """Each step proposes ``q`` tokens (1 real + q-1 drafts) and accepts
    ``a`` of them; returns the largest error per step against the
    reference."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(DIM, WIDTH, generator=gen)
    bias = torch.randn(DIM, generator=gen)
    history = torch.randn(DIM, WIDTH - 1, generator=gen)
    # two slots; the request uses slot 1, slot 0 must never change
    buf = torch.randn(2, DIM, STATE_LEN, generator=gen)
    buf[1, :, : WIDTH - 1] = history
    other = buf[0].clone()
    accepted, errors = 1, []
    for q, a in steps:
        x = torch.randn(q, DIM, generator=gen)
        got = spec_conv_(x, [0, q], [1], [accepted], buf, weight, bias, silu=True)
        errors.append((got - reference(history, x, weight, bias)).abs().max().item())
        history = torch.cat([history, x[:a].T], -1)
        accepted = a
    assert torch.equal(buf[0], other)
    return errors


@pytest.mark.parametrize(
    "steps",
    [
        [(4, 4), (4, 1), (4, 2), (4, 3)],  # full drafts
        [(4, 4), (1, 1), (2, 2), (4, 1)],  # n-gram: fewer drafts after a full accept
        [(2, 1), (3, 3), (1, 1), (1, 1), (4, 4), (3, 2)],
    ],
    ids=["full-drafts", "short-after-full-accept", "mixed"],
)
def test_conv_matches_the_causal_conv_over_accepted_tokens(steps):
    assert max(run(steps)) < 1e-5


def test_batch_of_requests_each_in_its_own_slot():
    gen = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(DIM, WIDTH, generator=gen), None
    buf = torch.randn(3, DIM, STATE_LEN, generator=gen)
    before = buf.clone()
    x = torch.randn(5, DIM, generator=gen)
    # request A: 3 tokens in slot 2, accepted 2 before; request B: 2 tokens in slot 0
    out = spec_conv_(x, [0, 3, 5], [2, 0], [2, 1], buf, weight, bias, silu=False)
    for rows, slot, acc in ((slice(0, 3), 2, 2), (slice(3, 5), 0, 1)):
        hist = before[slot][:, acc - 1 : acc - 1 + WIDTH - 1]
        seq = torch.cat([hist, x[rows].T], -1).unsqueeze(0)
        want = F.conv1d(seq, weight.unsqueeze(1), None, groups=DIM)[0].T
        assert torch.allclose(out[rows], want, atol=1e-6)
    assert torch.equal(buf[1], before[1])


@pytest.mark.parametrize(
    ("state_len", "lengths", "to_upstream"),
    [
        # no room for the conv history: a stand-in buffer, upstream's answer
        (0, [4, 4], True),
        (WIDTH - 2, [1, 3], True),
        # a full set of drafts (1 + NUM_SPEC tokens) each: upstream's layout
        (STATE_LEN, [4, 4], True),
        # fewer drafts: the overlay lays the buffer out itself
        (STATE_LEN, [2, 4], False),
    ],
)
def test_which_batches_go_to_upstreams_function(
    monkeypatch, state_len, lengths, to_upstream
):
    from types import SimpleNamespace

    from vllm_hybrid.model_executor.layers.mamba.ops.cpu import gdn_spec

    calls = []

    def upstream(*args):
        calls.append(args)
        return "upstream's output"

    monkeypatch.setattr(gdn_spec, "upstream_of", lambda module, name: upstream)
    monkeypatch.setattr(gdn_spec, "spec_conv_", lambda *a: calls.append("own") or x)
    monkeypatch.setattr(gdn_spec, "_gdn_module", lambda: fake_gdn)
    fake_gdn = SimpleNamespace(
        _unpacked_conv_weight=lambda layer: None,
        ops=SimpleNamespace(
            fused_sigmoid_gating_delta_rule_update_spec_cpu=lambda **kw: "own output"
        ),
    )
    layer = SimpleNamespace(
        conv1d=SimpleNamespace(bias=None),
        A_log=None,
        dt_bias=None,
        activation="silu",
        rearrange_mixed_qkv=lambda x: (x.unsqueeze(0),) * 3,
    )
    x = torch.zeros(sum(lengths), 1)
    metadata = SimpleNamespace(
        num_spec_decodes=2,
        spec_query_start_loc=torch.tensor([0, lengths[0], sum(lengths)]),
        spec_state_indices_tensor=torch.tensor([[0, 1], [4, 5]]),
        num_accepted_tokens=torch.tensor([1, 4]),
    )
    args = (layer, metadata, x, None, None, None, None, WIDTH, state_len)
    out = gdn_spec.spec_forward(*args)
    if to_upstream:
        assert out == "upstream's output"
        assert calls == [args]
    else:
        assert out == "own output"
        assert calls == ["own"]
