"""Native TurboQuant kernel vs the torch reference, and the dispatch rules.

Attention agreement is measured as ``max |native - ref| / max |ref|`` over
the whole output (fp32 queries, so no output rounding hides differences).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import vllm_hybrid.ops.turboquant as tq
from vllm_hybrid.ops.turboquant import TQ_CACHE_DTYPES, TQLayout, native, reference

SKIP_NATIVE = os.environ.get("VLLM_HYBRID_SKIP_NATIVE", "") in ("1", "true", "yes")
needs_native = pytest.mark.skipif(
    SKIP_NATIVE or not native.available(), reason="native kernel not built"
)


def test_native_kernel_is_built() -> None:
    """The install must have built the kernel (CI builds from scratch)."""
    if SKIP_NATIVE:
        pytest.skip("VLLM_HYBRID_SKIP_NATIVE is set")
    assert tq.native_available(), "pip install did not build _tq_cpu (see setup.py)"


def test_version_mismatch_refuses_to_load(tmp_path) -> None:
    lib = tmp_path / "_tq_cpu.so"
    lib.write_bytes(b"not a library")
    info = tmp_path / "_tq_cpu.json"
    info.write_text(json.dumps({"torch": "1.0.0"}))
    assert native.try_load(lib, info) is False
    assert native.try_load(None, info) is False


def test_env_var_forces_torch_path(monkeypatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("native path used")

    monkeypatch.setattr(native, "available", lambda: True)
    monkeypatch.setattr(native, "store", boom)
    layout = TQLayout.from_cache_dtype("turboquant_k8v4", 64)
    cache = torch.zeros(1, 16, 1, layout.slot_bytes, dtype=torch.uint8)
    k = torch.randn(1, 1, 64)
    monkeypatch.setenv("VLLM_HYBRID_TQ_NATIVE", "0")
    tq.store(k, k, cache, torch.tensor([3]), layout)
    assert cache[0, 3].any()
    monkeypatch.setenv("VLLM_HYBRID_TQ_NATIVE", "1")
    with pytest.raises(AssertionError, match="native path used"):
        tq.store(k, k, cache, torch.tensor([3]), layout)


def _slots(num_tokens: int, block_size: int, g: torch.Generator) -> torch.Tensor:
    """Scattered slots with some padding (-1) entries."""
    nblocks = math.ceil(num_tokens / block_size) + 2
    slots = torch.randperm(nblocks * block_size, generator=g)[:num_tokens]
    slots[::7] = -1
    return slots, nblocks


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("preset", TQ_CACHE_DTYPES)
def test_store_bytes_identical(preset: str, head_dim: int, dtype) -> None:
    layout = TQLayout.from_cache_dtype(preset, head_dim)
    g = torch.Generator().manual_seed(head_dim)
    for block_size in (16, 128):
        slots, nblocks = _slots(300, block_size, g)
        k = (torch.randn(300, 2, head_dim, generator=g) * 3).to(dtype)
        v = torch.randn(300, 2, head_dim, generator=g).to(dtype)
        k[5, 0, :3] = torch.tensor([600.0, -1e-5, 0.0])
        v[9, 1] = -2.5  # constant row
        shape = (nblocks, block_size, 2, layout.slot_bytes)
        ref = torch.full(shape, 0xAB, dtype=torch.uint8)
        nat = ref.clone()
        reference.store(k, v, ref, slots, layout)
        native.store(k, v, nat, slots, layout)
        assert torch.equal(ref, nat), (ref != nat).nonzero()[:5]


def _batch(layout, block_size, q_lens, ctx_lens, heads, q_heads, seed):
    g = torch.Generator().manual_seed(seed)
    d = layout.head_dim
    per_req = [math.ceil(c / block_size) for c in ctx_lens]
    nblocks = sum(per_req) + 1
    cache = torch.zeros(
        nblocks, block_size, heads, layout.slot_bytes, dtype=torch.uint8
    )
    perm = torch.randperm(nblocks, generator=g).to(torch.int32)
    table = torch.zeros(len(ctx_lens), max(per_req) + 2, dtype=torch.int32)
    used = 0
    for b, ctx in enumerate(ctx_lens):
        table[b, : per_req[b]] = perm[used : used + per_req[b]]
        used += per_req[b]
        pos = torch.arange(ctx)
        slots = table[b, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(ctx, heads, d, generator=g) * 2
        v = torch.randn(ctx, heads, d, generator=g)
        tq.store(k, v, cache, slots, layout)
    q = torch.randn(sum(q_lens), q_heads, d, generator=g)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, cache, table, torch.tensor(ctx_lens, dtype=torch.int32), qsl


@needs_native
@pytest.mark.parametrize(
    ("block_size", "heads", "q_heads"), [(16, 2, 16), (32, 1, 1), (128, 2, 6)]
)
@pytest.mark.parametrize("preset", TQ_CACHE_DTYPES)
def test_attention_matches_reference(preset, block_size, heads, q_heads) -> None:
    layout = TQLayout.from_cache_dtype(preset, 128)
    # prefill | chunked prefill after a 90-token prefix | decode | decode after
    # a prefix hit spanning several blocks | a 40-query chunk (> one C++ chunk)
    q_lens, ctx_lens = [17, 9, 1, 1, 40], [17, 99, 1, 260, 300]
    q, cache, table, seq, qsl = _batch(
        layout, block_size, q_lens, ctx_lens, heads, q_heads, seed=block_size
    )
    ref = reference.paged_attention(q, cache, table, seq, qsl, 0.09, layout)
    out = torch.full_like(q, float("nan"))
    got = native.paged_attention(q, cache, table, seq, qsl, 0.09, layout, out=out)
    assert got is out
    rel = (got - ref).abs().max() / ref.abs().max()
    assert rel <= 1e-3, rel
    # bf16 queries come back as bf16
    got16 = native.paged_attention(q.bfloat16(), cache, table, seq, qsl, 0.09, layout)
    assert got16.dtype == torch.bfloat16
    assert (got16.float() - ref).abs().max() / ref.abs().max() <= 1e-2


@pytest.mark.parametrize("impl", ["reference", "native"])
def test_padded_pages(impl: str) -> None:
    """Pages larger than their slots (a pool's common page size) are strided
    views; both paths honour the block stride and never touch the padding."""
    if impl == "native" and (SKIP_NATIVE or not native.available()):
        pytest.skip("native kernel not built")
    mod = native if impl == "native" else reference
    layout = TQLayout.from_cache_dtype("turboquant_k8v4", 256)
    block_size, heads, nblocks = 16, 2, 6
    page = block_size * heads * layout.slot_bytes + 100  # 12,516 B
    raw = torch.full((nblocks, page), 0xEE, dtype=torch.uint8)
    shape = (nblocks, block_size, heads, layout.slot_bytes)
    view = raw.as_strided(
        shape, (page, heads * layout.slot_bytes, layout.slot_bytes, 1)
    )
    dense = torch.zeros(shape, dtype=torch.uint8)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(70, heads, 256, generator=g)
    v = torch.randn(70, heads, 256, generator=g)
    slots = torch.randperm(nblocks * block_size, generator=g)[:70]
    mod.store(k, v, view, slots, layout)
    reference.store(k, v, dense, slots, layout)
    assert (raw[:, -100:] == 0xEE).all()
    written = view[slots // block_size, slots % block_size]
    assert torch.equal(written, dense[slots // block_size, slots % block_size])
    table = torch.arange(nblocks, dtype=torch.int32).unsqueeze(0)
    view[...] = dense  # fill every slot so any context is valid
    q = torch.randn(3, 16, 256, generator=g)
    seq = torch.tensor([90], dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    got = mod.paged_attention(q, view, table, seq, qsl, 0.0625, layout)
    want = reference.paged_attention(q, dense, table, seq, qsl, 0.0625, layout)
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    assert (raw[:, -100:] == 0xEE).all()


@pytest.mark.parametrize("impl", ["reference", "native"])
def test_flat_output_buffer(impl: str) -> None:
    """vLLM hands backends a flat ``[N, Hq * D]`` output buffer."""
    if impl == "native" and (SKIP_NATIVE or not native.available()):
        pytest.skip("native kernel not built")
    mod = native if impl == "native" else reference
    layout = TQLayout.from_cache_dtype("turboquant_4bit_nc", 64)
    q, cache, table, seq, qsl = _batch(layout, 16, [5, 1], [5, 40], 2, 4, seed=9)
    want = reference.paged_attention(q, cache, table, seq, qsl, 0.1, layout)
    flat = torch.zeros(8, 4 * 64)  # 2 rows of padding after the 6 tokens
    got = mod.paged_attention(q, cache, table, seq, qsl, 0.1, layout, out=flat[:6])
    assert got.data_ptr() == flat.data_ptr()
    assert (flat[:6].view(6, 4, 64) - want).abs().max() <= 1e-3 * want.abs().max()
    assert (flat[6:] == 0).all()


@pytest.mark.parametrize("impl", ["reference", "native"])
def test_out_of_range_block_id_is_refused(impl: str) -> None:
    """A corrupt block table raises instead of reading outside the cache."""
    if impl == "native" and (SKIP_NATIVE or not native.available()):
        pytest.skip("native kernel not built")
    mod = native if impl == "native" else reference
    layout = TQLayout.from_cache_dtype("turboquant_k8v4", 64)
    q, cache, table, seq, qsl = _batch(layout, 16, [1], [40], 1, 1, seed=4)
    table[0, 2] = cache.shape[0] + 5
    with pytest.raises((RuntimeError, IndexError)):
        mod.paged_attention(q, cache, table, seq, qsl, 0.1, layout)
    with pytest.raises((RuntimeError, IndexError)):
        mod.store(q, q, cache, torch.tensor([cache.shape[0] * 16]), layout)
