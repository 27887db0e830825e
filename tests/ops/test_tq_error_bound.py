"""Attention-output error of each preset vs exact attention, against the bound
derived in docs/turboquant.md ("Attention error bound")."""

from __future__ import annotations

import math

import pytest
import torch
from tq_spec import exact_attention

from vllm_hybrid.ops.turboquant import TQ_CACHE_DTYPES, TQLayout, reference

D, H, HQ, CTX, NQ = 128, 2, 8, 256, 8
Z = 6.0  # Gaussian tail multiple: P(|N(0,1)| > 6) = 2e-9 per output element
F16_REL = 2.0**-11


def lloyd_max_distortion(bits: int) -> float:
    """E[(x - Q(x))^2] of the preset's centroids for x ~ N(0, 1), in units of
    the coordinate variance (upstream scales centroids to N(0, 1/D))."""
    from vllm_hybrid.ops.turboquant.layout import centroids

    c = centroids((D, bits)).double() * math.sqrt(D)
    x = torch.linspace(-8, 8, 400_001, dtype=torch.float64)
    pdf = torch.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    err = (x.unsqueeze(1) - c).abs().min(1).values
    return float(torch.trapezoid(err * err * pdf, x))


def key_rel_mse(layout: TQLayout) -> float:
    """Expected squared relative key error rho^2 (docs: eq. K)."""
    if layout.key_fp8:
        return 2.0**-8 / 3  # rounding error uniform within +-2^-4 |k|
    return lloyd_max_distortion(layout.key_bits) + F16_REL**2


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(CTX, H, D, generator=g)
    v = torch.randn(CTX, H, D, generator=g)
    q = torch.randn(NQ, HQ, D, generator=g)
    return q, k, v


def _quantized_attention(layout, q, k, v, scale):
    cache = torch.zeros(CTX // 16, 16, H, layout.slot_bytes, dtype=torch.uint8)
    reference.store(k, v, cache, torch.arange(CTX), layout)
    table = torch.arange(CTX // 16, dtype=torch.int32).unsqueeze(0)
    seq = torch.tensor([CTX], dtype=torch.int32)
    qsl = torch.tensor([0, NQ], dtype=torch.int32)
    return reference.paged_attention(q, cache, table, seq, qsl, scale, layout)


def error_bound(layout, q, k, v, scale) -> torch.Tensor:
    """Per-output bound ``[NQ, HQ, D]`` (docs: eq. B)."""
    q, k, v = q.double(), k.double(), v.double()
    g = HQ // H
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # [S, HQ, D]
    scores = torch.einsum("qhd,shd->qhs", q, kk) * scale
    pos = torch.arange(CTX)
    visible = pos.view(1, 1, -1) <= (CTX - NQ + torch.arange(NQ)).view(-1, 1, 1)
    p = torch.softmax(scores.masked_fill(~visible, -math.inf), -1)  # [Q, HQ, S]
    o = torch.einsum("qhs,shd->qhd", p, vv)

    levels = (1 << layout.value_bits) - 1
    lo = v.amin(-1)
    s = ((v.amax(-1) - lo) / levels).repeat_interleave(g, 1)  # [S, HQ]
    rho2 = key_rel_mse(layout)
    if layout.key_fp8:  # error variance per coordinate ~ k_d^2
        var_delta = scale**2 * rho2 * torch.einsum("qhd,shd->qhs", q * q, kk * kk)
    else:  # isotropic in the rotated space
        qn = (q * q).sum(-1, keepdim=True)
        var_delta = scale**2 * rho2 * qn * (kk * kk).sum(-1).T.unsqueeze(0) / D
    # sum_i p_i^2 (s_i^2/12 + var_delta_i (v_i - o)^2), per output element
    value_term = torch.einsum("qhs,sh->qh", p * p, s * s / 12).unsqueeze(-1)
    dev2 = (vv.unsqueeze(0) - o.unsqueeze(1)) ** 2  # [Q, S, HQ, D]
    key_term = torch.einsum("qhs,qshd->qhd", p * p * var_delta, dev2)
    fp16 = (levels * s + lo.abs().repeat_interleave(g, 1)).max() * F16_REL
    return Z * torch.sqrt(value_term + key_term) + fp16


@pytest.fixture(scope="module")
def errors() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    q, k, v = _data()
    scale = D**-0.5
    exact = exact_attention(q, k, v, scale, CTX - NQ)
    out = {}
    for preset in TQ_CACHE_DTYPES:
        layout = TQLayout.from_cache_dtype(preset, D)
        got = _quantized_attention(layout, q, k, v, scale).double()
        out[preset] = ((got - exact).abs(), error_bound(layout, q, k, v, scale))
    return out


@pytest.mark.parametrize("preset", TQ_CACHE_DTYPES)
def test_error_within_derived_bound(errors, preset: str) -> None:
    err, bound = errors[preset]
    ratio = (err / bound).max().item()
    assert ratio <= 1.0, ratio
    # The bound tracks the error: the worst element uses a visible part of it.
    assert ratio >= 0.1, ratio


def test_presets_order_by_error(errors) -> None:
    rms = {p: errors[p][0].pow(2).mean().sqrt().item() for p in TQ_CACHE_DTYPES}
    assert (
        rms["turboquant_k8v4"]
        < rms["turboquant_4bit_nc"]
        < rms["turboquant_k3v4_nc"]
        <= rms["turboquant_3bit_nc"]
    ), rms
