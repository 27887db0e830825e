"""TurboQuant KV cache on vLLM's CPU backend.

vLLM 0.32's TurboQuant backend is GPU-only (Triton kernels); on CPU the
``turboquant_*`` cache dtypes used to land on ``CPU_ATTN``, which stores plain
bf16 K/V into pages sized for the packed slot and corrupts memory. This
backend keeps upstream's packed format: one slot of
``TQLayout.slot_bytes`` (== upstream ``TurboQuantConfig.slot_size_aligned``)
per token per KV head, so pages, plans and capacity are those of upstream's
TurboQuant, and the numerics live in :mod:`vllm_hybrid.ops.turboquant`.

Each layer's cache is the uint8 view vLLM allocates from the spec
(``customize_spec`` makes the page ``block_size x num_kv_heads x
slot_bytes``). The backend prefers the token-major ``LBNHC`` layout and also
takes head-major ``LBHNC`` (what ``CPU_ATTN`` needs when some layers keep
their native dtype); the logical ``[blocks, heads, tokens, slot]`` view vLLM
binds is, transposed, the ``[blocks, tokens, heads, slot]`` indexing the
TurboQuant ops take, whose kernels follow the view's strides. Block strides
may exceed one page (pooled mode interleaves layers per block) and are kept
as they are.

Forward = ``store`` (new K/V through the slot mapping, done by vLLM's
separate KV-update op) then causal ``paged_attention`` over the cached
context, which covers prefill, chunked prefill, prefix-cache hits and decode
alike: every query attends to its request's stored tokens up to itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from vllm_hybrid.logger import init_logger
from vllm_hybrid.ops.tq_dtypes import TQ_CACHE_DTYPES

logger = init_logger(__name__)

#: Name of the backend in vLLM's ``AttentionBackendEnum``.
BACKEND_NAME = "CPU_TURBOQUANT"


def tq_layout(cache_dtype: str, head_dim: int) -> Any:
    """The numerics' slot layout for a preset (imported lazily: torch ops)."""
    from vllm_hybrid.ops.turboquant import TQLayout

    return TQLayout.from_cache_dtype(cache_dtype, head_dim)


def ops_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's logical ``[blocks, heads, tokens, slot]`` view -> the
    ``[blocks, tokens, heads, slot]`` indexing the TurboQuant ops take.

    Only the index order changes; the strides stay vLLM's. The ops read the
    token, head and block strides from the tensor, so the same bytes serve
    whichever layout vLLM resolved (token-major ``LBNHC`` alone, head-major
    ``LBHNC`` next to ``CPU_ATTN`` layers) and block strides beyond one page
    (pooled mode puts one page of every attention layer in a block) without
    copying or remapping slots. The ops reject any other page layout.
    """
    return kv_cache.transpose(1, 2)


class CPUTurboQuantAttentionBackend(AttentionBackend):
    """Packed TurboQuant KV cache, torch/C++ numerics, any block size."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False

    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.bfloat16,
        torch.float16,
        torch.float32,
    ]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = list(TQ_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[CPUTurboQuantAttentionImpl]:
        return CPUTurboQuantAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[CPUTurboQuantMetadataBuilder]:
        return CPUTurboQuantMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # The ops address tokens through block tables of any block size, so
        # manager blocks are never split into kernel blocks.
        return [MultipleOf(1)]

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        # The Hadamard rotation needs a power of two.
        return head_size > 0 and head_size & (head_size - 1) == 0

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        """Token-major first: an engine of TurboQuant layers alone resolves
        ``LBNHC`` as it always did. Head-major too, because vLLM resolves
        one layout per engine and ``CPU_ATTN`` (layers kept at native dtype
        by ``--kv-cache-dtype-skip-layers``) only takes ``LBHNC``."""
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Make the page ``block_size x num_kv_heads x slot_bytes``.

        Without this the spec would size plain K/V of uint8 (2 x head_dim
        bytes per token per head) and the plan would not match the slots.
        """
        if spec.state_content_bytes is not None or not spec.kv_quant_mode.is_turboquant:
            return spec
        # KVQuantMode member names are the preset names in upper case.
        layout = tq_layout(spec.kv_quant_mode.name.lower(), spec.head_size)
        return replace(spec, state_content_bytes=layout.slot_bytes)


@dataclass
class CPUTurboQuantMetadata:
    """What ``paged_attention`` needs for one step (tensors on CPU)."""

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens]


class CPUTurboQuantMetadataBuilder(AttentionMetadataBuilder[CPUTurboQuantMetadata]):
    """Slices vLLM's common metadata to the real requests; no reordering."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> CPUTurboQuantMetadata:
        cam = common_attn_metadata
        num_reqs = cam.num_reqs
        return CPUTurboQuantMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            max_query_len=cam.max_query_len,
            max_seq_len=cam.max_seq_len,
            query_start_loc=cam.query_start_loc[: num_reqs + 1].to(torch.int32),
            seq_lens=cam.seq_lens[:num_reqs].to(torch.int32),
            block_table=cam.block_table_tensor[:num_reqs].to(torch.int32),
            slot_mapping=cam.slot_mapping,
        )


class CPUTurboQuantAttentionImpl(AttentionImpl[CPUTurboQuantMetadata]):
    """Store through the slot mapping, attend through the block table."""

    supports_quant_query_input: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap or None,
            "sinks": kwargs.get("sinks"),
        }
        used = [name for name, value in unsupported.items() if value is not None]
        if used:
            raise NotImplementedError(
                f"{BACKEND_NAME} does not support {', '.join(used)}; start "
                "without --kv-cache-dtype turboquant_* for this model"
            )
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"{BACKEND_NAME} only runs decoder attention")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.layout = tq_layout(kv_cache_dtype, head_size)

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Quantize the step's new K/V into their slots (-1 = no slot)."""
        if kv_cache.numel() == 0:
            return
        from vllm_hybrid.ops.turboquant import store

        n = slot_mapping.shape[0]
        store(key[:n], value[:n], ops_view(kv_cache), slot_mapping, self.layout)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUTurboQuantMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert output is not None, "CPU_TURBOQUANT writes into vLLM's output buffer"
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                f"{BACKEND_NAME} does not fuse output quantization"
            )
        if attn_metadata is None:  # profiling / warm-up run
            return output
        from vllm_hybrid.ops.turboquant import paged_attention

        n = attn_metadata.num_actual_tokens
        out = output[:n]
        result = paged_attention(
            query[:n],
            ops_view(kv_cache),
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            self.scale,
            self.layout,
            out=out,
        )
        if result is not None and result.data_ptr() != out.data_ptr():
            out.copy_(result)
        return output
