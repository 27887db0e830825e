"""Scheduler of pooled mode when state checkpoints are sparser than attention blocks.

In align mode vLLM's scheduler ends every prefill chunk on a "block" edge,
because a Mamba/GDN state is written to its block only at chunk ends: block
``p`` must hold the state after exactly ``(p + 1) * block`` tokens. The
scheduler takes that block from ``cache_config.block_size``, which upstream
always makes equal to the state block (it inflates attention to it).

Pooled mode keeps attention at its natural block and lets the state
checkpoint interval (``--mamba-block-size``) be a multiple of it. Then
``cache_config.block_size`` is the attention block, chunks end on attention
block edges, and every checkpoint a chunk runs past is never written: with
an interval of 384 over 128-token attention blocks a 760-token prompt was
cut at 640 and cached no state at 384. This scheduler gives the Mamba
alignment the state group's block instead; everything else stays upstream's.
"""

from __future__ import annotations

import copy
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_hybrid.logger import init_logger

logger = init_logger(__name__)


def state_checkpoint_block(kv_cache_config: Any, mamba_cache_mode: str) -> int | None:
    """The state block prefill chunks must end on, when it is longer than the
    attention block; None otherwise (upstream's alignment is then right).

    Only align mode writes checkpoints; all state groups of a pooled plan
    share one block size (the checkpoint interval).
    """
    if mamba_cache_mode != "align":
        return None
    state, token = set(), set()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        (state if isinstance(spec, MambaSpec) else token).add(spec.block_size)
    if len(state) != 1 or not token:
        return None
    (block,) = state
    return block if block > min(token) else None


class CheckpointAlignedSplitMixin:
    """Ends align-mode prefill chunks on state checkpoint edges.

    Upstream's ``Scheduler`` reads ``cache_config.block_size`` after its
    constructor only in ``_mamba_block_aligned_split`` (a test checks this
    against the installed vLLM). The scheduler therefore keeps its own copy
    of the cache config whose ``block_size`` is the state block; the workers'
    config, and with it the attention block, is untouched.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        block = state_checkpoint_block(
            self.kv_cache_config, self.cache_config.mamba_cache_mode
        )
        if block is None:
            return
        attention_block = self.cache_config.block_size
        view = copy.copy(self.cache_config)
        view.block_size = block
        self.cache_config = view
        logger.info(
            "vllm-hybrid pooled KV mode: prefill chunks end on state checkpoint "
            "edges (every %d tokens; attention blocks of %d)",
            block,
            attention_block,
        )


class PooledScheduler(CheckpointAlignedSplitMixin, Scheduler):
    """``Scheduler`` whose align-mode prefill chunks end on checkpoint edges."""


def select_scheduler(vllm_config: Any, kv_cache_config: Any) -> None:
    """Make the engine core build :class:`PooledScheduler` (or its async
    twin) when the pooled plan's state block is longer than the attention
    block; leave every other engine's scheduler alone.

    Runs in the engine-core process after KV planning, before the scheduler
    class is resolved. A scheduler class the user chose is kept, with one
    warning saying what it misses.
    """
    block = state_checkpoint_block(
        kv_cache_config, vllm_config.cache_config.mamba_cache_mode
    )
    if block is None:
        return
    scheduler_config = vllm_config.scheduler_config
    if scheduler_config.scheduler_cls is None:
        if scheduler_config.async_scheduling:
            from vllm_hybrid.v1.core.sched.async_scheduler import PooledAsyncScheduler

            scheduler_config.scheduler_cls = PooledAsyncScheduler
        else:
            scheduler_config.scheduler_cls = PooledScheduler
        return
    chosen = scheduler_config.scheduler_cls
    if isinstance(chosen, type) and issubclass(chosen, CheckpointAlignedSplitMixin):
        return
    logger.warning(
        "vllm-hybrid pooled KV mode: --scheduler-cls %s ends prefill chunks on "
        "attention block edges, so state checkpoints every %d tokens "
        "(--mamba-block-size) are written only where a chunk happens to end "
        "and prefix hits are lost; leave --scheduler-cls unset, or set "
        "--mamba-block-size to the attention block",
        chosen,
        block,
    )
