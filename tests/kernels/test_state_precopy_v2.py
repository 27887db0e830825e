"""Model Runner V2's align-mode pre-copy on pooled state views.

Before each forward pass V2's hybrid model state (``preprocess_state`` in
``vllm/v1/worker/gpu/model_states/mamba_hybrid.py``) launches two kernels:
``preprocess_mamba_align_fused_kernel`` advances each request's running
block column and records the column it leaves (and the accepted-token
bias), then ``precopy_mamba_align_fused_kernel`` copies the state between
the two columns wherever they differ. It compares columns, not block ids, so
a request that pooled mode lets cross its edge in place (one block id in
both columns) gets its state copied onto itself: a read and a write of the
whole state, with the same bytes as the result. These tests run that pair of
launches as V2 does (batch order through ``idx_mapping`` into request slots)
on Qwen3.6-35B-A3B's GDN state pages, on the pooled views and on contiguous
twins, and require bitwise equal pages and bookkeeping, no byte changed
outside the owned pages, and the pages each request should end with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from align_copy_ops import spec_decode_context
from arena_views import DEVICE, gdn_spec
from state_check import Case, case_arena, check_state_op, page_states, pick_ids
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.worker import mamba_utils

from vllm_hybrid.v1.worker import mamba_copies

BLOCK = 16


@dataclass(frozen=True)
class Slot:
    """One request's V2 bookkeeping before the step: its block-table row,
    tokens computed, tokens scheduled now and tokens accepted last step."""

    row: tuple[int, ...]
    computed: int
    scheduled: int
    accepted: int = 1

    @property
    def state_col(self) -> int:
        """The running column V2 seeded for it: its last computed token's."""
        return (self.computed - 1) // BLOCK


def slots(ids: list[int]) -> list[Slot]:
    """In place (``a`` in both columns), to a fresh block (``b`` to ``c``),
    within its block (``d``), in place with one accepted draft (``e``: the
    conv window shifts by a token within the block)."""
    a, b, c, d, e = ids
    return [
        Slot((a, a), computed=16, scheduled=1),
        Slot((b, c), computed=16, scheduled=1),
        Slot((0, d), computed=20, scheduled=1),
        Slot((e, e), computed=15, scheduled=3, accepted=2),
    ]


def idx_mapping(n: int) -> list[int]:
    """Batch index -> request slot, as V2's ``idx_mapping`` (four slots
    taken out of order)."""
    return [2, 0, 3, 1] if n == 4 else list(range(n))


