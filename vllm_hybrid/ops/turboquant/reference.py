"""Readable torch implementation of TurboQuant store, dequantize and attention.

This is the oracle the native kernel is tested against and the fallback when
the kernel is not built. Every step follows upstream's Triton store/decode
kernels (see docs/turboquant.md for the spec notes):

* keys, FP8 presets: fp32 key clamped to +-448, cast to float8_e4m3fn.
* keys, MSE presets: ``n = ||k||``, ``y = (k / (n + 1e-8)) @ H`` with the
  orthonormal Hadamard ``H``; code = number of centroid midpoints ``<= y``;
  ``n`` stored as fp16. Decoding gives ``n * c[code]`` in the rotated space,
  with ``c`` renormalised to unit length first for the ``_nc`` presets.
* values: per row ``lo = min``, ``scale = max((max - lo) / (2^b - 1), 1e-8)``,
  code = ``clamp(floor((v - lo) / scale + 0.5), 0, 2^b - 1)``; scale and lo
  stored as fp16, decoded as ``code * scale + lo``.

Attention scores MSE keys in the rotated space (``q @ H`` against the stored
centroids) instead of rotating every cached key back: ``H`` is orthonormal,
so the dot products are the same and the work per cached token is ``O(D)``.
"""

from __future__ import annotations

import torch

from vllm_hybrid.ops.turboquant.layout import (
    FP8_E4M3_MAX,
    KEY_NORM_EPS,
    NC_EPS,
    VALUE_MIN_SCALE,
    TQLayout,
    hadamard,
    key_tables,
)

