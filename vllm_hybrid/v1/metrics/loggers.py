"""Prometheus gauges for the pools of pooled mode (``/metrics``).

Registered through vLLM's ``vllm.stat_logger_plugins`` entry point, so every
``AsyncLLM`` (``vllm serve``) constructs one per engine next to vLLM's own
loggers. vLLM keeps reporting ``vllm:kv_cache_usage_perc`` for the token pool
(the memory that grows with sequence length); these gauges add each pool and
the arena as a whole:

- ``vllm_hybrid:kv_pool_usage_perc{pool}``: used / owned blocks of the pool.
- ``vllm_hybrid:kv_pool_used_bytes{pool}``, ``vllm_hybrid:kv_pool_owned_bytes{pool}``:
  the owned bytes move with the boundary between the pools.
- ``vllm_hybrid:kv_arena_usage_perc``: bytes used by both pools / arena bytes.

Engines that run upstream's single pool (non-hybrid models, features outside
pooled mode's scope, the overlay switched off) publish nothing, and the gauges
have no samples.
"""

from __future__ import annotations

import atexit
import os
import shutil
from typing import TYPE_CHECKING, Any

from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_hybrid.logger import init_logger
from vllm_hybrid.v1.core.pooled.usage import ArenaUsage
from vllm_hybrid.v1.metrics.pool_snapshots import (
    read_snapshot,
    snapshot_path,
    stats_dir,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.metrics.stats import (
        IterationStats,
        MultiModalCacheStats,
        SchedulerStats,
    )

logger = init_logger(__name__)

_LABELS = ("model_name", "engine")
_GAUGES: dict[str, Any] = {}


def _gauges() -> dict[str, Any]:
    """Gauges are process-wide: prometheus_client refuses a second registration
    of a name, and tests build several servers in one process."""
    if _GAUGES:
        return _GAUGES
    from prometheus_client import Gauge

    def gauge(name: str, doc: str, labels: tuple[str, ...]) -> Any:
        return Gauge(name, doc, labelnames=labels, multiprocess_mode="mostrecent")

    _GAUGES.update(
        pool_usage=gauge(
            "vllm_hybrid:kv_pool_usage_perc",
            "Used share of the blocks a KV pool owns (1 = 100 percent).",
            (*_LABELS, "pool"),
        ),
        pool_used=gauge(
            "vllm_hybrid:kv_pool_used_bytes",
            "Bytes of a KV pool held by requests or the prefix cache in use.",
            (*_LABELS, "pool"),
        ),
        pool_owned=gauge(
            "vllm_hybrid:kv_pool_owned_bytes",
            "Bytes a KV pool owns now; moves with the arena boundary.",
            (*_LABELS, "pool"),
        ),
        arena_usage=gauge(
            "vllm_hybrid:kv_arena_usage_perc",
            "Bytes used by all KV pools over the arena's bytes (1 = 100 percent).",
            _LABELS,
        ),
    )
    return _GAUGES


_REMOVE_AT_EXIT: set[str] = set()


def _remove_at_exit(directory: str) -> None:
    """The frontend owns the snapshot directory; it goes when the frontend does."""
    if directory not in _REMOVE_AT_EXIT:
        _REMOVE_AT_EXIT.add(directory)
        atexit.register(shutil.rmtree, directory, True)


def _overlay_active() -> bool:
    from vllm_hybrid.patches.registry import applied

    return bool(applied())


class HybridPoolStatLogger(StatLoggerBase):
    """Per-engine stat logger that turns pool snapshots into gauges."""

    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.enabled = _overlay_active()
        self.model_name = (
            vllm_config.model_config.served_model_name
            if vllm_config.model_config is not None
            else ""
        )
        if isinstance(self.model_name, list):
            self.model_name = self.model_name[0]
        self.directory = stats_dir()
        self._last_mtime: float | None = None
        self.last: ArenaUsage | None = None
        if not self.enabled:
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
            _remove_at_exit(self.directory)
        except OSError as err:
            logger.warning(
                "Per-pool KV metrics disabled: cannot create %s (%s)",
                self.directory,
                err,
            )
            self.enabled = False

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        if self.enabled and scheduler_stats is not None:
            self.refresh()

    def log_engine_initialized(self) -> None:
        if self.enabled:
            self.refresh()

    def refresh(self) -> ArenaUsage | None:
        """Read the engine's snapshot if it changed and set the gauges."""
        path = snapshot_path(self.directory, self.engine_index)
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError:
            return self.last
        if mtime == self._last_mtime:
            return self.last
        usage = read_snapshot(self.directory, self.engine_index)
        if usage is None:
            return self.last
        self._last_mtime = mtime
        self.last = usage
        self._set(usage)
        return usage

    def _set(self, usage: ArenaUsage) -> None:
        g = _gauges()
        labels = (str(self.model_name), str(self.engine_index))
        for pool in usage.pools:
            g["pool_usage"].labels(*labels, pool.pool).set(pool.usage)
            g["pool_used"].labels(*labels, pool.pool).set(pool.used_bytes)
            g["pool_owned"].labels(*labels, pool.pool).set(pool.owned_bytes)
        g["arena_usage"].labels(*labels).set(usage.usage)
