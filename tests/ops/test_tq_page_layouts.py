"""TurboQuant store + attention on head-major pages, against token-major ones.

vLLM resolves one KV cache layout per engine: token-major ``LBNHC`` when
TurboQuant layers are alone, head-major ``LBHNC`` when CPU_ATTN layers share
the engine. The same K/V and queries must give the same slot contents and
the same attention output in both, also when a layer's blocks are several
pages apart (pooled mode); a cache whose strides lie about its layout must
give other numbers or be refused.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from vllm_hybrid.ops.turboquant import TQ_CACHE_DTYPES, TQLayout, native, reference

SKIP_NATIVE = os.environ.get("VLLM_HYBRID_SKIP_NATIVE", "") in ("1", "true", "yes")
CANARY = 0xEE
BLOCK_SIZE, KV_HEADS, Q_HEADS, HEAD_DIM = 16, 2, 6, 64
# prefill | chunked prefill after a prefix | decode after a multi-block prefix
Q_LENS, CTX_LENS = [17, 9, 1], [17, 40, 70]


def _impl(name: str):
    if name == "native" and (SKIP_NATIVE or not native.available()):
        pytest.skip("native kernel not built")
    return native if name == "native" else reference


def _cache(order: str, num_blocks: int, slot: int, layers: int = 1, layer: int = 0):
    """``(raw, view)``: ``view`` is the ``[blocks, tokens, heads, slot]`` index
    order the ops take over pages of ``order``; each block holds ``layers``
    pages (pooled mode), this layer's is number ``layer``; every other byte
    of ``raw`` is a canary."""
    page = BLOCK_SIZE * KV_HEADS * slot
    raw = torch.full((num_blocks * layers * page,), CANARY, dtype=torch.uint8)
    if order == "token_major":
        inner = (KV_HEADS * slot, slot, 1)
    else:
        inner = (slot, BLOCK_SIZE * slot, 1)
    view = raw.as_strided(
        (num_blocks, BLOCK_SIZE, KV_HEADS, slot), (layers * page, *inner), layer * page
    )
    return raw, view


def _batch(layout: TQLayout, seed: int):
    """Block table, per-request slots, K/V and queries of a mixed batch."""
    g = torch.Generator().manual_seed(seed)
    per_req = [math.ceil(c / BLOCK_SIZE) for c in CTX_LENS]
    num_blocks = sum(per_req) + 2
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(len(CTX_LENS), max(per_req), dtype=torch.int32)
    slots, used = [], 0
    for b, ctx in enumerate(CTX_LENS):
        table[b, : per_req[b]] = perm[used : used + per_req[b]]
        used += per_req[b]
        pos = torch.arange(ctx)
        slots.append(table[b, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    slots = torch.cat([*slots, torch.tensor([-1])])  # a padding token
    k = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=g) * 2
    v = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=g)
    q = torch.randn(sum(Q_LENS), Q_HEADS, HEAD_DIM, generator=g)
    qsl = torch.tensor([0, *torch.tensor(Q_LENS).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(CTX_LENS, dtype=torch.int32)
    return num_blocks, table, slots, k, v, q, seq, qsl


def _run(mod, layout, order, layers, layer, seed=0):
    """Store the batch into a cache of ``order`` and attend over it."""
    num_blocks, table, slots, k, v, q, seq, qsl = _batch(layout, seed)
    raw, view = _cache(order, num_blocks, layout.slot_bytes, layers, layer)
    mod.store(k, v, view, slots, layout)
    out = mod.paged_attention(q, view, table, seq, qsl, 0.125, layout)
    return raw, view, out


@pytest.mark.parametrize("impl", ["reference", "native"])
@pytest.mark.parametrize("preset", TQ_CACHE_DTYPES)
@pytest.mark.parametrize(("layers", "layer"), [(1, 0), (3, 1)])
def test_head_major_equals_token_major(impl, preset, layers, layer) -> None:
    """Same slots, transposed bytes, byte-identical attention output."""
    mod = _impl(impl)
    layout = TQLayout.from_cache_dtype(preset, HEAD_DIM)
    raw_t, view_t, out_t = _run(mod, layout, "token_major", layers, layer)
    raw_h, view_h, out_h = _run(mod, layout, "head_major", layers, layer)
    # Every slot holds the same bytes, written where its layout puts them.
    assert torch.equal(view_t, view_h)
    assert int((view_h != CANARY).any(-1).sum()) == sum(CTX_LENS) * KV_HEADS
    page = BLOCK_SIZE * KV_HEADS * layout.slot_bytes
    pages_t = raw_t.view(-1, layers, page)[:, layer]
    pages_h = raw_h.view(-1, layers, page)[:, layer]
    as_head_major = pages_t.view(-1, BLOCK_SIZE, KV_HEADS, layout.slot_bytes)
    assert torch.equal(pages_h.flatten(), as_head_major.transpose(1, 2).flatten())
    assert not torch.equal(pages_t, pages_h)  # the layouts really differ
    # Other layers' pages in the same blocks are never written.
    for raw in (raw_t, raw_h):
        others = [i for i in range(layers) if i != layer]
        assert bool((raw.view(-1, layers, page)[:, others] == CANARY).all())
    assert torch.equal(out_t, out_h)
    assert float(out_t.abs().max()) > 0.1  # not trivially equal zeros


@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_3bit_nc"])
def test_native_head_major_matches_reference(preset) -> None:
    """The native kernel on head-major pooled pages within the tolerance the
    token-major tests use (``test_tq_native.py``)."""
    _impl("native")
    layout = TQLayout.from_cache_dtype(preset, HEAD_DIM)
    _, view_n, out_n = _run(native, layout, "head_major", 3, 2)
    _, view_r, out_r = _run(reference, layout, "head_major", 3, 2)
    assert torch.equal(view_n, view_r)
    rel = (out_n - out_r).abs().max() / out_r.abs().max()
    assert rel <= 1e-3, rel


@pytest.mark.parametrize("impl", ["reference", "native"])
def test_head_major_bytes_read_as_token_major_give_other_outputs(impl) -> None:
    """Mutation check: claiming token-major strides on head-major bytes (the
    bug a kernel ignoring the strides would have) changes the numbers."""
    mod = _impl(impl)
    layout = TQLayout.from_cache_dtype("turboquant_k8v4", HEAD_DIM)
    num_blocks, table, _, _, _, q, seq, qsl = _batch(layout, 0)
    raw, _, right = _run(mod, layout, "head_major", 1, 0)
    page = BLOCK_SIZE * KV_HEADS * layout.slot_bytes
    lying = raw.as_strided(
        (num_blocks, BLOCK_SIZE, KV_HEADS, layout.slot_bytes),
        (page, KV_HEADS * layout.slot_bytes, layout.slot_bytes, 1),
    )
    wrong = mod.paged_attention(q, lying, table, seq, qsl, 0.125, layout)
    assert (wrong - right).abs().max() > 0.1 * right.abs().max()


def _bad_views(slot: int) -> dict[str, torch.Tensor]:
    raw = torch.zeros(4 * BLOCK_SIZE * KV_HEADS * slot, dtype=torch.uint8)
    shape = (4, BLOCK_SIZE, KV_HEADS, slot)
    page = BLOCK_SIZE * KV_HEADS * slot
    return {
        # tokens and heads on the same bytes
        "overlapping_slots": raw.as_strided(shape, (page, slot, slot, 1)),
        # head-major heads half a page apart: holes and overlap
        "holes": raw.as_strided(shape, (page, slot, 2 * slot, 1)),
        # blocks closer than a page
        "overlapping_blocks": raw.as_strided(
            shape, (page // 2, slot, BLOCK_SIZE * slot, 1)
        ),
    }


@pytest.mark.parametrize("case", ["overlapping_slots", "holes", "overlapping_blocks"])
@pytest.mark.parametrize("impl", ["reference", "native"])
def test_strides_of_no_dense_page_are_refused(impl, case) -> None:
    mod = _impl(impl)
    layout = TQLayout.from_cache_dtype("turboquant_k8v4", HEAD_DIM)
    view = _bad_views(layout.slot_bytes)[case]
    k = torch.randn(3, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="strides"):
        mod.store(k, k, view, torch.tensor([0, 17, 40]), layout)


@pytest.mark.parametrize("case", ["overlapping_slots", "holes", "overlapping_blocks"])
def test_kernel_refuses_strides_of_no_dense_page(case) -> None:
    """The C++ check itself (the Python wrappers check first)."""
    _impl("native")
    layout = TQLayout.from_cache_dtype("turboquant_k8v4", HEAD_DIM)
    view = _bad_views(layout.slot_bytes)[case]
    ops = torch.ops.vllm_hybrid_tq
    k = torch.randn(KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="kv_cache (pages|blocks)"):
        ops.store(
            k,
            torch.empty(0),
            k,
            view,
            torch.tensor([1]),
            torch.empty(0),
            8,
            4,
            True,
            layout.key_bytes,
        )
    q = torch.randn(1, KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="kv_cache (pages|blocks)"):
        ops.paged_attention(
            q,
            view,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            0.1,
            torch.empty(0),
            8,
            4,
            True,
            False,
            layout.key_bytes,
        )
