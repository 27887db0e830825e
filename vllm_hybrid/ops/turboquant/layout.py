"""Byte layout and constant tables of a TurboQuant KV-cache slot.

One slot holds one token of one KV head: ``[key | value | pad]``.

* key, FP8 presets: ``head_dim`` bytes of float8_e4m3fn.
* key, MSE presets: ``ceil(head_dim * bits / 8)`` bytes of Lloyd-Max codes
  of the Hadamard-rotated unit key, then the key's L2 norm as fp16.
* value: ``ceil(head_dim * bits / 8)`` bytes of uniform codes, then the
  fp16 scale and the fp16 zero (the row minimum).
* pad: one byte when the sum is odd, so the slot size equals upstream's
  ``TurboQuantConfig.slot_size_aligned`` and the pages vLLM sizes for the
  preset hold exactly our slots.

Codes of ``b`` bits form a little-endian bit stream: code ``j`` starts at
bit ``j * b``. For 4 bits that is "low nibble first"; for 3 bits it is
upstream's "8 codes in 3 bytes" grouping.

The sizes come from upstream's config class so the two can never drift;
the rotation and centroid tables are derived here (centroids through
upstream's Lloyd-Max solver, so codes match upstream's bit for bit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

from vllm_hybrid.ops.tq_dtypes import TQ_CACHE_DTYPES

# Largest finite float8_e4m3fn value. Upstream's GPU cast saturates; torch's
# cast turns overflow into NaN, so keys are clamped to this range first.
FP8_E4M3_MAX = 448.0
# Lower bound of the value quantization step (upstream's guard against
# constant rows).
VALUE_MIN_SCALE = 1e-8
# Added to the key norm before normalizing, as upstream's store does.
KEY_NORM_EPS = 1e-8
# Added to the squared centroid norm before norm correction.
NC_EPS = 1e-16


@dataclass(frozen=True)
class TQLayout:
    """Where each field of a slot lives for one preset at one head size."""

    cache_dtype: str
    head_dim: int
    key_fp8: bool
    key_bits: int
    value_bits: int
    norm_correction: bool
    key_bytes: int
    value_bytes: int
    slot_bytes: int

    @classmethod
    def from_cache_dtype(cls, cache_dtype: str, head_dim: int) -> TQLayout:
        """Build the layout from upstream's ``TurboQuantConfig`` preset."""
        return _layout(cache_dtype, head_dim)

    @property
    def key_code_bytes(self) -> int:
        """Bytes of key codes (MSE) or fp8 key bytes, before the norm."""
        if self.key_fp8:
            return self.head_dim
        return math.ceil(self.head_dim * self.key_bits / 8)

    @property
    def value_code_bytes(self) -> int:
        """Bytes of value codes, before the fp16 scale and zero."""
        return math.ceil(self.head_dim * self.value_bits / 8)

    @property
    def value_offset(self) -> int:
        return self.key_bytes

    @property
    def scale_offset(self) -> int:
        """Byte offset of the fp16 value scale (the zero follows it)."""
        return self.key_bytes + self.value_code_bytes

    @property
    def norm_offset(self) -> int:
        """Byte offset of the fp16 key norm (MSE presets only)."""
        return self.key_code_bytes


@cache
def _layout(cache_dtype: str, head_dim: int) -> TQLayout:
    from vllm.model_executor.layers.quantization.turboquant.config import (
        TurboQuantConfig,
    )

    if cache_dtype not in TQ_CACHE_DTYPES:
        raise ValueError(
            f"{cache_dtype!r} is not a TurboQuant cache dtype; use one of "
            f"{', '.join(TQ_CACHE_DTYPES)}"
        )
    if head_dim <= 0 or head_dim & (head_dim - 1):
        # The Sylvester Hadamard rotation only exists for powers of two.
        raise ValueError(f"TurboQuant needs a power-of-two head_dim, got {head_dim}")
    cfg = TurboQuantConfig.from_cache_dtype(cache_dtype, head_dim)
    if 3 in (cfg.key_quant_bits, cfg.value_quant_bits) and head_dim % 8:
        raise ValueError("3-bit TurboQuant codes need head_dim % 8 == 0")
    return TQLayout(
        cache_dtype=cache_dtype,
        head_dim=head_dim,
        key_fp8=cfg.key_fp8,
        key_bits=cfg.key_quant_bits,
        value_bits=cfg.value_quant_bits,
        norm_correction=cfg.norm_correction,
        key_bytes=cfg.key_packed_size,
        value_bytes=cfg.value_packed_size,
        slot_bytes=cfg.slot_size_aligned,
    )


@cache
def hadamard(head_dim: int) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix, fp32 ``[D, D]``.

    Upstream uses it without random sign flips; it is symmetric and its own
    inverse, so the same matrix rotates keys, queries and back.
    """
    # Built in fp32 and divided by the Python float like upstream, so the
    # entries (and thus the key codes) are the same bits as upstream's.
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(head_dim)).contiguous()


@cache
def centroids(layout_key: tuple[int, int]) -> torch.Tensor:
    """Sorted Lloyd-Max centroids (fp32) for ``(head_dim, bits)``."""
    from vllm.model_executor.layers.quantization.turboquant.centroids import (
        get_centroids,
    )

    head_dim, bits = layout_key
    c = get_centroids(head_dim, bits).to(torch.float32)
    return c.sort().values.contiguous()


@cache
def midpoints(layout_key: tuple[int, int]) -> torch.Tensor:
    """Decision boundaries between neighbouring centroids (fp32)."""
    c = centroids(layout_key)
    return ((c[:-1] + c[1:]) / 2).contiguous()


def key_tables(layout: TQLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``(centroids, midpoints)`` for an MSE-key layout."""
    key = (layout.head_dim, layout.key_bits)
    return centroids(key), midpoints(key)
