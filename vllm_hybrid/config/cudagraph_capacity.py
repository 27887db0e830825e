"""Full CUDA graphs in pooled mode: decode graphs against the state pool.

With full CUDA graphs, vLLM 0.32 refuses to start a model with Mamba layers
when ``max_num_seqs`` exceeds ``KVCacheConfig.num_blocks`` (at the end of
``CompilationConfig.resolve_cudagraph_mode_and_sizes``). What that protects:
a full decode graph of ``B`` sequences is captured with ``B`` state rows, all
padded to the null state id 0, and GDN's ``causal_conv1d_update`` asserts
that each state layer's view has at least ``B`` blocks. In upstream's single
pool every view has ``num_blocks`` blocks, and decode graphs never exceed
``max_num_seqs`` sequences, so ``max_num_seqs <= num_blocks`` covers it.

In pooled mode ``num_blocks`` is the token pool's id space, so upstream's
comparison passes configurations whose capture then fails that assertion
(each state view has only ``arena // state block`` blocks). Here the largest
full graph is compared with the requests' states the arena can hold at once:
the state pool at its highest extent (the token pool at its minimum) divided
by the blocks a running request holds. Every captured state row then exists,
and no graph is larger than a batch the arena can ever run. The graphs are
compared, not ``max_num_seqs``: a ``max_num_seqs`` above what the arena holds
only caps the scheduler, which never runs more requests than have states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.config.compilation import CompilationConfig, CUDAGraphMode
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_hybrid.logger import init_logger
from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.v1.core.pooled.planner import min_state_blocks_per_request
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig, PoolKind

logger = init_logger(__name__)

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class FullGraphStates:
    """The largest full CUDA graph of an engine and the states for its rows."""

    max_num_seqs: int
    #: Capture size (tokens) of the largest full graph, and its sequences.
    graph_tokens: int
    graph_rows: int
    #: Tokens per sequence of a uniform decode batch (1 + draft tokens).
    decode_query_len: int
    #: State blocks the state pool can own at once (token pool at its floor).
    state_blocks: int
    #: State blocks one running request holds at least: its running state
    #: (align mode's copy target can be lent in place, see
    #: ``min_state_blocks_per_request``), plus prefill checkpoint and draft
    #: slots where the layer type has them.
    blocks_per_request: int
    state_block_bytes: int
    arena_bytes: int

    @property
    def max_states(self) -> int:
        """Requests whose states the arena can hold at once."""
        return self.state_blocks // self.blocks_per_request

    @property
    def fits(self) -> bool:
        return self.graph_rows <= self.max_states

    @property
    def needed_arena_bytes(self) -> int:
        """Arena whose state pool holds ``graph_rows`` requests' states.

        Exact: whole state blocks added to the arena add as many ids to the
        state pool and leave the null region and the token pool's minimum
        (hence the lowest state floor) where they are.
        """
        missing = self.graph_rows * self.blocks_per_request - self.state_blocks
        return self.arena_bytes + max(0, missing) * self.state_block_bytes

    def message(self) -> str:
        states, cap = self.max_states, self.max_states * self.decode_query_len
        needed = self.needed_arena_bytes
        return (
            f"vllm-hybrid pooled KV mode: full CUDA graphs are captured for "
            f"batches of up to {self.graph_rows} sequences (capture size "
            f"{self.graph_tokens}, max_num_seqs {self.max_num_seqs}), each "
            f"sequence with its own recurrent state, but the KV cache arena of "
            f"{self.arena_bytes / GiB:.2f} GiB holds at most {states} requests' "
            f"states at once ({self.state_blocks} state blocks of "
            f"{self.state_block_bytes / MiB:.2f} MiB, {self.blocks_per_request} "
            f"per running request). Lower --max-num-seqs to {states}, or keep "
            f"the capture sizes at or below {cap} (--max-cudagraph-capture-size "
            f"{cap} or --cudagraph-capture-sizes), or raise "
            f"--kv-cache-memory-bytes to at least {needed} "
            f"({needed / GiB:.2f} GiB; or --gpu-memory-utilization to match), "
            f"or run without full CUDA graphs "
            f"(-cc.cudagraph_mode=PIECEWISE)."
        )


def largest_full_graph(
    mode: CUDAGraphMode, capture_sizes: list[int], max_num_seqs: int, query_len: int
) -> tuple[int, int]:
    """``(capture size, sequences)`` of the largest full graph, (0, 0) if none.

    Mirrors what the V1 runner captures: decode graphs for the capture sizes
    of at most ``query_len * max_num_seqs`` tokens (``CudagraphDispatcher``),
    ``cdiv(size, query_len)`` sequences each; mixed full graphs for every
    capture size, ``min(size, max_num_seqs)`` sequences (``_dummy_run``).
    """
    best = (0, 0)
    if mode.mixed_mode() == CUDAGraphMode.FULL and capture_sizes:
        size = max(capture_sizes)
        best = (size, min(size, max_num_seqs))
    if mode.decode_mode() == CUDAGraphMode.FULL:
        limit = query_len * max_num_seqs
        decode = [s for s in capture_sizes if query_len <= s <= limit]
        if decode and cdiv(max(decode), query_len) > best[1]:
            best = (max(decode), cdiv(max(decode), query_len))
    return best


def full_graph_states(
    config: PooledKVCacheConfig,
    mode: CUDAGraphMode,
    capture_sizes: list[int],
    max_num_seqs: int,
    query_len: int = 1,
) -> FullGraphStates:
    """The largest full graph of ``mode`` against ``config``'s state pool."""
    state = config.pool_by_kind(PoolKind.STATE)
    spec = config.kv_cache_groups[state.group_ids[0]].kv_cache_spec
    assert isinstance(spec, MambaSpec)
    layout = config.layout
    tokens, rows = largest_full_graph(mode, capture_sizes, max_num_seqs, query_len)
    return FullGraphStates(
        max_num_seqs=max_num_seqs,
        graph_tokens=tokens,
        graph_rows=rows,
        decode_query_len=query_len,
        state_blocks=layout.state_capacity_at(layout.min_state_floor),
        blocks_per_request=min_state_blocks_per_request(spec),
        state_block_bytes=state.block_bytes,
        arena_bytes=layout.arena_bytes,
    )


