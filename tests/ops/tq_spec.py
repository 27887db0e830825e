"""Float64 TurboQuant quantizer written straight from the specification.

Deliberately simple and independent of the package's code paths (no shared
helpers beyond upstream's centroids): it is the yardstick the torch reference
and the native kernel are measured against. ``ambiguous`` masks mark codes a
float32 implementation may legitimately round the other way because the
exact value sits within float32 noise of a decision boundary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

AMBIGUOUS = 1e-5


def hadamard64(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def centroids64(d: int, bits: int) -> torch.Tensor:
    from vllm.model_executor.layers.quantization.turboquant.centroids import (
        get_centroids,
    )

    return get_centroids(d, bits).double().sort().values


def midpoints32(d: int, bits: int) -> torch.Tensor:
    """Upstream's boundaries are fp32 midpoints of the fp32 centroids."""
    c = centroids64(d, bits).float()
    return ((c[:-1] + c[1:]) / 2).double()


def pack_bits(codes: list[int], bits: int) -> list[int]:
    """Little-endian bit stream: code j occupies bits [j*bits, (j+1)*bits)."""
    out = [0] * math.ceil(len(codes) * bits / 8)
    for j, c in enumerate(codes):
        for b in range(bits):
            if (c >> b) & 1:
                pos = j * bits + b
                out[pos // 8] |= 1 << (pos % 8)
    return out


def fp16_bytes(x: float) -> list[int]:
    return list(torch.tensor([x], dtype=torch.float16).view(torch.uint8).tolist())


def fp16_ambiguous(x: float) -> bool:
    """True when fp32 noise could move x across an fp16 rounding midpoint."""
    lo = torch.tensor([x * (1 - 1e-6)], dtype=torch.float64).half().item()
    hi = torch.tensor([x * (1 + 1e-6)], dtype=torch.float64).half().item()
    return lo != hi


def fp8_table() -> tuple[torch.Tensor, torch.Tensor]:
    """All finite float8_e4m3fn values (float64) with their byte codes."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(torch.float8_e4m3fn).double()
    finite = torch.isfinite(vals)
    return vals[finite], codes[finite].to(torch.int64)


def fp8_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest e4m3fn, ties to even code, saturating at +-448.

    Values that round to zero keep their sign (-0 is byte 0x80).
    """
    vals, codes = fp8_table()
    x = x.clamp(-448.0, 448.0)
    dist = (x.unsqueeze(-1) - vals).abs()
    best = dist.min(-1, keepdim=True).values
    tied = dist == best
    # Among tied candidates prefer the even code; for +-0 prefer x's sign.
    pref = tied.double() * 4 + (codes % 2 == 0).double() * 2
    same_sign = torch.signbit(vals) == torch.signbit(x).unsqueeze(-1)
    pref = pref + same_sign.double()
    return codes[pref.argmax(-1)]


@dataclass
class SpecSlots:
    """Expected bytes plus masks of positions allowed to differ."""

    data: torch.Tensor  # uint8 [M, slot]
    ambiguous: torch.Tensor  # bool [M, slot]
    key_cell: torch.Tensor | None  # half widths of each key code's cell [M, D]
    rotated: torch.Tensor | None  # float64 rotated unit keys [M, D]
    norms: torch.Tensor | None  # float64 key norms [M]


def spec_quantize(k: torch.Tensor, v: torch.Tensor, layout) -> SpecSlots:
    """Float64 quantization of ``[M, D]`` K/V into slots (see module doc)."""
    m, d = k.shape
    k = k.double()
    v = v.double()
    data = torch.zeros(m, layout.slot_bytes, dtype=torch.uint8)
    amb = torch.zeros(m, layout.slot_bytes, dtype=torch.bool)
    key_cell = rotated = norms = None
    if layout.key_fp8:
        data[:, :d] = fp8_encode(k).to(torch.uint8)
    else:
        bits = layout.key_bits
        norms = k.norm(dim=-1)
        rotated = (k / (norms.unsqueeze(-1) + 1e-8)) @ hadamard64(d)
        mids = midpoints32(d, bits)
        codes = (rotated.unsqueeze(-1) >= mids).sum(-1)
        near = (rotated.unsqueeze(-1) - mids).abs().min(-1).values < AMBIGUOUS
        cents = centroids64(d, bits).float().double()
        edges = torch.cat([torch.tensor([-1.0]), mids, torch.tensor([1.0])])
        key_cell = torch.maximum(
            cents[codes] - edges[codes], edges[codes + 1] - cents[codes]
        )
        nbytes = layout.key_code_bytes
        for r in range(m):
            data[r, :nbytes] = torch.tensor(pack_bits(codes[r].tolist(), bits))
            for j in near[r].nonzero().flatten().tolist():
                amb[r, j * bits // 8 : (j * bits + bits - 1) // 8 + 1] = True
            data[r, nbytes : nbytes + 2] = torch.tensor(fp16_bytes(norms[r].item()))
            amb[r, nbytes : nbytes + 2] = fp16_ambiguous(norms[r].item())
    vb = layout.value_bits
    levels = (1 << vb) - 1
    lo = v.min(-1).values
    scale = ((v.max(-1).values - lo) / levels).clamp(min=1e-8)
    t = (v - lo.unsqueeze(-1)) / scale.unsqueeze(-1) + 0.5
    codes = t.floor().clamp(0, levels).to(torch.int64)
    near = (t - t.round()).abs() < AMBIGUOUS
    start, so = layout.value_offset, layout.scale_offset
    for r in range(m):
        data[r, start:so] = torch.tensor(pack_bits(codes[r].tolist(), vb))
        for j in near[r].nonzero().flatten().tolist():
            lo_b, hi_b = (j * vb) // 8, (j * vb + vb - 1) // 8
            amb[r, start + lo_b : start + hi_b + 1] = True
        data[r, so : so + 2] = torch.tensor(fp16_bytes(scale[r].item()))
        data[r, so + 2 : so + 4] = torch.tensor(fp16_bytes(lo[r].item()))
        amb[r, so : so + 2] = fp16_ambiguous(scale[r].item())
    return SpecSlots(data, amb, key_cell, rotated, norms)


def exact_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, start: int
) -> torch.Tensor:
    """Float64 causal attention; q ``[Q, Hq, D]`` sits at positions ``start..``."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        n = start + i + 1
        for h in range(q.shape[1]):
            kh = k[:n, h // group]
            p = torch.softmax(kh @ q[i, h] * scale, dim=0)
            out[i, h] = p @ v[:n, h // group]
    return out