def _tensor(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def v2_preprocess(
    arena, states, requests: list[Slot], overlay: Overlay | None = None
) -> torch.Tensor:
    """``MambaHybridModelState.preprocess_state``'s two launches; returns
    the slots' columns, sources, biases and accepted counts afterwards.
    With ``overlay`` the context is set up and the pre-copy launched through
    the overlay's replacements (:mod:`vllm_hybrid.v1.worker.mamba_copies`)."""
    ctx, _table = spec_decode_context(
        arena,
        states,
        [s.row for s in requests],
        config=None if overlay is None else overlay.config,
        initialize=None
        if overlay is None
        else mamba_copies.initialize_from_forward_context,
    )
    order = idx_mapping(len(requests))
    batch = [requests[i] for i in order]
    state_idx = _tensor([s.state_col for s in requests])
    accepted = _tensor([s.accepted for s in requests])
    computed = _tensor([s.computed for s in requests])
    query_start = _tensor([0, *torch.tensor([s.scheduled for s in batch]).cumsum(0)])
    src_col = torch.full_like(state_idx, -1)
    src_off = torch.zeros_like(state_idx)
    n = len(requests)
    mamba_utils.preprocess_mamba_align_fused_kernel[(1,)](
        _tensor(order),
        state_idx,
        computed,
        query_start,
        accepted,
        src_col,
        src_off,
        n,
        BLOCK_SIZE=256,
        MAMBA_BLOCK_SIZE=BLOCK,
    )
    if overlay is None:
        ctx.run_fused_precopy(n, state_idx, src_col, src_off, _tensor(order))
    else:
        overlay.src_cols.append(src_col)
        overlay.contexts.append(ctx)
        mamba_copies.run_fused_precopy(
            ctx, n, state_idx, src_col, src_off, _tensor(order)
        )
    return torch.stack([state_idx, src_col, src_off, accepted]).cpu()


def expected_pages(arena, requests: list[Slot]) -> dict:
    """Each request's destination page after the pre-copy: the source's
    conv window shifted by the bias, the state of the accepted column."""
    expected = {}
    for layer in arena.state_layers:
        for s in requests:
            src, dst = s.state_col, (s.computed + s.scheduled - 1) // BLOCK
            if src == dst:
                continue
            bias = s.accepted - 1
            conv, _ = (x.clone() for x in page_states(arena, layer, s.row[src]))
            dst_conv, _ = (x.clone() for x in page_states(arena, layer, s.row[dst]))
            dst_conv[: conv.shape[0] - bias] = conv[bias:]
            ssm = page_states(arena, layer, s.row[src + bias])[1].clone()
            expected[(layer, s.row[dst])] = (dst_conv, ssm)
    return expected


CASES = [Case(True, "min", odd_budget=True), Case(False, "initial"), Case(False, "min")]


@dataclass
class Overlay:
    """A run through the overlay's pre-copy with ``config`` (the arena's
    pooled config, or a plain twin of it): the source-column tensors V2
    hands ``run_fused_precopy``, and those the kernel receives (tensor and
    values at launch), one per launch."""

    config: KVCacheConfig
    src_cols: list[torch.Tensor] = field(default_factory=list)
    launched: list[tuple[torch.Tensor, list[int]]] = field(default_factory=list)
    contexts: list = field(default_factory=list)


@pytest.fixture
def launches(monkeypatch):
    """Records each pre-copy launch's source-column argument in
    ``overlay.launched``, then launches the kernel as before."""

    def record(overlay: Overlay) -> None:
        kernel = mamba_utils.precopy_mamba_align_fused_kernel

        class Recording:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    overlay.launched.append((args[1], args[1].tolist()))
                    return kernel[grid](*args, **kwargs)

                return launch

        monkeypatch.setattr(
            mamba_utils, "precopy_mamba_align_fused_kernel", Recording()
        )

    return record


def plain_config(arena) -> KVCacheConfig:
    """The arena's groups and tensors in upstream's ``KVCacheConfig``: what
    the overlay sees of an engine that is not pooled."""
    config = arena.config
    return KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=config.kv_cache_tensors,
        kv_cache_groups=config.kv_cache_groups,
    )


