"""Token block moves, the worker's half: copy the moved blocks, rename them.

Pooled mode's boundary between the token and state pools (see
:mod:`vllm_hybrid.v1.core.pooled.spec`) only moves over token ids no live
block holds. To clear such a stretch, the scheduler may relocate live token
blocks to other token ids within a step, and says so in an attribute it adds
to the step's ``SchedulerOutput``: ``hybrid_token_moves``, ``{old token id:
new token id}`` (absent or empty: no moves). Each worker then has to

* copy every moved block's bytes to its new id, for every layer at once, and
* rename the moved ids wherever its model runner kept block ids of earlier
  steps: the token groups' block tables, and on Model Runner V1 the block id
  lists of its cached request states.

The mapping is *simultaneous*: every source is read before any destination
is written, so ``{X: A, A: C}`` gives C the old bytes of A and A those of X.
The step's own new block ids (new requests, new blocks of running ones,
``new_block_ids_to_zero``) already use the new ids.

All of it must happen before the runner's own update of the step: the
runner appends the step's new ids to the tables, zeroes freshly handed out
blocks (a moved-from id may be one of them) and runs align mode's state
pre-copies, any of which would otherwise meet ids or bytes of the wrong
numbering. :func:`execute_model` (a registry entry on upstream's GPU
worker, which the CPU worker inherits) does it first, then calls upstream.

Where the bytes are: upstream's ``allocate_kv_cache`` allocates the arena
as one int8 tensor of its own (arena byte 0 is byte 0 of its storage) and
views every layer over it; the pooled planner gives each token layer's view
its pages below ``tb`` (the token pool's ``block_bytes``) and a block stride
of ``tb``. So token block ``t`` of every layer, draft layers included, is
bytes ``[t*tb, (t+1)*tb)`` of that storage: one row copy per block moves it
for the whole model. :func:`token_rows` checks the runner's views for this.

On CUDA nothing here waits for the device: index tensors are built on the
host and copied without blocking; copies and table rewrites are queued on
the current stream after the previous step's forward pass (so they see its
KV writes) and before this step's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.utils.torch_utils import async_tensor_h2d

from vllm_hybrid.logger import init_logger
from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.v1.core.pooled.moves import MOVES_ATTRIBUTE
from vllm_hybrid.v1.core.pooled.spec import ArenaLayout, PooledKVCacheConfig, PoolKind

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.block_table import MultiGroupBlockTable
    from vllm.v1.worker.gpu.block_table import BlockTables
    from vllm.v1.worker.gpu_input_batch import CachedRequestState
    from vllm.v1.worker.gpu_worker import Worker

logger = init_logger(__name__)


#: Bytes one batch of the copy stages: blocks that are not also destinations
#: go in batches, so a large move needs no temporary as large as itself.
COPY_CHUNK_BYTES = 64 << 20


class TokenMoveError(RuntimeError):
    """Token moves this worker cannot apply; never sent by a sound scheduler."""


def checked_moves(
    moves: Mapping[int, int], layout: ArenaLayout
) -> tuple[list[int], list[int]]:
    """Sources and destinations of ``moves``, sorted by source, without the
    pairs that keep their id.

    Refuses ids outside the token ids a block can own and two sources with
    one destination: applying either would overwrite a live block.
    """
    pairs = sorted((int(src), int(dst)) for src, dst in moves.items() if src != dst)
    lo, hi = layout.first_token_id, layout.num_token_ids
    outside = [pair for pair in pairs if not all(lo <= t < hi for t in pair)]
    if outside:
        raise TokenMoveError(
            f"token block moves {outside[:8]} leave the token ids [{lo}, {hi}) "
            "that blocks can own"
        )
    dests = [dst for _, dst in pairs]
    if len(set(dests)) != len(dests):
        raise TokenMoveError(f"token block moves {pairs[:8]}... share a destination")
    return [src for src, _ in pairs], dests


def token_rows(
    kv_caches: Sequence[torch.Tensor],
    config: PooledKVCacheConfig,
    token_views: Iterable[torch.Tensor] = (),
) -> torch.Tensor:
    """The arena as uint8 rows ``[token ids, tb]``: row ``t`` is token block
    ``t`` of every layer.

    ``kv_caches`` are the runner's views (all over the one arena storage);
    ``token_views`` those of the token groups' layers, whose block stride
    must be ``tb`` and whose block 0 must start inside token block 0.
    """
    token = config.pool_by_kind(PoolKind.TOKEN)
    tb = token.block_bytes
    storage = kv_caches[0].untyped_storage()
    base = storage.data_ptr()
    if any(view.untyped_storage().data_ptr() != base for view in kv_caches):
        raise TokenMoveError("the KV cache views do not share one arena storage")
    if storage.nbytes() < config.arena_bytes:
        raise TokenMoveError(
            f"the arena storage has {storage.nbytes()} B, the pooled plan "
            f"{config.arena_bytes} B"
        )
    for view in token_views:
        size = view.element_size()
        if (
            view.untyped_storage().data_ptr() != base
            or view.stride(0) * size != tb
            or view.storage_offset() * size >= tb
        ):
            raise TokenMoveError(
                f"a token layer's view (block stride {view.stride(0) * size} B, "
                f"offset {view.storage_offset() * size} B) is not laid out in "
                f"token blocks of {tb} B from the arena's start"
            )
    rows = torch.empty(0, dtype=torch.uint8, device=kv_caches[0].device)
    return rows.set_(storage, 0, (token.num_blocks, tb))


def copy_token_blocks(
    rows: torch.Tensor, sources: Sequence[int], dests: Sequence[int]
) -> None:
    """Copy row ``sources[i]`` to row ``dests[i]`` for every ``i``, as if all
    rows were read before any was written.

    Only sources that are also destinations need their old bytes kept: those
    are gathered first, into a temporary, and written last; every other
    source is never written, so it is copied straight, in batches.
    """
    overwritten = set(dests)
    order = sorted(range(len(sources)), key=lambda i: sources[i] not in overwritten)
    kept = sum(src in overwritten for src in sources)
    index = async_tensor_h2d(
        [[sources[i] for i in order], [dests[i] for i in order]],
        device=rows.device,
        dtype=torch.int64,
    )
    src, dst = index[0], index[1]
    old = rows.index_select(0, src[:kept])
    batch = max(1, COPY_CHUNK_BYTES // rows.shape[1])
    for start in range(kept, len(order), batch):
        end = min(start + batch, len(order))
        rows.index_copy_(0, dst[start:end], rows.index_select(0, src[start:end]))
    rows.index_copy_(0, dst[:kept], old)


def remap_request_states(
    requests: Mapping[str, CachedRequestState],
    group_ids: Sequence[int],
    moves: Mapping[int, int],
) -> None:
    """Rename moved ids in V1's request states' token group lists, in place
    (the runner appends to them and rebuilds batch rows from them)."""
    for state in requests.values():
        for group_id in group_ids:
            ids = state.block_ids[group_id]
            ids[:] = [moves.get(block, block) for block in ids]


def remap_v1_rows(
    block_table: MultiGroupBlockTable,
    rows: Sequence[int],
    group_ids: Sequence[int],
    sources: Sequence[int],
    dests: Sequence[int],
) -> None:
    """Rename moved ids in Model Runner V1's persistent batch rows ``rows``
    of the token groups.

    The host array is the table's source of truth (the runner copies it to
    the device each step); it holds block ids as the scheduler names them.
    ``sources`` must be sorted.
    """
    if not rows:
        return
    keys = np.asarray(sources, dtype=np.int32)
    values = np.asarray(dests, dtype=np.int32)
    index = np.asarray(rows, dtype=np.intp)
    for group_id in group_ids:
        table = block_table[group_id]
        width = int(table.num_blocks_per_row[index].max())
        if width == 0:
            continue
        array = table.get_numpy_array()
        ids = array[index, :width]
        pos = np.minimum(np.searchsorted(keys, ids), len(keys) - 1)
        hit = keys[pos] == ids
        ids[hit] = values[pos[hit]]
        array[index, :width] = ids


def remap_v2_tables(
    block_tables: BlockTables,
    group_ids: Sequence[int],
    sources: Sequence[int],
    dests: Sequence[int],
) -> None:
    """Rename moved ids in Model Runner V2's token group tables.

    V2 keeps block ids only in these device tables (request slots by
    columns; the per-step input tables are gathered from them), so they are
    rewritten on the device: every entry found among the sorted ``sources``
    becomes its destination. Columns past the longest row are left alone.
    """
    pairs = async_tensor_h2d(
        [list(sources), list(dests)], device=block_tables.device, dtype=torch.int32
    )
    keys, values = pairs[0], pairs[1]
    last = len(sources) - 1
    for group_id in group_ids:
        table = block_tables.block_tables[group_id].gpu
        width = min(int(block_tables.num_blocks.np[group_id].max()), table.shape[1])
        if width == 0:
            continue
        used = table[:, :width]
        ids = used.contiguous()
        pos = torch.searchsorted(keys, ids, out_int32=True).clamp_(max=last)
        used.copy_(torch.where(keys[pos] == ids, values[pos], ids))


def _token_views(runner: Any, config: PooledKVCacheConfig) -> Iterator[torch.Tensor]:
    """The views bound to the token groups' layers of this worker."""
    context = runner.compilation_config.static_forward_context
    for group_id in config.pool_by_kind(PoolKind.TOKEN).group_ids:
        for name in config.kv_cache_groups[group_id].layer_names:
            view = getattr(context.get(name), "kv_cache", None)
            if isinstance(view, torch.Tensor) and view.numel():
                yield view


