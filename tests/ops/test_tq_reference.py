"""TurboQuant torch reference: layout, exact codes, error bounds, paging."""

from __future__ import annotations

import math

import pytest
import torch
from tq_spec import exact_attention, spec_quantize

from vllm_hybrid.ops.turboquant import TQ_CACHE_DTYPES, TQLayout, reference

F16_REL = 2.0**-11  # fp16 round-to-nearest relative error


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("preset", TQ_CACHE_DTYPES)
def test_slot_bytes_match_upstream(preset: str, head_dim: int) -> None:
    from vllm.model_executor.layers.quantization.turboquant.config import (
        TurboQuantConfig,
    )

    layout = TQLayout.from_cache_dtype(preset, head_dim)
    upstream = TurboQuantConfig.from_cache_dtype(preset, head_dim)
    assert layout.slot_bytes == upstream.slot_size_aligned
    assert layout.key_bytes == upstream.key_packed_size
    assert layout.value_bytes == upstream.value_packed_size
    assert layout.key_bytes + layout.value_bytes <= layout.slot_bytes


def test_k8v4_slot_is_388_bytes_at_256() -> None:
    assert TQLayout.from_cache_dtype("turboquant_k8v4", 256).slot_bytes == 388


def test_unknown_preset_is_rejected() -> None:
    with pytest.raises(ValueError, match="turboquant_k8v4"):
        TQLayout.from_cache_dtype("fp8", 128)


