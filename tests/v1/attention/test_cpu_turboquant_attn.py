"""CPU_TURBOQUANT without an engine: selection, validation, pages, cache views.

Selection and validation go through the patched selector exactly as an
attention layer does; the forward test drives the backend's builder and impl
with vLLM's common metadata on the per-layer views vLLM itself builds
(``create_kv_cache_views``) for both page layouts, single pool and pooled
mode's interleaved layers, and checks them against the TurboQuant ops on a
plain dense cache.
"""

from __future__ import annotations

import pytest
import torch

from vllm_hybrid import plugin
from vllm_hybrid.ops.tq_dtypes import TQ_CACHE_DTYPES
from vllm_hybrid.v1.attention.backends.cpu_turboquant_attn import (
    BACKEND_NAME,
    CPUTurboQuantAttentionBackend,
    ops_view,
)


@pytest.fixture(autouse=True)
def _overlay_on():
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    plugin.register()
    yield


def _selector_config(kv_cache_dtype: str, head_size: int = 256, **kw):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(
        head_size=head_size,
        dtype=torch.bfloat16,
        kv_cache_dtype=kv_cache_dtype,
        block_size=None,
        **kw,
    )


def _select(backend, kv_cache_dtype: str, **kw):
    from vllm.v1.attention import selector

    return selector._cached_get_attn_backend(
        backend, _selector_config(kv_cache_dtype, **kw), None
    )


@pytest.mark.parametrize("dtype", TQ_CACHE_DTYPES)
def test_turboquant_dtypes_select_cpu_turboquant(dtype):
    assert _select(None, dtype) is CPUTurboQuantAttentionBackend


def test_other_dtypes_keep_cpu_attn():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    for dtype in ("auto", "fp8", "bfloat16"):
        assert _select(None, dtype) is CPUAttentionBackend


def test_cpu_turboquant_is_a_registered_backend():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    member = AttentionBackendEnum[BACKEND_NAME]
    assert member.get_class() is CPUTurboQuantAttentionBackend


def test_explicit_cpu_attn_with_turboquant_is_refused_with_one_clear_error():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_hybrid.v1.attention.selector import UnsupportedKVCacheDtypeError

    with pytest.raises(UnsupportedKVCacheDtypeError) as info:
        _select(AttentionBackendEnum.CPU_ATTN, "turboquant_k8v4")
    message = str(info.value)
    assert message.startswith("CPU_ATTN cannot store kv_cache_dtype='turboquant_k8v4'")
    assert "it supports auto, fp8, fp8_e4m3, fp8_e5m2." in message
    assert f"selects {BACKEND_NAME} for turboquant_*" in message


@pytest.mark.parametrize(
    ("dtype", "kw"),
    [
        ("ultraquant_4bit", {}),  # no CPU backend stores it
        ("int8_per_token_head", {}),
        ("turboquant_4bit_nc", {"has_sliding_window": True}),  # falls to CPU_ATTN
        ("turboquant_k8v4", {"head_size": 96}),  # no Hadamard of size 96
    ],
)
def test_unsupported_combinations_raise_instead_of_corrupting(dtype, kw):
    from vllm_hybrid.v1.attention.selector import UnsupportedKVCacheDtypeError

    with pytest.raises(UnsupportedKVCacheDtypeError, match=f"'{dtype}'"):
        _select(None, dtype, **kw)


def test_overlay_off_keeps_upstream_selection():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    plugin.deactivate()
    try:
        # Upstream hands turboquant to CPU_ATTN silently (the bug).
        assert _select(None, "turboquant_k8v4") is CPUAttentionBackend
    finally:
        plugin.register()


@pytest.mark.parametrize(
    ("dtype", "head_size", "slot"),
    [
        ("turboquant_k8v4", 256, 388),
        ("turboquant_k8v4", 128, 196),
        ("turboquant_4bit_nc", 256, 262),
        ("turboquant_3bit_nc", 128, 102),
    ],
)
def test_customize_spec_pages_are_packed_slots(dtype, head_size, slot):
    from vllm.model_executor.layers.quantization.turboquant.config import (
        TurboQuantConfig,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    spec = FullAttentionSpec(
        block_size=16,
        num_kv_heads=2,
        head_size=head_size,
        dtype=torch.uint8,
        kv_quant_mode=get_kv_quant_mode(dtype),
    )
    packed = CPUTurboQuantAttentionBackend.customize_spec(spec)
    expected = TurboQuantConfig.from_cache_dtype(dtype, head_size).slot_size_aligned
    assert slot == expected
    assert packed.page_size_bytes == 16 * 2 * slot
    # Plain K/V of uint8 would be 2 * head_size bytes per token and head.
    assert spec.page_size_bytes == 16 * 2 * 2 * head_size
    if (dtype, head_size) == ("turboquant_k8v4", 256):
        assert packed.page_size_bytes == 12_416


def _tq_spec(dtype: str, head_size: int, block_size: int, kv_heads: int):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=kv_heads,
        head_size=head_size,
        dtype=torch.uint8,
        kv_quant_mode=get_kv_quant_mode(dtype),
    )
    return CPUTurboQuantAttentionBackend.customize_spec(spec)


