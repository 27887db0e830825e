"""TurboQuant KV-cache numerics for CPU: store, dequantize, paged attention.

``store`` and ``paged_attention`` run the native C++ kernel when it was built
at install time and matches the running torch, else the torch reference in
:mod:`vllm_hybrid.ops.turboquant.reference` (which tests use as the oracle).
``VLLM_HYBRID_TQ_NATIVE=0`` forces the reference.
"""

from __future__ import annotations

import torch

from vllm_hybrid import envs
from vllm_hybrid.ops.turboquant import native, reference
from vllm_hybrid.ops.turboquant.layout import TQ_CACHE_DTYPES, TQLayout
from vllm_hybrid.ops.turboquant.reference import dequantize, quantize

__all__ = [
    "TQ_CACHE_DTYPES",
    "TQLayout",
    "dequantize",
    "native_available",
    "paged_attention",
    "quantize",
    "store",
]


def native_available() -> bool:
    """Whether the native kernel is built, loadable and matches this torch."""
    return native.available()


def _use_native() -> bool:
    return envs.tq_native_enabled() and native.available()


def store(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: TQLayout,
) -> None:
    """Quantize ``[N, H, D]`` K/V into ``kv_cache`` at ``slot_mapping`` in place.

    ``kv_cache`` is uint8 ``[num_blocks, block_size, H, slot_bytes]``, each
    page token-major or head-major (a transposed view; strides are read from
    the tensor) and blocks possibly more than a page apart; slot ``s`` is
    block ``s // block_size``, offset ``s % block_size``; negative slots
    (padding tokens) are skipped.
    """
    impl = native if _use_native() else reference
    impl.store(key, value, kv_cache, slot_mapping, layout)


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
    """Causal attention of each request's queries over its whole cached context.

    Request ``b``'s queries ``query[query_start_loc[b]:query_start_loc[b+1]]``
    are the last positions of its ``seq_lens[b]`` cached tokens (already
    stored). Covers prefill, chunked prefill, prefix hits and decode in one
    batch; GQA when ``query.shape[1]`` is a multiple of the cache's heads.
    """
    impl = native if _use_native() else reference
    return impl.paged_attention(
        query, kv_cache, block_table, seq_lens, query_start_loc, scale, layout, out
    )
