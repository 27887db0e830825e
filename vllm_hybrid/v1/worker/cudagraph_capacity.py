"""Full CUDA graphs of hybrid models, sized to the states the KV cache holds.

A full decode graph of ``B`` sequences is captured with ``B`` state rows, all
padded to the null state id 0, and GDN's ``causal_conv1d_update`` asserts
that each state layer's view has at least ``B`` blocks. vLLM 0.32 protects
that at the end of ``CompilationConfig.resolve_cudagraph_mode_and_sizes``:
with full graphs and Mamba layers it refuses to start when ``max_num_seqs``
exceeds ``KVCacheConfig.num_blocks``. It refuses rather than capping the
capture sizes because those sizes are shared with the piecewise (prefill)
graphs (vLLM issue 34094). Refusing where upstream starts, or starting
nowhere, is what users of Qwen3.5/3.6 report most.

The overlay sizes the full graphs instead. The engine never runs more
sequences than the KV cache has states for:

* pooled mode: the state pool at its highest extent (the token pool at its
  floor) divided by the blocks a running request holds
  (:func:`full_graph_states`); upstream's ``num_blocks`` is the token pool's
  id space there, so its comparison would pass graphs whose capture fails;
* the single shared pool: every state view has ``num_blocks`` blocks, and
  each running request holds at least one of them
  (:func:`single_pool_graph_states`).

Both counts are :mod:`~vllm_hybrid.v1.core.pooled.capacity`'s (its
``StateRoom``), the figures the planner and ``vllm-hybrid plan`` use too;
this module only sets them against the graphs a worker captures.

When the largest full graph has more rows than that, the full graphs are
capped at that many sequences: the dispatcher's full keys above the cap are
dropped (:func:`initialize_cudagraph_keys`), so such batches run the
piecewise graphs, which are captured as before. Model Runner V2 builds its
graphs' descriptors itself instead of the dispatcher's keys; there the full
descriptors above the cap are dropped from what it captures and dispatches
to (:func:`init_candidates`). One log line names both numbers and the
options that change them. Only a KV cache that holds no request's state at
all is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.config.compilation import CompilationConfig, CUDAGraphMode
from vllm.utils.math_utils import cdiv

from vllm_hybrid.logger import init_logger
from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.v1.core.pooled.capacity import (
    StateRoom,
    pooled_state_room,
    shared_pool_state_room,
)
from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig

if TYPE_CHECKING:
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.worker.gpu.cudagraph_utils import (
        BatchExecutionDescriptor,
        CudaGraphManager,
    )

logger = init_logger(__name__)

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True, kw_only=True)
class FullGraphStates(StateRoom):
    """The largest full CUDA graph of an engine and the states for its rows
    (the states as :mod:`~vllm_hybrid.v1.core.pooled.capacity` counts them)."""

    max_num_seqs: int
    #: Capture size (tokens) of the largest full graph, and its sequences.
    graph_tokens: int
    graph_rows: int
    #: Tokens per sequence of a uniform decode batch (1 + draft tokens).
    decode_query_len: int

    @property
    def fits(self) -> bool:
        return self.graph_rows <= self.max_states

    @property
    def row_cap(self) -> int | None:
        """Sequences the full graphs are capped at; None: no cap needed."""
        return None if self.fits else self.max_states

    @property
    def _sized(self) -> bool:
        return self.arena_bytes is not None and self.state_block_bytes is not None

    @property
    def needed_arena_bytes(self) -> int | None:
        """KV cache that holds ``graph_rows`` requests' states."""
        return self.bytes_for(self.graph_rows)

    def _where(self) -> str:
        if not self._sized:
            return (
                f"the KV cache {self.holder} holds at most {self.max_states} "
                f"requests' states at once ({self.state_blocks} state blocks, "
                f"{self.blocks_per_request} per running request)"
            )
        return (
            f"the KV cache {self.holder} of {self.arena_bytes / GiB:.2f} GiB holds "
            f"at most {self.max_states} requests' states at once "
            f"({self.state_blocks} state blocks of "
            f"{self.state_block_bytes / MiB:.2f} MiB, {self.blocks_per_request} "
            f"per running request)"
        )

    @staticmethod
    def _memory_option(needed: int | None) -> str:
        if needed is None:
            return (
                "a larger KV cache (--kv-cache-memory-bytes or "
                "--gpu-memory-utilization)"
            )
        return (
            f"--kv-cache-memory-bytes {needed} ({needed / GiB:.2f} GiB, or "
            f"--gpu-memory-utilization to match)"
        )

    def cap_message(self, piecewise: bool) -> str:
        """The one line an engine logs when its full graphs are capped."""
        cap = self.max_states
        rest = (
            "run the piecewise graphs (captured as before)"
            if piecewise
            else "run without CUDA graphs"
        )
        return (
            f"vllm-hybrid: full CUDA graphs capped at {cap} sequences (of "
            f"{self.graph_rows}: capture size {self.graph_tokens}, max_num_seqs "
            f"{self.max_num_seqs}), because {self._where()}; no more run at "
            f"once, and larger batches {rest}. --max-num-seqs {cap} matches "
            f"the scheduler to it; {self._memory_option(self.needed_arena_bytes)} "
            f"gives all {self.graph_rows} sequences a full graph."
        )

    def message(self) -> str:
        """Why a KV cache that holds no request's state cannot start."""
        needed = self.bytes_for(1)
        raise_it = (
            "Give the KV cache more memory (--kv-cache-memory-bytes or "
            "--gpu-memory-utilization)"
            if needed is None
            else f"Raise --kv-cache-memory-bytes to at least {needed} "
            f"({needed / GiB:.2f} GiB; or --gpu-memory-utilization to match)"
        )
        return (
            f"vllm-hybrid: full CUDA graphs need at least one request's "
            f"recurrent state, but {self._where()}. {raise_it}, or run without "
            f"CUDA graphs (--enforce-eager)."
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


def _with_graph(
    room: StateRoom,
    mode: CUDAGraphMode,
    capture_sizes: list[int],
    max_num_seqs: int,
    query_len: int,
) -> FullGraphStates:
    tokens, rows = largest_full_graph(mode, capture_sizes, max_num_seqs, query_len)
    return FullGraphStates(
        **dataclasses.asdict(room),
        max_num_seqs=max_num_seqs,
        graph_tokens=tokens,
        graph_rows=rows,
        decode_query_len=query_len,
    )


def full_graph_states(
    config: PooledKVCacheConfig,
    mode: CUDAGraphMode,
    capture_sizes: list[int],
    max_num_seqs: int,
    query_len: int = 1,
) -> FullGraphStates:
    """The largest full graph of ``mode`` against ``config``'s state pool."""
    room = pooled_state_room(config)
    return _with_graph(room, mode, capture_sizes, max_num_seqs, query_len)


def single_pool_graph_states(
    config: KVCacheConfig,
    mode: CUDAGraphMode,
    capture_sizes: list[int],
    max_num_seqs: int,
    query_len: int = 1,
) -> FullGraphStates:
    """The largest full graph of ``mode`` against upstream's shared pool.

    Like upstream's check, the count reads only ``num_blocks`` of ``config``
    (:func:`~vllm_hybrid.v1.core.pooled.capacity.shared_pool_state_room`)."""
    room = shared_pool_state_room(config)
    return _with_graph(room, mode, capture_sizes, max_num_seqs, query_len)


# ---------------------------------------------------------------------------
# The cap, from the resolution to the dispatcher
# ---------------------------------------------------------------------------

#: id(CompilationConfig) -> sequences its full graphs are capped at. The
#: runner resolves the mode and then builds its dispatcher's keys from the
#: same CompilationConfig, in the same process, one right after the other.
_ROW_CAPS: dict[int, int] = {}


def full_graph_row_cap(compilation_config: CompilationConfig) -> int | None:
    """The cap recorded for this config's full graphs, if any."""
    return _ROW_CAPS.get(id(compilation_config))


def size_full_graphs(
    compilation_config: CompilationConfig,
    states: FullGraphStates,
    mode: CUDAGraphMode,
) -> None:
    """Record the cap ``states`` calls for (or none) and say so once;
    refuse only a KV cache without one request's state."""
    _ROW_CAPS.pop(id(compilation_config), None)
    if states.graph_rows == 0:
        return
    if states.max_states < 1:
        raise ValueError(states.message())
    cap = states.row_cap
    if cap is not None:
        _ROW_CAPS[id(compilation_config)] = cap
        piecewise = mode.mixed_mode() == CUDAGraphMode.PIECEWISE
        logger.info_once(states.cap_message(piecewise))
    elif states.max_num_seqs > states.max_states:
        logger.info_once(
            "vllm-hybrid: the KV cache %s holds at most %d requests' states at "
            "once, so at most %d of max_num_seqs %d run concurrently; full "
            "CUDA graphs (up to %d sequences) fit",
            states.holder,
            states.max_states,
            states.max_states,
            states.max_num_seqs,
            states.graph_rows,
        )


def resolve_cudagraph_mode_and_sizes(
    self: CompilationConfig,
    min_cg_support: AttentionCGSupport,
    min_cg_attn_backend: str | None,
    uniform_decode_query_len: int = 1,
    use_v2_model_runner: bool = False,
    kv_cache_config: KVCacheConfig | None = None,
    max_num_reqs: int | None = None,
    is_profiling: bool = False,
    piecewise_capture_available: bool = True,
) -> CUDAGraphMode:
    """Upstream's resolution without its refusal for state blocks; the full
    graphs are sized to the states instead (upstream reads
    ``kv_cache_config`` for that check only, so it gets None)."""
    mode = upstream_of(__name__, "resolve_cudagraph_mode_and_sizes")(
        self,
        min_cg_support,
        min_cg_attn_backend,
        uniform_decode_query_len,
        use_v2_model_runner,
        kv_cache_config=None,
        max_num_reqs=max_num_reqs,
        is_profiling=is_profiling,
        piecewise_capture_available=piecewise_capture_available,
    )
    _ROW_CAPS.pop(id(self), None)
    if (
        kv_cache_config is None
        or max_num_reqs is None
        or is_profiling
        or not mode.has_full_cudagraphs()
    ):
        return mode
    sizes = list(self.cudagraph_capture_sizes or [])
    args = (mode, sizes, max_num_reqs, uniform_decode_query_len)
    if isinstance(kv_cache_config, PooledKVCacheConfig):
        size_full_graphs(self, full_graph_states(kv_cache_config, *args), mode)
    elif kv_cache_config.has_mamba_layers:
        size_full_graphs(self, single_pool_graph_states(kv_cache_config, *args), mode)
    return mode


def initialize_cudagraph_keys(
    self: CudagraphDispatcher,
    cudagraph_mode: CUDAGraphMode,
    uniform_decode_query_len: int = 1,
) -> None:
    """Upstream's keys, without the full graphs above the recorded cap.

    A batch that would have used a dropped key finds no full graph and runs
    the piecewise graph of its size (or no graph in FULL-only mode).
    """
    upstream_of(__name__, "initialize_cudagraph_keys")(
        self, cudagraph_mode, uniform_decode_query_len
    )
    cap = full_graph_row_cap(self.compilation_config)
    if cap is None:
        return
    full = self.cudagraph_keys[CUDAGraphMode.FULL]
    full -= {key for key in full if key.num_reqs is not None and key.num_reqs > cap}


def init_candidates(self: CudaGraphManager) -> None:
    """Model Runner V2's graph descriptors, without the full graphs above
    the recorded cap.

    V2's ``CudaGraphManager`` keeps what it captures (per mode) and, per
    token count, the descriptors a batch may run, full ones first; with the
    full ones above the cap gone, such a batch finds its piecewise graph
    (or none in FULL-only mode), as with the V1 dispatcher's keys.
    """
    from vllm.config.compilation import CUDAGraphMode

    upstream_of(__name__, "init_candidates")(self)
    cap = full_graph_row_cap(self.compilation_config)
    if cap is None:
        return

    def kept(desc: BatchExecutionDescriptor) -> bool:
        return not (
            desc.cg_mode == CUDAGraphMode.FULL
            and desc.num_reqs is not None
            and desc.num_reqs > cap
        )

    for mode, descs in self._capture_descs.items():
        self._capture_descs[mode] = [d for d in descs if kept(d)]
    for key, descs in self._candidates.items():
        self._candidates[key] = [d for d in descs if kept(d)]