# ---------------------------------------------------------------- bit packing


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[M, D]`` into a little-endian bit stream of bytes."""
    m, d = codes.shape
    codes = codes.to(torch.int32)
    if bits == 4:
        return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    if bits == 3:
        shifts = torch.arange(8, dtype=torch.int32) * 3
        word = (codes.view(m, d // 8, 8) << shifts).sum(-1)
        parts = [(word >> s) & 0xFF for s in (0, 8, 16)]
        return torch.stack(parts, -1).reshape(m, d // 8 * 3).to(torch.uint8)
    raise ValueError(f"unsupported code width {bits}")


def unpack_codes(data: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: bytes ``[M, nbytes]`` -> int64 ``[M, D]``."""
    if bits == 4:
        nibbles = torch.stack([data & 0xF, data >> 4], -1)
        return nibbles.reshape(data.shape[0], -1)[:, :d].to(torch.int64)
    data = data.to(torch.int32)
    padded = torch.nn.functional.pad(data, (0, 1))
    bit = torch.arange(d) * bits
    word = padded[:, bit // 8] | (padded[:, bit // 8 + 1] << 8)
    return ((word >> (bit % 8)) & ((1 << bits) - 1)).to(torch.int64)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``[M]`` -> fp16 little-endian bytes ``[M, 2]``."""
    return x.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _f16_from(data: torch.Tensor) -> torch.Tensor:
    """Two bytes ``[M, 2]`` (any strides) -> fp32 ``[M]``."""
    return data.contiguous().view(torch.float16).reshape(-1).float()


# ------------------------------------------------------------------ quantize


def rotate_keys(key: torch.Tensor, layout: TQLayout):
    """fp32 keys ``[M, D]`` -> (norms ``[M]``, rotated unit keys ``[M, D]``).

    Split out so the native store can reuse exactly these torch ops (same
    reduction order, hence the same bits) before its fused packing kernel.
    """
    norms = torch.linalg.vector_norm(key, dim=-1)
    unit = key / (norms.unsqueeze(-1) + KEY_NORM_EPS)
    return norms, unit @ hadamard(layout.head_dim)


def _quantize_keys(key: torch.Tensor, layout: TQLayout) -> torch.Tensor:
    """fp32 keys ``[M, D]`` -> key bytes ``[M, key_bytes]``."""
    if layout.key_fp8:
        clamped = key.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        return clamped.to(torch.float8_e4m3fn).view(torch.uint8)
    norms, rotated = rotate_keys(key, layout)
    _, mids = key_tables(layout)
    codes = torch.searchsorted(mids, rotated.contiguous(), right=True)
    return torch.cat([pack_codes(codes, layout.key_bits), _f16_bytes(norms)], -1)


def value_codes(value: torch.Tensor, bits: int):
    """fp32 values ``[M, D]`` -> (codes, scale fp32 ``[M]``, lo fp32 ``[M]``)."""
    levels = (1 << bits) - 1
    lo = value.amin(-1)
    scale = (value.amax(-1) - lo) / float(levels)
    scale = torch.where(scale > VALUE_MIN_SCALE, scale, VALUE_MIN_SCALE)
    q = (value - lo.unsqueeze(-1)) / scale.unsqueeze(-1) + 0.5
    return q.to(torch.int32).clamp(0, levels), scale, lo


def _quantize_values(value: torch.Tensor, layout: TQLayout) -> torch.Tensor:
    codes, scale, lo = value_codes(value, layout.value_bits)
    parts = [pack_codes(codes, layout.value_bits), _f16_bytes(scale), _f16_bytes(lo)]
    return torch.cat(parts, -1)


def quantize(key: torch.Tensor, value: torch.Tensor, layout: TQLayout) -> torch.Tensor:
    """key/value ``[N, H, D]`` -> packed slots uint8 ``[N, H, slot_bytes]``."""
    n, h, d = key.shape
    if d != layout.head_dim or value.shape != key.shape:
        raise ValueError(f"expected K/V [N, H, {layout.head_dim}], got {key.shape}")
    k = key.reshape(n * h, d).float()
    v = value.reshape(n * h, d).float()
    slots = torch.zeros(n * h, layout.slot_bytes, dtype=torch.uint8)
    slots[:, : layout.key_bytes] = _quantize_keys(k, layout)
    slots[:, layout.key_bytes : layout.key_bytes + layout.value_bytes] = (
        _quantize_values(v, layout)
    )
    return slots.view(n, h, layout.slot_bytes)


# ---------------------------------------------------------------- dequantize


def _key_centroids(data: torch.Tensor, layout: TQLayout) -> torch.Tensor:
    """Unit-length (if nc) rotated key directions ``[M, D]`` from key bytes."""
    cents, _ = key_tables(layout)
    codes = unpack_codes(
        data[:, : layout.key_code_bytes], layout.key_bits, layout.head_dim
    )
    c = cents[codes]
    if layout.norm_correction:
        c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + NC_EPS)
    return c


def dequantize_keys_rotated(slots: torch.Tensor, layout: TQLayout) -> torch.Tensor:
    """Slots ``[M, slot_bytes]`` -> fp32 keys ``[M, D]``.

    FP8 keys come back as stored; MSE keys come back in the Hadamard-rotated
    space (multiply by ``H`` to return to the model's space).
    """
    if layout.key_fp8:
        raw = slots[:, : layout.head_dim].contiguous()
        return raw.view(torch.float8_e4m3fn).float()
    off = layout.norm_offset
    norms = _f16_from(slots[:, off : off + 2])
    return _key_centroids(slots, layout) * norms.unsqueeze(-1)


def dequantize_values(slots: torch.Tensor, layout: TQLayout) -> torch.Tensor:
    """Slots ``[M, slot_bytes]`` -> fp32 values ``[M, D]``."""
    start, so = layout.value_offset, layout.scale_offset
    codes = unpack_codes(slots[:, start:so], layout.value_bits, layout.head_dim)
    scale = _f16_from(slots[:, so : so + 2])
    lo = _f16_from(slots[:, so + 2 : so + 4])
    return codes.float() * scale.unsqueeze(-1) + lo.unsqueeze(-1)


def dequantize(
    slots: torch.Tensor, layout: TQLayout, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 ``[..., slot_bytes]`` -> (k, v) ``[..., D]`` in the model's space."""
    lead = slots.shape[:-1]
    flat = slots.reshape(-1, layout.slot_bytes)
    k = dequantize_keys_rotated(flat, layout)
    if not layout.key_fp8:
        k = k @ hadamard(layout.head_dim)
    v = dequantize_values(flat, layout)
    d = layout.head_dim
    return k.reshape(*lead, d).to(dtype), v.reshape(*lead, d).to(dtype)


# --------------------------------------------------------------------- store


def store(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: TQLayout,
) -> None:
    """Quantize tokens into ``kv_cache[block, offset]``; slots < 0 are skipped.

    Only the first ``len(slot_mapping)`` rows of key/value are stored (the
    rest is batch padding).
    """
    _check_cache(kv_cache, layout)
    key, value, slot_mapping = select_tokens(key, value, slot_mapping)
    if key.shape[0] == 0:
        return
    packed = quantize(key, value, layout)
    slot_mapping = slot_mapping.long()
    block_size = kv_cache.shape[1]
    kv_cache[slot_mapping // block_size, slot_mapping % block_size] = packed


def select_tokens(key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor):
    """Drop padding rows beyond the slot mapping and tokens with slot < 0."""
    n = slot_mapping.shape[0]
    if key.shape[0] < n or value.shape[0] < n:
        raise ValueError(f"{n} slots but only {key.shape[0]} key rows")
    key, value = key[:n], value[:n]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    return key, value, slot_mapping


def _check_cache(kv_cache: torch.Tensor, layout: TQLayout) -> None:
    """uint8 ``[blocks, block_size, H, slot]``, each page dense in either order.

    vLLM picks one KV cache layout for all backends of an engine, so a page
    is token-major (``LBNHC``) or head-major (``LBHNC``) depending on the
    other backends; both are a plain permutation of the indices, so indexing
    serves either. Blocks may be further apart than a page (pages padded to
    a common size, pooled mode's layers interleaved per block), so stride(0)
    is free. Mirrors ``cache_strides`` in csrc/turboquant_common.h.
    """
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4:
        raise ValueError("kv_cache must be uint8 [num_blocks, block_size, H, slot]")
    num_blocks, block_size, heads, slot = kv_cache.shape
    if slot != layout.slot_bytes:
        raise ValueError(
            f"kv_cache slot is {slot} B, {layout.cache_dtype} at "
            f"head_dim {layout.head_dim} needs {layout.slot_bytes} B"
        )
    page = block_size * heads * slot
    token_major = (heads * slot, slot, 1)
    head_major = (slot, block_size * slot, 1)
    strides = kv_cache.stride()
    dense = any(
        _strides_match(kv_cache.shape[1:], strides[1:], want)
        for want in (token_major, head_major)
    )
    if not dense or (num_blocks > 1 and strides[0] < page):
        raise ValueError(
            f"kv_cache strides {strides} are not a dense token-major or "
            "head-major page per block"
        )


def _strides_match(sizes, strides, want) -> bool:
    """Equal strides, ignoring dimensions of size 1 (never stepped over)."""
    return all(n == 1 or s == w for n, s, w in zip(sizes, strides, want, strict=True))


# ----------------------------------------------------------------- attention


def gather_context(
    kv_cache: torch.Tensor, block_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """Slots of positions ``0..seq_len-1`` of one request: ``[S, H, slot]``."""
    block_size = kv_cache.shape[1]
    pos = torch.arange(seq_len)
    blocks = block_row[pos // block_size].long()
    return kv_cache[blocks, pos % block_size]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    context_start: int,
) -> torch.Tensor:
    """fp32 causal attention: q ``[Q, Hq, D]``, k/v ``[S, H, D]`` -> ``[Q, Hq, D]``.

    Query ``i`` sits at position ``context_start + i`` and sees keys
    ``0..context_start + i``.
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q, k) * scale
    q_pos = torch.arange(q.shape[0]).unsqueeze(1) + context_start
    visible = torch.arange(k.shape[0]).unsqueeze(0) <= q_pos
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqs,shd->qhd", probs, v)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    layout: TQLayout,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's queries over its cached context."""
    _check_cache(kv_cache, layout)
    result = torch.empty_like(query) if out is None else out
    # ``out`` may also be vLLM's flat ``[N, Hq * D]`` output buffer.
    out = result.view(query.shape)
    rotate_q = not layout.key_fp8
    rot = hadamard(layout.head_dim)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        if q1 == q0:
            continue
        if seq_len < q1 - q0:
            raise ValueError(f"request {b}: seq_len {seq_len} < {q1 - q0} queries")
        slots = gather_context(kv_cache, block_table[b], seq_len)
        flat = slots.reshape(-1, layout.slot_bytes)
        h = slots.shape[1]
        k = dequantize_keys_rotated(flat, layout).view(seq_len, h, -1)
        v = dequantize_values(flat, layout).view(seq_len, h, -1)
        q = query[q0:q1].float()
        if rotate_q:
            q = q @ rot
        ctx = _attend(q, k, v, scale, seq_len - (q1 - q0))
        out[q0:q1] = ctx.to(out.dtype)
    return result