def copied_slots(overlay: Overlay, requests: list[Slot]) -> list[list[int]]:
    """Per launch, the slots the kernel copies: a source column of its own
    (not -1) other than the slot's destination column."""
    dst = [(s.computed + s.scheduled - 1) // BLOCK for s in requests]
    return [
        [i for i, src in enumerate(values) if src >= 0 and src != dst[i]]
        for _tensor, values in overlay.launched
    ]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_v2_precopy_on_pooled_views(case):
    arena = case_arena(case, gdn_spec(BLOCK), num_state_layers=2)
    ids = pick_ids(arena, 5)
    assert len(ids) == 5, f"the case's state pool owns {len(arena.state_ids)} ids"
    requests = slots(ids)
    seeded: dict = {}

    def op(states, _ids):
        if not seeded:  # the pooled run comes first, on the seeded pages
            seeded["expected"] = expected_pages(arena, requests)
            seeded["in_place"] = {
                layer: [x.clone() for x in page_states(arena, layer, ids[0])]
                for layer in arena.state_layers
            }
        out = v2_preprocess(arena, states, requests)
        seeded.setdefault("bookkeeping", out)
        return out

    result = check_state_op(arena, op, ids)
    assert result.ok, result
    # per slot: the column now run, the column left (-1: none), the bias,
    # the accepted count (reset to 1 where a column was left)
    assert seeded["bookkeeping"].tolist() == [
        [1, 1, 1, 1],
        [0, 0, 1, 0],
        [0, 0, 0, 1],
        [1, 1, 1, 1],
    ]
    for (layer, dst), (conv, ssm) in seeded["expected"].items():
        got_conv, got_ssm = page_states(arena, layer, dst)
        assert torch.equal(got_conv, conv), (layer, dst)
        assert torch.equal(got_ssm, ssm), (layer, dst)
    # the in-place crossing's copy onto itself left its page as it was
    for layer, before in seeded["in_place"].items():
        after = page_states(arena, layer, ids[0])
        assert all(torch.equal(x, y) for x, y in zip(after, before, strict=True))
    # three crossings (two in place), one request staying in its block
    assert len(seeded["expected"]) == 3 * len(arena.state_layers)


@pytest.mark.parametrize("case", [Case(False, "max"), Case(True, "max")], ids=str)
def test_v2_precopy_of_a_lone_state_block(case):
    """The state pool at its floor owns one block: its request crosses in
    place with an accepted draft, the conv window shifted within the block
    and the recurrent state copied onto itself."""
    arena = case_arena(case, gdn_spec(BLOCK), num_state_layers=2)
    (x,) = pick_ids(arena, 5)
    requests = [Slot((x, x), computed=15, scheduled=3, accepted=2)]
    seeded: dict = {}

    def op(states, _ids):
        if not seeded:
            seeded.update(expected_pages(arena, requests))
        return v2_preprocess(arena, states, requests)

    result = check_state_op(arena, op, [x])
    assert result.ok, result
    for (layer, dst), (conv, ssm) in seeded.items():
        assert dst == x
        got_conv, got_ssm = page_states(arena, layer, x)
        assert torch.equal(got_conv, conv) and torch.equal(got_ssm, ssm)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_v2_precopy_skips_copies_onto_themselves_on_pooled_views(case, launches):
    """Through the overlay on a pooled config the in-place crossing without
    a bias (slot 0) leaves the kernel's copies; the crossing to a fresh
    block (slot 1) and the in-place one with an accepted draft (slot 3, its
    conv window shifted within the block) are copied as upstream copies
    them, bitwise the expected pages on the views and their twins."""
    arena = case_arena(case, gdn_spec(BLOCK), num_state_layers=2)
    ids = pick_ids(arena, 5)
    assert len(ids) == 5
    requests = slots(ids)
    overlay = Overlay(arena.config)
    launches(overlay)
    seeded: dict = {}

    def op(states, _ids):
        if not seeded:
            seeded["expected"] = expected_pages(arena, requests)
        out = v2_preprocess(arena, states, requests, overlay)
        seeded.setdefault("bookkeeping", out)
        return out

    result = check_state_op(arena, op, ids)
    assert result.ok, result
    # each context kept its one state group's table, a row per slot
    assert [len(ctx.pooled_state_tables) for ctx in overlay.contexts] == [1, 1]
    assert overlay.contexts[0].pooled_state_tables[0][0].tolist() == [ids[0]] * 2
    # V2's own buffers keep upstream's values: slot 0 left column 0
    assert seeded["bookkeeping"].tolist() == [
        [1, 1, 1, 1],
        [0, 0, 1, 0],
        [0, 0, 0, 1],
        [1, 1, 1, 1],
    ]
    # the kernel got another tensor, slot 0's source set to its destination
    assert len(overlay.launched) == 2  # the views, then the twins
    for (handed, values), src_col in zip(
        overlay.launched, overlay.src_cols, strict=True
    ):
        assert handed is not src_col
        assert values == [1, 0, 1, 0]
    # two copies a launch where upstream makes three (test above)
    assert copied_slots(overlay, requests) == [[1, 3], [1, 3]]
    for (layer, dst), (conv, ssm) in seeded["expected"].items():
        got_conv, got_ssm = page_states(arena, layer, dst)
        assert torch.equal(got_conv, conv), (layer, dst)
        assert torch.equal(got_ssm, ssm), (layer, dst)


def test_v2_precopy_of_a_plain_config_is_upstreams(launches):
    """On a config that is not pooled the overlay keeps no tables and hands
    the kernel V2's own source columns, the copy onto itself included."""
    case = Case(False, "initial")
    arena = case_arena(case, gdn_spec(BLOCK), num_state_layers=2)
    ids = pick_ids(arena, 5)
    requests = slots(ids)
    overlay = Overlay(plain_config(arena))
    launches(overlay)

    def op(states, _ids):
        return v2_preprocess(arena, states, requests, overlay)

    result = check_state_op(arena, op, ids)
    assert result.ok, result
    assert len(overlay.contexts) == 2
    assert not any(hasattr(ctx, "pooled_state_tables") for ctx in overlay.contexts)
    assert len(overlay.launched) == 2
    for (handed, values), src_col in zip(
        overlay.launched, overlay.src_cols, strict=True
    ):
        assert handed is src_col
        assert values == [0, 0, 1, 0]
    assert copied_slots(overlay, requests) == [[0, 1, 3], [0, 1, 3]]
