"""Token block moves on Model Runner V2's tables and a pooled arena, on the
tier's device (CUDA on a GPU runner, CPU elsewhere).

The arena is Qwen3.6-35B-A3B's attention and GDN pages as a CUDA worker
allocates them (:func:`~arena_views.build_arena`); the block tables are
upstream's V2 ``BlockTables``, filled through its own staged writes (on a
GPU: pinned host staging and its fused writer kernel). One step's moves, a
chain and a swap, are applied as a worker applies them
(``vllm_hybrid.v1.worker.token_moves.apply_token_moves``): every moved token
block's bytes end at its new id, every other arena byte stays, the token
group's table names the new ids and the state group's is untouched. On CUDA
the whole application must not wait for the device (V2 schedules
asynchronously): it runs under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from arena_views import DEVICE, MiB, attention_spec, build_arena, gdn_spec

from vllm_hybrid.v1.core.pooled.spec import PoolKind
from vllm_hybrid.v1.worker.token_moves import apply_token_moves

BLOCK = 16


@pytest.fixture
def tables(monkeypatch):
    """V2's tables for a token group (0) and a state group (1); requests in
    slots 0 and 1, written through V2's staged writes."""
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.block_table import BlockTables

    if DEVICE.type != "cuda":  # no pinned memory: the staging path without it
        monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    return BlockTables(
        block_sizes=[BLOCK, BLOCK],
        max_num_reqs=4,
        max_num_batched_tokens=64,
        max_num_blocks_per_group=[8, 2],
        device=DEVICE,
    )


def test_v2_tables_and_arena_bytes_follow_one_steps_moves(tables):
    arena = build_arena(attention_spec(BLOCK), gdn_spec(BLOCK), arena_bytes=48 * MiB)
    config = arena.config
    owned = config.layout.token_ids_at(arena.state_floor)
    a, b, c, d, e, f = (owned.start + i for i in (0, 1, 2, 3, 4, 5))
    state_a, state_b = config.layout.state_ids_at(arena.state_floor)[:2]
    tables.append_block_ids(0, ([a, b, c], [state_a]), overwrite=True)
    tables.append_block_ids(1, ([c, d], [state_b]), overwrite=True)
    tables.apply_staged_writes()
    # c moves to e while a moves to c (a chain); b and d swap
    moves = {c: e, a: c, b: d, d: b}
    generator = torch.Generator().manual_seed(0)
    noise = torch.randint(-128, 128, arena.raw.shape, generator=generator)
    arena.raw.copy_(noise.to(torch.int8))
    before = arena.raw.clone()
    state_table = tables.block_tables[1].gpu.clone()
    runner = SimpleNamespace(
        kv_cache_config=config,
        kv_caches=list(arena.views.values()),
        compilation_config=SimpleNamespace(
            static_forward_context={
                name: SimpleNamespace(kv_cache=view)
                for name, view in arena.views.items()
            }
        ),
        block_tables=tables,
    )
    on_cuda = DEVICE.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize()
    with torch.cuda.set_sync_debug_mode("error") if on_cuda else nullcontext():
        apply_token_moves(runner, moves)
    token = tables.block_tables[0].gpu.cpu()
    assert token[0, :3].tolist() == [c, d, e]
    assert token[1, :2].tolist() == [e, b]
    assert int(token[2:].abs().sum()) == 0
    assert torch.equal(tables.block_tables[1].gpu, state_table)
    tb = config.pool_by_kind(PoolKind.TOKEN).block_bytes
    whole = arena.raw.numel() // tb * tb
    rows = arena.raw[:whole].view(-1, tb).cpu()
    old = before[:whole].view(-1, tb).cpu()
    for src, dst in moves.items():
        assert torch.equal(rows[dst], old[src]), (src, dst)
    changed = set(((arena.raw != before).nonzero().flatten() // tb).tolist())
    assert changed == set(moves.values())
    # f never moved: its row, like every byte outside the destinations, stayed
    assert torch.equal(rows[f], old[f])