def _kv(m: int, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(m, d, generator=g) * 2.0
    v = torch.randn(m, d, generator=g)
    # A constant row exercises the 1e-8 scale floor; a big row fp8 saturation.
    v[0] = 0.25
    k[1, :4] = torch.tensor([500.0, -1000.0, 1e-4, -3e-3])
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("preset", TQ_CACHE_DTYPES)
def test_codes_match_float64_spec(preset: str, dtype: torch.dtype) -> None:
    layout = TQLayout.from_cache_dtype(preset, 128)
    k, v = _kv(48, 128, dtype, seed=1)
    got = reference.quantize(k.view(24, 2, 128), v.view(24, 2, 128), layout)
    got = got.view(48, -1)
    spec = spec_quantize(k.float(), v.float(), layout)
    differ = got != spec.data
    assert not (differ & ~spec.ambiguous).any(), differ.nonzero()[:8]
    # Ambiguity must stay rare, or the comparison would prove nothing.
    assert spec.ambiguous.float().mean() < 1e-2


@pytest.mark.parametrize("preset", TQ_CACHE_DTYPES)
def test_dequantized_values_within_bound(preset: str) -> None:
    layout = TQLayout.from_cache_dtype(preset, 256)
    k, v = _kv(64, 256, torch.float32, seed=2)
    slots = reference.quantize(k.view(64, 1, 256), v.view(64, 1, 256), layout)
    k_hat, v_hat = reference.dequantize(slots.view(64, -1), layout)

    levels = (1 << layout.value_bits) - 1
    lo = v.min(-1).values
    scale = ((v.max(-1).values - lo) / levels).clamp(min=1e-8)
    bound = scale / 2 + levels * scale * F16_REL + lo.abs() * F16_REL + 1e-6
    err = (v_hat - v).abs().max(-1).values
    assert (err <= bound).all(), (err / bound).max()
    # The bound is not loose by orders of magnitude.
    assert (err / bound).max() > 0.5

    if layout.key_fp8:
        kk = k.clamp(-448, 448)
        bound = torch.maximum(kk.abs() * 2.0**-4, torch.full_like(kk, 2.0**-10))
        assert ((k_hat - kk).abs() <= bound).all()
        assert k_hat[1, 1] == -448.0  # saturated, not NaN
    else:
        spec = spec_quantize(k, v, layout)
        # ||k - k_hat|| <= n*(||y - c|| + |1 - ||c|| |) + fp16(n) error,
        # with |y_j - c_j| bounded by the half cell of each code.
        cell = spec.key_cell.norm(dim=-1)
        n = spec.norms
        c_norm_err = _centroid_norm_error(slots.view(64, -1), layout)
        bound = n * (cell + c_norm_err) + n * F16_REL + 1e-5
        err = (k_hat.double() - k.double()).norm(dim=-1)
        assert (err <= bound).all(), (err / bound).max()


def _centroid_norm_error(slots: torch.Tensor, layout: TQLayout) -> torch.Tensor:
    from vllm_hybrid.ops.turboquant.layout import key_tables

    cents, _ = key_tables(layout)
    codes = reference.unpack_codes(
        slots[:, : layout.key_code_bytes], layout.key_bits, layout.head_dim
    )
    c_norm = cents[codes].double().norm(dim=-1)
    return (c_norm - 1).abs() if layout.norm_correction else torch.zeros_like(c_norm)


# ------------------------------------------------------------ store + attention


def _make_batch(layout, block_size, q_lens, ctx_lens, heads=2, q_heads=4, seed=0):
    """Store each request's whole context via ``store`` (scattered blocks)."""
    g = torch.Generator().manual_seed(seed)
    d = layout.head_dim
    per_req = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(per_req) + 3
    cache = torch.zeros(
        num_blocks, block_size, heads, layout.slot_bytes, dtype=torch.uint8
    )
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(ctx_lens), max(per_req), dtype=torch.int32)
    keys, vals, used = [], [], 0
    for b, ctx in enumerate(ctx_lens):
        table[b, : per_req[b]] = perm[used : used + per_req[b]].to(torch.int32)
        used += per_req[b]
        k = torch.randn(ctx, heads, d, generator=g)
        v = torch.randn(ctx, heads, d, generator=g)
        pos = torch.arange(ctx)
        slots = table[b, pos // block_size].long() * block_size + pos % block_size
        # Interleave padding tokens (slot -1) that must not be written.
        pad = torch.full((3,), -1, dtype=torch.int64)
        kp = torch.cat([k, torch.full((3, heads, d), 1e4)])
        vp = torch.cat([v, torch.full((3, heads, d), 1e4)])
        reference.store(kp, vp, cache, torch.cat([slots, pad]), layout)
        keys.append(k)
        vals.append(v)
    q = torch.randn(sum(q_lens), q_heads, d, generator=g)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(ctx_lens, dtype=torch.int32)
    return q, cache, table, seq, qsl, keys, vals


@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_3bit_nc"])
def test_paged_attention_matches_dense_attention(preset: str, block_size: int) -> None:
    layout = TQLayout.from_cache_dtype(preset, 64)
    # prefill, chunked prefill over a prefix, decode, prefix hit + 1 token
    q_lens, ctx_lens = [20, 7, 1, 1], [20, 150, 33, 129]
    q, cache, table, seq, qsl, keys, vals = _make_batch(
        layout, block_size, q_lens, ctx_lens
    )
    assert (cache.view(-1, layout.slot_bytes) != 0).any(-1).sum() == sum(ctx_lens) * 2
    out = reference.paged_attention(q, cache, table, seq, qsl, 0.125, layout)
    for b in range(len(q_lens)):
        n = ctx_lens[b]
        slots = reference.quantize(keys[b], vals[b], layout)
        k_hat, v_hat = reference.dequantize(slots, layout)
        want = exact_attention(
            q[qsl[b] : qsl[b + 1]], k_hat, v_hat, 0.125, n - q_lens[b]
        )
        got = out[qsl[b] : qsl[b + 1]].double()
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_store_skips_negative_slots_and_keeps_other_bytes() -> None:
    layout = TQLayout.from_cache_dtype("turboquant_k8v4", 64)
    cache = torch.full((2, 16, 1, layout.slot_bytes), 7, dtype=torch.uint8)
    k = torch.randn(3, 1, 64)
    reference.store(k, k, cache, torch.tensor([5, -1, 17]), layout)
    flat = cache.view(32, -1)
    touched = (flat != 7).any(-1).nonzero().flatten().tolist()
    assert touched == [5, 17]
    assert torch.equal(flat[17], reference.quantize(k[2:], k[2:], layout).view(-1))