def apply_token_moves(runner: Any, moves: Mapping[int, int]) -> None:
    """Apply one step's token moves to ``runner`` (Model Runner V1, which
    the CPU runner is, or V2) before it sees the step."""
    config = getattr(runner, "kv_cache_config", None)
    if not isinstance(config, PooledKVCacheConfig):
        raise TokenMoveError(
            f"the scheduler moved {len(moves)} token blocks, but this worker's "
            f"KV cache config is a {type(config).__name__}, not a pooled one; "
            "only a pooled plan's scheduler moves blocks"
        )
    sources, dests = checked_moves(moves, config.layout)
    if not sources:
        return
    groups = config.pool_by_kind(PoolKind.TOKEN).group_ids
    is_v2 = hasattr(runner, "block_tables")
    if not is_v2 and not hasattr(runner, "input_batch"):
        raise TokenMoveError(
            f"token block moves need Model Runner V1 or V2; "
            f"{type(runner).__name__} has neither block_tables nor input_batch"
        )
    with torch.inference_mode():
        if is_v2:
            remap_v2_tables(runner.block_tables, groups, sources, dests)
        else:
            # With async scheduling the previous step may still be copying
            # the persistent batch's host tables to the device; upstream
            # waits for that at the start of its update, and so must edits
            # that come before it (the same wait, so no extra stall).
            event = getattr(runner, "prepare_inputs_event", None)
            if event is not None:
                event.synchronize()
            remap_request_states(runner.requests, groups, moves)
            batch = runner.input_batch
            rows = list(batch.req_id_to_index.values())
            remap_v1_rows(batch.block_table, rows, groups, sources, dests)
        if runner.kv_caches:
            views = _token_views(runner, config)
            copy_token_blocks(
                token_rows(runner.kv_caches, config, views), sources, dests
            )
    logger.debug("Moved %d token blocks to new ids", len(sources))


def execute_model(self: Worker, scheduler_output: SchedulerOutput) -> Any:
    """Upstream's ``Worker.execute_model``, after the step's token moves."""
    moves = getattr(scheduler_output, MOVES_ATTRIBUTE, None)
    if moves:
        apply_token_moves(self.model_runner, moves)
    return upstream_of(__name__, "execute_model")(self, scheduler_output)
