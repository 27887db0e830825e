"""Token block moves on the worker: bytes copied, kept block ids renamed,
both before the model runner sees the step.

A small pooled plan (two attention layers, two state layers) is allocated on
CPU by upstream's ``allocate_kv_cache``, as every worker does; the runners
are stand-ins holding upstream's real tables (V1's ``InputBatch`` with its
``MultiGroupBlockTable``, V2's ``BlockTables``) and request states. Every
test moves a chain (6 -> 2 -> 7: block 2's old bytes go to 7 while block 6's
go to 2) and a swap (3 <-> 4), so only a copy that reads every source before
writing any destination passes.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
from types import SimpleNamespace

import pytest
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.utils import allocate_kv_cache

from vllm_hybrid.patches.registry import apply_all, upstream_of
from vllm_hybrid.patches.token_move_entries import TOKEN_MOVE_PATCHES
from vllm_hybrid.v1.core.pooled.layers import split_layers
from vllm_hybrid.v1.core.pooled.planner import PooledBudget, plan_pooled_kv_cache
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind
from vllm_hybrid.v1.worker import token_moves
from vllm_hybrid.v1.worker.token_moves import (
    TokenMoveError,
    apply_token_moves,
    checked_moves,
    copy_token_blocks,
    token_rows,
)

MOVES = {6: 2, 2: 7, 3: 4, 4: 3}
TOKEN_LAYERS = ("model.layers.0", "model.layers.1")
STATE_LAYERS = ("model.layers.2", "model.layers.3")


def _plan(overlap: bool = True) -> PooledKVCacheConfig:
    attention = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16
    )
    state = MambaSpec(
        block_size=16,
        shapes=((3, 64), (2, 16, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode="align",
    )
    specs = {name: attention for name in TOKEN_LAYERS}
    specs |= {name: state for name in STATE_LAYERS}
    budget = PooledBudget(
        arena_bytes=1 << 20,
        max_model_len=128,
        max_num_seqs=4,
        null_blocks_overlap=overlap,
    )
    return plan_pooled_kv_cache(split_layers(specs), budget)


def _arena(config: PooledKVCacheConfig) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Upstream's views of the plan, and the arena's bytes (random)."""
    views = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    storage = views[TOKEN_LAYERS[0]].untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    generator = torch.Generator().manual_seed(0)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    return views, raw


def _runner(config, views, **attributes) -> SimpleNamespace:
    context = {name: SimpleNamespace(kv_cache=view) for name, view in views.items()}
    return SimpleNamespace(
        kv_cache_config=config,
        kv_caches=list(views.values()),
        compilation_config=SimpleNamespace(static_forward_context=context),
        **attributes,
    )


def _expect_moved(raw: torch.Tensor, before: torch.Tensor, tb: int, moves) -> None:
    """Each destination row holds its source's old bytes; every other byte
    of the arena is unchanged."""
    whole = raw.numel() // tb * tb
    rows, old_rows = raw[:whole].view(-1, tb), before[:whole].view(-1, tb)
    for src, dst in moves.items():
        assert torch.equal(rows[dst], old_rows[src]), (src, dst)
    changed = (raw != before).nonzero().flatten() // tb
    assert set(changed.tolist()) <= set(moves.values())


