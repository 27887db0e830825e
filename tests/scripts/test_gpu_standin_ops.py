"""The device run's PyTorch forms of compiled vLLM ops (scripts/gpu/standin_ops.py),
checked on CPU against references: vLLM's own compiled CPU kernel where the
CPU wheel has one (the gated activations), vLLM's PyTorch form of the layer
otherwise, and hand-worked cases and brute-force references for the MoE ops
the CPU wheel lacks. (vLLM's Triton MoE kernel does not run in Triton's
interpreter: its ``tl.cdiv`` call stops it there; on the GPU the flagship's
served tokens exercise the three together.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))

import standin_ops  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def moe_ops():
    import vllm._custom_ops  # noqa: F401 - loads the CPU wheel's _C first

    if not hasattr(torch.ops._moe_C, "moe_sum"):
        standin_ops.register()


def align(topk_ids: torch.Tensor, experts: int, block: int):
    """Buffers sized as vLLM's ``moe_align_block_size`` sizes them."""
    size = topk_ids.numel() + experts * (block - 1)
    if topk_ids.numel() < experts:
        size = min(topk_ids.numel() * block, size)
    sorted_ids = torch.empty(size, dtype=torch.int32)
    expert_ids = torch.empty(-(-size // block), dtype=torch.int32)
    total = torch.empty(1, dtype=torch.int32)
    torch.ops._moe_C.moe_align_block_size(
        topk_ids, experts, block, sorted_ids, expert_ids, total, None, None
    )
    return sorted_ids.tolist(), expert_ids.tolist(), int(total)


def test_align_groups_rows_by_expert_padded_to_the_block():
    # rows 0..5 go to experts 1, 2, 0, 1, 1, 3; filler is the row count (6)
    topk_ids = torch.tensor([[1, 2], [0, 1], [1, 3]], dtype=torch.int32)
    sorted_ids, expert_ids, total = align(topk_ids, experts=4, block=4)
    assert total == 16
    assert sorted_ids == [2, 6, 6, 6, 0, 3, 4, 6, 1, 6, 6, 6, 5, 6, 6, 6, 6, 6]
    assert expert_ids == [0, 1, 2, 3, -1]


def test_align_matches_a_brute_force_reference_on_random_routes():
    gen = torch.Generator().manual_seed(0)
    for tokens, experts, k, block in ((7, 8, 2, 16), (33, 16, 4, 4), (3, 64, 8, 16)):
        topk_ids = torch.stack(
            [torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]
        ).to(torch.int32)
        sorted_ids, expert_ids, total = align(topk_ids, experts, block)
        flat = topk_ids.flatten().tolist()
        want, blocks = [], []
        for e in range(experts):
            rows = [i for i, x in enumerate(flat) if x == e]
            if rows:
                pad = -len(rows) % block
                want += rows + [len(flat)] * pad
                blocks += [e] * ((len(rows) + pad) // block)
        assert total == len(want)
        assert sorted_ids[:total] == want
        assert set(sorted_ids[total:]) <= {len(flat)}
        assert expert_ids[: len(blocks)] == blocks
        assert set(expert_ids[len(blocks) :]) <= {-1}


def test_topk_softmax_renormalized_weights_and_row_indices():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 16, generator=gen).to(torch.bfloat16)
    weights = torch.empty(5, 4, dtype=torch.float32)
    ids = torch.empty(5, 4, dtype=torch.int32)
    rows = torch.empty(5, 4, dtype=torch.int32)
    torch.ops._moe_C.topk_softmax(weights, ids, rows, logits, True, None, None)
    probs = torch.softmax(logits.float(), -1)
    best = probs.topk(4, -1)
    assert torch.equal(ids.long(), best.indices)
    torch.testing.assert_close(weights, best.values / best.values.sum(-1, True))
    assert rows[2].tolist() == [2, 7, 12, 17]  # j * tokens + t
    torch.ops._moe_C.topk_softmax(weights, ids, rows, logits, False, None, None)
    torch.testing.assert_close(weights, best.values)


def test_moe_sum_adds_the_top_k_outputs():
    x = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    out = torch.empty(2, 4)
    torch.ops._moe_C.moe_sum(x, out, None, None)
    assert out.tolist() == [[12, 15, 18, 21], [48, 51, 54, 57]]


@pytest.mark.parametrize("name", sorted(standin_ops.ACTIVATIONS))
def test_gated_activations_match_vllms_cpu_kernels(name):
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
    want = torch.empty(6, 32)
    if hasattr(torch.ops._C, name):
        getattr(torch.ops._C, name)(want, x)
    else:  # not in the CPU wheel: vLLM's PyTorch form of the layer
        from vllm.model_executor.layers.activation import MulAndSilu

        assert name == "mul_and_silu"
        want = MulAndSilu.forward_native(None, x)
    got = torch.empty(6, 32)
    standin_ops.gated(name)(got, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
