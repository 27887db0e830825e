"""The full-graph cap takes what upstream's resolution takes.

Upstream's ``CompilationConfig.resolve_cudagraph_mode_and_sizes`` reads two
fields of ``kv_cache_config``, ``has_mamba_layers`` and ``num_blocks``, so
callers (vLLM's own tests, plugins) pass stand-ins with only those. The
replacement must answer them without an AttributeError: the same cap from
``num_blocks``, messages without byte figures, upstream's skip while
profiling, and upstream's answer where there is nothing to cap.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import CompilationConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backend import AttentionCGSupport

from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.v1.worker import cudagraph_capacity

NAME = "resolve_cudagraph_mode_and_sizes"
#: Capture sizes as a CUDA host would set them, up to 16 tokens; the CPU
#: platform sets none.
SIZES = [1, 2, 4, 8, 16]


def _compilation() -> CompilationConfig:
    return CompilationConfig(
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        cudagraph_capture_sizes=list(SIZES),
    )


def _resolve(fn, compilation, kv_cache_config, max_num_reqs=256, **kwargs):
    return fn(
        compilation,
        AttentionCGSupport.ALWAYS,
        "FakeAttentionBackend",
        kv_cache_config=kv_cache_config,
        max_num_reqs=max_num_reqs,
        **kwargs,
    )


def _ours(*args, **kwargs):
    return _resolve(
        cudagraph_capacity.resolve_cudagraph_mode_and_sizes, *args, **kwargs
    )


def _upstream(*args, **kwargs):
    return _resolve(upstream_of(cudagraph_capacity.__name__, NAME), *args, **kwargs)


def test_upstreams_two_fields_give_the_cap_and_a_line_without_bytes():
    """4 Mamba blocks, 256 sequences, full graphs up to 16: upstream refuses
    (the listed deviation of docs/upstream-tests.md); the overlay caps the
    full graphs at the 4 states and says so without byte figures."""
    from cuda_startup import captured
    from vllm.logger import _print_info_once

    kv = SimpleNamespace(has_mamba_layers=True, num_blocks=4)
    with pytest.raises(ValueError, match=r"max_num_seqs \(256\) exceeds available"):
        _upstream(_compilation(), kv)
    compilation = _compilation()
    _print_info_once.cache_clear()
    with captured("vllm.hybrid.v1.worker.cudagraph_capacity") as lines:
        mode = _ours(compilation, kv)
    assert mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert cudagraph_capacity.full_graph_row_cap(compilation) == 4
    assert lines == [
        "vllm-hybrid: full CUDA graphs capped at 4 sequences (of 16: capture "
        "size 16, max_num_seqs 256), because the KV cache shared pool holds at "
        "most 4 requests' states at once (4 state blocks, 1 per running "
        "request); no more run at once, and larger batches run the piecewise "
        "graphs (captured as before). --max-num-seqs 4 matches the scheduler "
        "to it; a larger KV cache (--kv-cache-memory-bytes or "
        "--gpu-memory-utilization) gives all 16 sequences a full graph."
    ]


def test_profiling_skips_the_cap_as_upstream_skips_its_check():
    kv = SimpleNamespace(has_mamba_layers=True, num_blocks=4)
    compilation = _compilation()
    assert _ours(compilation, kv, is_profiling=True) == _upstream(
        _compilation(), kv, is_profiling=True
    )
    assert cudagraph_capacity.full_graph_row_cap(compilation) is None
    assert compilation.cudagraph_capture_sizes == SIZES


@pytest.mark.parametrize(
    ("has_mamba_layers", "num_blocks"), [(False, 4), (True, 16), (True, 300)]
)
def test_nothing_to_cap_gives_upstreams_answer(has_mamba_layers, num_blocks):
    """No Mamba layers, or as many states as the largest full graph has
    rows (16) or more: no cap, upstream's mode and sizes."""
    kv = SimpleNamespace(has_mamba_layers=has_mamba_layers, num_blocks=num_blocks)
    ours, theirs = _compilation(), _compilation()
    if has_mamba_layers and num_blocks < 256:
        # upstream compares max_num_seqs (256), not the graph's 16 rows
        with pytest.raises(ValueError, match="exceeds available Mamba"):
            _upstream(theirs, kv)
        theirs = _compilation()
        assert _upstream(theirs, kv, max_num_reqs=num_blocks) == _ours(ours, kv)
    else:
        assert _upstream(theirs, kv) == _ours(ours, kv)
    assert ours.cudagraph_capture_sizes == theirs.cudagraph_capture_sizes == SIZES
    assert cudagraph_capacity.full_graph_row_cap(ours) is None


def test_no_state_at_all_is_refused_without_bytes():
    kv = SimpleNamespace(has_mamba_layers=True, num_blocks=0)
    with pytest.raises(ValueError) as refused:
        _ours(_compilation(), kv)
    assert str(refused.value) == (
        "vllm-hybrid: full CUDA graphs need at least one request's recurrent "
        "state, but the KV cache shared pool holds at most 0 requests' states "
        "at once (0 state blocks, 1 per running request). Give the KV cache "
        "more memory (--kv-cache-memory-bytes or --gpu-memory-utilization), "
        "or run without CUDA graphs (--enforce-eager)."
    )


def test_tensor_sizes_only_add_byte_figures():
    """A config with upstream's ``kv_cache_tensors`` gets the same cap, and
    the byte figures: 4 blocks in 4 x 64 MiB tensors."""
    MiB = 2**20
    tensors = [SimpleNamespace(size=256 * MiB) for _ in range(4)]
    bare = SimpleNamespace(has_mamba_layers=True, num_blocks=4)
    full = SimpleNamespace(kv_cache_tensors=tensors, **vars(bare))
    args = (CUDAGraphMode.FULL_AND_PIECEWISE, SIZES, 256)
    a = cudagraph_capacity.single_pool_graph_states(bare, *args)
    b = cudagraph_capacity.single_pool_graph_states(full, *args)
    assert (a.row_cap, b.row_cap) == (4, 4)
    assert (a.arena_bytes, a.state_block_bytes, a.needed_arena_bytes) == (
        None,
        None,
        None,
    )
    assert (b.arena_bytes, b.state_block_bytes) == (256 * MiB, 64 * MiB)
    assert b.needed_arena_bytes == 256 * MiB + 12 * 64 * MiB
    assert "of 0.25 GiB holds at most 4" in b.cap_message(piecewise=True)
    assert "--kv-cache-memory-bytes 1073741824 (1.00 GiB" in b.cap_message(True)