# ---------------------------------------------------------------------------
# Bytes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", [True, False], ids=["cpu-nulls", "cuda-nulls"])
def test_upstream_views_put_token_block_t_at_t_times_tb(overlap):
    config = _plan(overlap)
    views, raw = _arena(config)
    tb = config.pool_by_kind(PoolKind.TOKEN).block_bytes
    assert raw.numel() == config.arena_bytes and raw.storage_offset() == 0
    for name in TOKEN_LAYERS:
        view = views[name]
        assert view.stride(0) * view.element_size() == tb
        assert 0 <= view.storage_offset() * view.element_size() < tb
    rows = token_rows(list(views.values()), config, [views[n] for n in TOKEN_LAYERS])
    assert rows.shape == (config.layout.num_token_ids, tb) and rows.dtype == torch.uint8
    # a write through the second layer's block 5 lands in row 5 only
    raw.fill_(255)
    views[TOKEN_LAYERS[1]][5].fill_(0)
    zeros = (raw == 0).nonzero().flatten()
    assert len(zeros) == views[TOKEN_LAYERS[1]][5].nbytes
    assert set((zeros // tb).tolist()) == {5} and int((rows[5] == 0).sum()) == len(
        zeros
    )


def test_a_chain_and_a_swap_copy_every_source_before_any_destination():
    config = _plan()
    views, raw = _arena(config)
    before = raw.clone()
    tb = config.pool_by_kind(PoolKind.TOKEN).block_bytes
    # random bytes include NaNs as float16: compare them as integers
    layer0 = views[TOKEN_LAYERS[0]].view(torch.int16)
    old = {b: layer0[b].clone() for b in (2, 3, 4, 6)}
    rows = token_rows(list(views.values()), config)
    copy_token_blocks(rows, *checked_moves(MOVES, config.layout))
    _expect_moved(raw, before, tb, MOVES)
    # through a layer's own view: 7 has 2's old page, 2 has 6's, 3 and 4 swapped
    for src, dst in MOVES.items():
        assert torch.equal(layer0[dst], old[src])
    assert torch.equal(raw[6 * tb : 7 * tb], before[6 * tb : 7 * tb])  # not cleared


def test_long_moves_are_copied_in_batches_with_the_same_result(monkeypatch):
    monkeypatch.setattr(token_moves, "COPY_CHUNK_BYTES", 1)  # one block a batch
    config = _plan()
    views, raw = _arena(config)
    before = raw.clone()
    tb = config.pool_by_kind(PoolKind.TOKEN).block_bytes
    moves = {10: 11, 11: 12, 12: 13, 20: 30, 21: 31, 22: 32, 9: 10}
    copy_token_blocks(
        token_rows(list(views.values()), config), *checked_moves(moves, config.layout)
    )
    _expect_moved(raw, before, tb, moves)


def test_moves_a_sound_scheduler_never_sends_are_refused():
    layout = _plan().layout
    assert checked_moves({5: 5, 9: 3, 3: 8}, layout) == ([3, 9], [8, 3])
    with pytest.raises(TokenMoveError, match="share a destination"):
        checked_moves({2: 9, 3: 9}, layout)
    for bad in ({0: 5}, {5: 0}, {5: layout.num_token_ids}):
        with pytest.raises(TokenMoveError, match="token ids"):
            checked_moves(bad, layout)


def test_views_not_laid_out_in_token_blocks_are_refused():
    config = _plan()
    views, _ = _arena(config)
    caches = list(views.values())
    token = views[TOKEN_LAYERS[0]]
    halved = token.as_strided(token.shape, (token.stride(0) // 2, *token.stride()[1:]))
    with pytest.raises(TokenMoveError, match="block stride 4096 B"):
        token_rows(caches, config, [halved])
    with pytest.raises(TokenMoveError, match="one arena storage"):
        token_rows([*caches, torch.zeros(4, dtype=torch.uint8)], config)
    with pytest.raises(TokenMoveError, match="storage has 1024 B"):
        token_rows([torch.zeros(1024, dtype=torch.int8)], config)


# ---------------------------------------------------------------------------
# Block ids the runners kept
# ---------------------------------------------------------------------------


def _state(
    req_id: str, token_ids: list[int], state_ids: list[int]
) -> CachedRequestState:
    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=[1, 2, 3],
        mm_features=[],
        sampling_params=SamplingParams(),
        generator=None,
        block_ids=(token_ids, state_ids),
        num_computed_tokens=0,
        output_token_ids=[],
    )


class _Event:
    """Model Runner V1's input-prep event; records what was kept at the wait."""

    def __init__(self, requests):
        self.requests, self.seen = requests, []

    def synchronize(self) -> None:
        self.seen.append(list(self.requests["a"].block_ids[0]))


def _v1_runner(config, views) -> SimpleNamespace:
    # a and b run (persistent batch rows 0 and 1) and share block 6; c is
    # kept but not in the batch. State ids equal to moved token ids stay.
    batch = InputBatch(
        max_num_reqs=4,
        max_model_len=256,
        max_num_batched_tokens=64,
        device=torch.device("cpu"),
        vocab_size=32,
        block_sizes=[16, 16],
        max_num_blocks_per_req=[16, 2],
    )
    requests = {
        "a": _state("a", [2, 5, 6], [6]),
        "b": _state("b", [6, 3], [2]),
        "c": _state("c", [4], [3]),
    }
    for req_id in ("a", "b"):
        batch.add_request(requests[req_id])
    runner = _runner(config, views, requests=requests, input_batch=batch)
    runner.prepare_inputs_event = _Event(requests)
    return runner


def _v1_rows(runner, group: int) -> list[list[int]]:
    table = runner.input_batch.block_table[group]
    array, counts = table.get_numpy_array(), table.num_blocks_per_row
    return [array[row, : counts[row]].tolist() for row in (0, 1)]


def test_v1_renames_request_states_and_batch_rows_of_token_groups_only():
    config = _plan()
    views, raw = _arena(config)
    before = raw.clone()
    runner = _v1_runner(config, views)
    apply_token_moves(runner, MOVES)
    ids = {r: s.block_ids for r, s in runner.requests.items()}
    assert ids == {"a": ([7, 5, 2], [6]), "b": ([2, 4], [2]), "c": ([3], [3])}
    assert _v1_rows(runner, 0) == [[7, 5, 2], [2, 4]]
    assert _v1_rows(runner, 1) == [[6], [2]]
    # the host tables were edited only after the previous step's copy of them
    assert runner.prepare_inputs_event.seen == [[2, 5, 6]]
    _expect_moved(raw, before, config.pool_by_kind(PoolKind.TOKEN).block_bytes, MOVES)


@pytest.fixture
def v2_tables(monkeypatch):
    """Upstream's V2 ``BlockTables`` on CPU (no pinned memory here, so its
    staging buffers take the path for platforms without it): token group 0,
    state group 1, slots 0 and 1 as V1's rows above."""
    from vllm.v1.worker.gpu import buffer_utils
    from vllm.v1.worker.gpu.block_table import BlockTables

    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    tables = BlockTables(
        block_sizes=[16, 16],
        max_num_reqs=4,
        max_num_batched_tokens=64,
        max_num_blocks_per_group=[8, 2],
        device=torch.device("cpu"),
    )
    token, state = (t.gpu for t in tables.block_tables)
    token[0, :3] = torch.tensor([2, 5, 6])
    token[1, :2] = torch.tensor([6, 3])
    state[0, 0], state[1, 0] = 6, 2
    tables.num_blocks.np[:] = [[3, 2, 0, 0], [1, 1, 0, 0]]
    return tables


def test_v2_renames_the_token_tables_on_the_device_and_leaves_state_tables(v2_tables):
    config = _plan()
    views, raw = _arena(config)
    before = raw.clone()
    state_before = v2_tables.block_tables[1].gpu.clone()
    runner = _runner(config, views, block_tables=v2_tables)
    apply_token_moves(runner, MOVES)
    token = v2_tables.block_tables[0].gpu
    assert token[0, :3].tolist() == [7, 5, 2] and token[1, :2].tolist() == [2, 4]
    assert int(token[2:].abs().sum()) == 0  # free slots stay empty
    assert torch.equal(v2_tables.block_tables[1].gpu, state_before)
    _expect_moved(raw, before, config.pool_by_kind(PoolKind.TOKEN).block_bytes, MOVES)


def test_a_runner_of_neither_kind_is_refused_before_anything_moves():
    config = _plan()
    views, raw = _arena(config)
    before = raw.clone()
    with pytest.raises(TokenMoveError, match="neither block_tables nor input_batch"):
        apply_token_moves(_runner(config, views), MOVES)
    assert torch.equal(raw, before)


# ---------------------------------------------------------------------------
# The hook on the worker
# ---------------------------------------------------------------------------


def _output(moves=None) -> SchedulerOutput:
    output = SchedulerOutput.make_empty()
    if moves is not None:
        output.hybrid_token_moves = moves
    return output


@pytest.fixture
def hooked(monkeypatch):
    """``execute_model`` with upstream's method replaced by a recorder of the
    runner's kept ids at the moment it is called."""
    config = _plan()
    views, _ = _arena(config)
    runner = _v1_runner(config, views)
    calls: list[list[int]] = []

    def upstream(worker, output):
        calls.append(list(worker.model_runner.requests["a"].block_ids[0]))
        return "upstream's output"

    monkeypatch.setattr(token_moves, "upstream_of", lambda module, name: upstream)
    return SimpleNamespace(model_runner=runner), calls


def test_moves_are_applied_before_upstreams_execute_model_runs(hooked):
    worker, calls = hooked
    assert token_moves.execute_model(worker, _output(MOVES)) == "upstream's output"
    assert calls == [[7, 5, 2]]


@pytest.mark.parametrize("moves", [None, {}], ids=["absent", "empty"])
def test_steps_without_moves_go_straight_to_upstream(hooked, moves):
    worker, calls = hooked
    worker.model_runner.prepare_inputs_event = None  # any wait would fail
    token_moves.execute_model(worker, _output(moves))
    assert calls == [[2, 5, 6]]


def test_moves_on_a_config_that_is_not_pooled_are_refused(hooked):
    worker, calls = hooked
    plain = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[])
    worker.model_runner.kv_cache_config = plain
    with pytest.raises(RuntimeError, match="not a pooled one"):
        token_moves.execute_model(worker, _output(MOVES))
    assert calls == []
    token_moves.execute_model(worker, _output())
    assert calls == [[2, 5, 6]]


def test_the_entry_replaces_the_worker_method_the_cpu_worker_inherits():
    (entry,) = TOKEN_MOVE_PATCHES
    assert issubclass(CPUWorker, Worker) and "execute_model" not in vars(CPUWorker)
    original = upstream_of(token_moves.__name__, "execute_model")
    assert original is not token_moves.execute_model
    apply_all(TOKEN_MOVE_PATCHES)
    assert Worker.execute_model is token_moves.execute_model
    assert CPUWorker.execute_model is token_moves.execute_model
    assert upstream_of(token_moves.__name__, "execute_model") is original
    assert entry.bindings == ()


def test_the_moves_survive_pickling_and_copies_but_not_dataclass_replace():
    """Multiprocess executors pickle each step's output to the workers; a
    dataclass without slots keeps the added attribute in its instance dict.
    ``dataclasses.replace`` builds a new output from the fields only, which
    is why the worker reads the moves before upstream's runner (which
    replaces the output for n-gram GPU drafts) sees the step."""
    output = _output({6: 2, 2: 7})
    for copied in (
        pickle.loads(pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL)),
        copy.deepcopy(output),
        copy.copy(output),
    ):
        assert copied.hybrid_token_moves == {6: 2, 2: 7}
    assert not hasattr(dataclasses.replace(output), "hybrid_token_moves")
