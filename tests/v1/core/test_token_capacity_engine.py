"""Engine-level check of the token capacity.

Starts vLLM in-process on tiny random-weight models with the overlay active and
pooled mode off (one shared block pool, as upstream) and reads the capacity the
engine core stored and logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from engine_utils import engine_core, full_collect

from vllm_hybrid.patches import registry

pytestmark = pytest.mark.slow

KV_CACHE_BYTES = 48 * 2**20
MAX_MODEL_LEN = 4096
UPSTREAM = "vllm.v1.core.kv_cache_utils"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@dataclass
class Engine:
    llm: object
    #: "KV cache size" lines logged by the overlay and by upstream.
    overlay_lines: list[str] = field(default_factory=list)
    upstream_lines: list[str] = field(default_factory=list)

    @property
    def core(self):
        return engine_core(self.llm)

    @property
    def kv_cache_config(self):
        return self.core.scheduler.kv_cache_manager.kv_cache_config

    @property
    def vllm_config(self):
        return self.core.vllm_config


def _start_engine(model: Path) -> Iterator[Engine]:
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("VLLM_HYBRID_KV", "1")
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.logger import _print_info_once

    from vllm_hybrid import plugin

    # vLLM calls register() itself, once per process; earlier tests in this
    # process may have reverted the patches since, so start from a clean slate.
    plugin.deactivate()
    plugin.register()
    state = plugin.state()
    assert state is not None and state.active

    # register() has applied vLLM's logging configuration, which resets the
    # handlers of every logger below "vllm"; attach ours after it.
    overlay, upstream = _Records(), _Records()
    loggers = {
        logging.getLogger("vllm.hybrid.v1.core.kv_cache_utils"): overlay,
        logging.getLogger(UPSTREAM): upstream,
    }
    levels = {logger: logger.level for logger in loggers}
    for logger, handler in loggers.items():
        logger.addHandler(handler)
        # INFO even if an earlier test left vLLM's logging at WARNING
        logger.setLevel(logging.INFO)
    # The capacity line is logged with info_once; an identical line from an
    # earlier engine in this process would otherwise be swallowed.
    _print_info_once.cache_clear()
    llm = None
    try:
        llm = LLM(
            model=str(model),
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            enforce_eager=True,
            seed=0,
            # The shared single pool is what this test measures; pooled mode
            # (per-kind pools, another issue) is kept out explicitly.
            additional_config={"hybrid_kv": {"pooled": False}},
        )
        yield Engine(
            llm,
            [line for line in overlay.lines if "KV cache size" in line],
            [line for line in upstream.lines if "KV cache size" in line],
        )
    finally:
        for logger, handler in loggers.items():
            logger.removeHandler(handler)
            logger.setLevel(levels[logger])
        # The overlay stays active, as vLLM leaves it for the rest of a process.
        del llm
        full_collect()
        cleanup_dist_env_and_memory()
        monkeypatch.undo()


@pytest.fixture(scope="module")
def hybrid_engine(tiny_model_dir: Callable[[str], Path]) -> Iterator[Engine]:
    yield from _start_engine(tiny_model_dir("qwen3_5"))


@pytest.fixture(scope="module")
def dense_engine(tiny_model_dir: Callable[[str], Path]) -> Iterator[Engine]:
    yield from _start_engine(tiny_model_dir("dense"))


def test_overlay_is_active(hybrid_engine: Engine) -> None:
    import vllm.v1.engine.core as engine_core

    from vllm_hybrid.v1.core import kv_cache_utils

    assert engine_core.update_kv_cache_capacity is (
        kv_cache_utils.update_kv_cache_capacity
    )


def test_hybrid_capacity_is_token_group_blocks_times_block_size(
    hybrid_engine: Engine,
) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    config = hybrid_engine.kv_cache_config
    cache = hybrid_engine.vllm_config.cache_config
    specs = [g.kv_cache_spec for g in config.kv_cache_groups]
    token_specs = [s for s in specs if isinstance(s, FullAttentionSpec)]
    state_specs = [s for s in specs if isinstance(s, MambaSpec)]
    # 2 attention + 6 GDN layers: 1 attention group and 3 state groups.
    assert (len(token_specs), len(state_specs)) == (1, 3)
    assert cache.mamba_cache_mode == "align"
    assert cache.num_gpu_blocks == config.num_blocks
    block_size = token_specs[0].block_size
    assert block_size == cache.block_size

    # Align mode: a running request holds up to 2 blocks in each state group.
    state_blocks = 2 * len(state_specs)
    token_group_blocks = (config.num_blocks - 1 - state_blocks) // len(token_specs)
    assert cache.kv_cache_size_tokens == token_group_blocks * block_size
    # All groups alias one allocation: a block id costs one page per layer of
    # a group (2 layers each), and the budget is split into such blocks.
    bytes_per_block = max(
        len(g.layer_names) * g.kv_cache_spec.page_size_bytes
        for g in config.kv_cache_groups
    )
    assert config.num_blocks == KV_CACHE_BYTES // bytes_per_block

    # Upstream's figure for the same config counts state groups like attention.
    upstream_tokens, concurrency = registry.upstream(
        f"{UPSTREAM}:get_kv_cache_capacity"
    )(hybrid_engine.vllm_config, config)
    assert upstream_tokens < cache.kv_cache_size_tokens
    assert cache.kv_cache_max_concurrency == pytest.approx(concurrency)


def test_hybrid_capacity_log_line_says_token_groups(hybrid_engine: Engine) -> None:
    cache = hybrid_engine.vllm_config.cache_config
    assert hybrid_engine.upstream_lines == []
    assert len(hybrid_engine.overlay_lines) == 1
    line = hybrid_engine.overlay_lines[0]
    assert f"KV cache size: {cache.kv_cache_size_tokens:,} tokens" in line
    assert "counting only the 1 of 4 KV cache groups" in line
    assert "whose memory grows with sequence length" in line
    assert "hold 6 block(s) per request" in line


def test_hybrid_engine_generates(hybrid_engine: Engine) -> None:
    from vllm import SamplingParams

    outputs = hybrid_engine.llm.generate(
        ["hello world"], SamplingParams(max_tokens=8, temperature=0)
    )
    assert len(outputs[0].outputs[0].token_ids) == 8


def test_dense_capacity_is_upstreams(dense_engine: Engine) -> None:
    config = dense_engine.kv_cache_config
    cache = dense_engine.vllm_config.cache_config
    assert len(config.kv_cache_groups) == 1
    expected = registry.upstream(f"{UPSTREAM}:get_kv_cache_capacity")(
        dense_engine.vllm_config, config
    )
    assert (cache.kv_cache_size_tokens, cache.kv_cache_max_concurrency) == expected
    assert dense_engine.overlay_lines == []
    assert len(dense_engine.upstream_lines) == 1
    assert (
        f"KV cache size: {cache.kv_cache_size_tokens:,} tokens"
        in (dense_engine.upstream_lines[0])
    )