def check_full_graph_states(states: FullGraphStates) -> None:
    """Refuse graphs with more rows than the arena has states; say when
    ``max_num_seqs`` is more than the arena can ever run."""
    if not states.fits:
        raise ValueError(states.message())
    if states.max_num_seqs > states.max_states:
        logger.info_once(
            "vllm-hybrid pooled KV mode: the KV cache arena holds at most %d "
            "requests' states at once, so at most %d of max_num_seqs %d run "
            "concurrently; full CUDA graphs (up to %d sequences) fit",
            states.max_states,
            states.max_states,
            states.max_num_seqs,
            states.graph_rows,
        )


def resolve_cudagraph_mode_and_sizes(
    self: CompilationConfig,
    min_cg_support: Any,
    min_cg_attn_backend: str | None,
    uniform_decode_query_len: int = 1,
    use_v2_model_runner: bool = False,
    kv_cache_config: Any = None,
    max_num_reqs: int | None = None,
    is_profiling: bool = False,
    piecewise_capture_available: bool = True,
) -> CUDAGraphMode:
    """Upstream's resolution; for pooled configs its single-pool block check
    is replaced by :func:`check_full_graph_states` (upstream reads
    ``kv_cache_config`` for that check only, so it gets None)."""
    pooled = isinstance(kv_cache_config, PooledKVCacheConfig)
    mode = upstream_of(__name__, "resolve_cudagraph_mode_and_sizes")(
        self,
        min_cg_support,
        min_cg_attn_backend,
        uniform_decode_query_len,
        use_v2_model_runner,
        kv_cache_config=None if pooled else kv_cache_config,
        max_num_reqs=max_num_reqs,
        is_profiling=is_profiling,
        piecewise_capture_available=piecewise_capture_available,
    )
    if (
        pooled
        and max_num_reqs is not None
        and not is_profiling
        and mode.has_full_cudagraphs()
    ):
        states = full_graph_states(
            kv_cache_config,
            mode,
            list(self.cudagraph_capture_sizes or []),
            max_num_reqs,
            uniform_decode_query_len,
        )
        check_full_graph_states(states)
    return mode