def _cache_views(spec, num_blocks, layout_name, pooled, layers=2):
    """vLLM's logical ``[B, H, N, C]`` views of ``layers`` layers for a
    layout: layer after layer (single pool) or one page of every layer per
    block (pooled mode's token pool). Returns the raw bytes and the views."""
    from vllm.v1.kv_cache_interface import (
        KVCacheLayout,
        KVCacheTensor,
        create_kv_cache_views,
    )

    page = spec.page_size_bytes
    raw = torch.zeros(num_blocks * layers * page, dtype=torch.int8)
    layer_stride, block_stride = (
        (page, layers * page) if pooled else (num_blocks * page, page)
    )
    tensor = KVCacheTensor(
        size=raw.numel(),
        layers=[f"layer.{i}" for i in range(layers)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    layout = KVCacheLayout[layout_name]
    return raw.view(torch.uint8), create_kv_cache_views(
        raw, spec, num_blocks, layout, tensor
    )


def test_turboquant_alone_keeps_token_major_and_joins_cpu_attn_head_major():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_interface import KVCacheLayout

    tq = CPUTurboQuantAttentionBackend
    assert get_supported_kv_cache_layouts([tq])[0] is KVCacheLayout.LBNHC
    assert get_supported_kv_cache_layouts([tq, tq])[0] is KVCacheLayout.LBNHC
    mixed = get_supported_kv_cache_layouts([CPUAttentionBackend, tq])
    assert mixed == [KVCacheLayout.LBHNC]
    assert get_supported_kv_cache_layouts([tq, CPUAttentionBackend]) == mixed


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("layout_name", ["LBNHC", "LBHNC"])
def test_ops_view_addresses_the_bytes_of_the_layout(layout_name, pooled):
    """Slot (block b, token n, head h) of layer 1 through ``ops_view`` is at
    the byte offset the layout defines, whatever the block stride."""
    bs, heads, nb, layers = 4, 2, 5, 3
    spec = _tq_spec("turboquant_k8v4", 64, bs, heads)
    slot = spec.state_content_size_bytes
    page = bs * heads * slot
    raw, views = _cache_views(spec, nb, layout_name, pooled, layers)
    view = ops_view(views[1])
    assert view.shape == (nb, bs, heads, slot)
    written = [(0, 0, 0, 7), (1, 3, 1, 8), (4, 2, 1, 9)]
    for b, n, h, value in written:
        view[b, n, h] = value
    for b, n, h, value in written:
        block = b * layers * page + page if pooled else nb * page + b * page
        inner = n * heads + h if layout_name == "LBNHC" else h * bs + n
        start = block + inner * slot
        assert bool((raw[start : start + slot] == value).all())
    assert int(raw.long().sum()) == (7 + 8 + 9) * slot


def _common_metadata(seq_lens, query_lens, block_table, block_size):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q = torch.tensor(
        [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32
    )
    slots = []
    for b, (s, n) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for pos in range(s - n, s):
            slots.append(
                int(block_table[b, pos // block_size]) * block_size + pos % block_size
            )
    return CommonAttentionMetadata(
        query_start_loc=q,
        query_start_loc_cpu=q,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(seq_lens),
        num_actual_tokens=int(q[-1]),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("layout_name", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("dtype", ["turboquant_k8v4", "turboquant_3bit_nc"])
def test_forward_on_vllm_views_equals_ops_on_dense_cache(dtype, layout_name, pooled):
    """Prefill, then a mixed step (decode + chunked prefill + prefix hit), on
    vLLM's view of layer 1 of 2 for each layout, against the ops on a
    plain token-major cache: same slot bytes, bit-identical outputs."""
    from vllm_hybrid.ops.turboquant import TQLayout, paged_attention, store

    torch.manual_seed(0)
    heads, kv_heads, d, bs, nb = 4, 2, 64, 16, 12
    layout = TQLayout.from_cache_dtype(dtype, d)
    impl = CPUTurboQuantAttentionBackend.get_impl_cls()(
        heads, d, d**-0.5, kv_heads, kv_cache_dtype=dtype
    )
    builder = CPUTurboQuantAttentionBackend.get_builder_cls().__new__(
        CPUTurboQuantAttentionBackend.get_builder_cls()
    )
    spec = _tq_spec(dtype, d, bs, kv_heads)
    raw, views = _cache_views(spec, nb, layout_name, pooled)
    view = views[1]
    reference = torch.zeros(nb, bs, kv_heads, layout.slot_bytes, dtype=torch.uint8)
    table = torch.tensor([[3, 7, 1, 0], [10, 2, 5, 0]], dtype=torch.int32)
    used = table[:, :4].flatten().long()
    steps = [([20, 33], [20, 33]), ([21, 50], [1, 17])]
    for seq_lens, query_lens in steps:
        cam = _common_metadata(seq_lens, query_lens, table, bs)
        n = cam.num_actual_tokens
        q = torch.randn(n, heads, d, dtype=torch.bfloat16)
        k = torch.randn(n, kv_heads, d, dtype=torch.bfloat16)
        v = torch.randn(n, kv_heads, d, dtype=torch.bfloat16)
        meta = builder.build(0, cam)
        impl.do_kv_cache_update(None, k, v, view, cam.slot_mapping)
        out = torch.empty(n, heads, d, dtype=torch.bfloat16)
        impl.forward(None, q, k, v, view, meta, output=out)
        store(k, v, reference, cam.slot_mapping, layout)
        expected = paged_attention(
            q, reference, table, cam.seq_lens, cam.query_start_loc, d**-0.5, layout
        )
        assert torch.equal(view.transpose(1, 2)[used], reference[used])
        assert float(expected.float().abs().max()) > 0.1
        torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=0)
    # Layer 0 shares the buffer and was never written.
    assert not bool(views[0].any())
    assert int(raw.ne(0).sum()) == int(reference.ne(0).sum())
