"""The overlay's host versions of align mode's speculative-decoding copy
kernels against upstream's Triton kernels, on the same pooled arena bytes.

vLLM's CPU platform has no version of ``precopy_mamba_align_fused_kernel``
and ``postprocess_mamba_fused_kernel``; the overlay registers
``vllm_hybrid.v1.worker.cpu_mamba_align`` for them through vLLM's kernel
dispatcher. Here both run from identical arena bytes, through the same
upstream launch code (``MambaSpecDecodeGPUContext``): every byte of the arena
and the accepted-token counts must come out equal, for block-edge crossings
with and without an accepted-token bias, onto the block a request already
owns, and for every decision branch of the post-process.
"""

from __future__ import annotations

import pytest
import torch
from align_copy_ops import Crossing, Step, fused_postprocess, fused_precopy
from arena_views import MiB, mamba2_spec
from state_check import Case, case_arena, pick_ids
from vllm.v1.worker import mamba_utils

from vllm_hybrid.v1.worker import cpu_mamba_align

HOST = {
    "precopy_mamba_align_fused_kernel": cpu_mamba_align.precopy_mamba_align_fused,
    "postprocess_mamba_fused_kernel": cpu_mamba_align.postprocess_mamba_fused,
}
BLOCK = 16
CASES = [Case(True, "min", odd_budget=True), Case(False, "initial")]

#: The host versions move bytes between host addresses; on a GPU runner the
#: arena is device memory and the Triton kernels themselves run.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="host versions work on host memory only"
)


def precopy_moves(ids: list[int]) -> list[Crossing]:
    a, b, c, x, d, e = ids
    return [
        Crossing((a, b), 0, 1),  # fresh block, no bias
        Crossing((c, x, d), 0, 2, bias=1),  # accepted-token bias
        Crossing((e, e), 0, 1, bias=1),  # onto the block it owns, shifted
        Crossing((a, b), 1, 1),  # same column: nothing to copy
    ]


def postprocess_steps(ids: list[int]) -> list[Step]:
    a, b, c, x, d, e = ids
    return [
        # 14 computed + 1 real + 3 drafts, 3 accepted: reaches edge 16 with
        # one token to spare (bias 1), state moves column 1 -> 0
        Step((a, b, c, x), computed=14, scheduled=4, drafts=3, accepted=3, state_col=1),
        # no edge reached: nothing
        Step((d, e, a, b), computed=3, scheduled=4, drafts=3, accepted=2, state_col=0),
        # edge 32 in the column the state is already in, bias 1
        Step((c, x, d, e), computed=30, scheduled=2, drafts=1, accepted=2, state_col=1),
        # edge 32 exactly, same column, no bias: only the count changes
        Step((b, a, e, d), computed=31, scheduled=1, drafts=0, accepted=1, state_col=1),
    ]


class Launch:
    """``kernel[grid](...)`` calls ``impl(...)``, as on a CPU without Triton."""

    def __init__(self, impl):
        self.impl = impl

    def __getitem__(self, grid):
        return self.impl


def run_both(arena, op, moves, monkeypatch):
    """``op`` from the same random arena bytes with Triton's kernel, then with
    the host version; returns both byte images and both results."""
    gen = torch.Generator().manual_seed(7)
    start = torch.randint(-128, 128, arena.raw.shape, generator=gen, dtype=torch.int8)
    arena.raw.copy_(start)
    triton_result = op(arena, arena.states, moves)
    triton_bytes = arena.raw.clone()
    arena.raw.copy_(start)
    with monkeypatch.context() as m:
        for name, impl in HOST.items():
            m.setattr(mamba_utils, name, Launch(impl))
        host_result = op(arena, arena.states, moves)
    assert not torch.equal(arena.raw, start), "the copies changed nothing"
    return triton_bytes, arena.raw.clone(), triton_result, host_result


@pytest.mark.parametrize("case", CASES, ids=str)
def test_host_precopy_equals_the_triton_kernel(case, monkeypatch):
    arena = case_arena(
        case, mamba2_spec(BLOCK), arena_bytes=8 * MiB, num_state_layers=2
    )
    moves = precopy_moves(pick_ids(arena, 6))
    triton_bytes, host_bytes, _, _ = run_both(arena, fused_precopy, moves, monkeypatch)
    assert torch.equal(triton_bytes, host_bytes)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_host_postprocess_equals_the_triton_kernel(case, monkeypatch):
    arena = case_arena(
        case, mamba2_spec(BLOCK), arena_bytes=8 * MiB, num_state_layers=2
    )
    steps = postprocess_steps(pick_ids(arena, 6))
    triton_bytes, host_bytes, triton_counts, host_counts = run_both(
        arena, fused_postprocess, steps, monkeypatch
    )
    assert torch.equal(triton_bytes, host_bytes)
    assert triton_counts.tolist() == host_counts.tolist() == [3, 2, 1, 1]
