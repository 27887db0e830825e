"""The way of the pools' usage from the engine core to the frontend's /metrics.

vLLM's ``SchedulerStats`` has no field a plugin can extend, and it is decoded
by type in the frontend (unknown fields are dropped), so pool usage cannot
ride along with it. Instead the engine core writes a small JSON snapshot into
a directory the frontend created, and the frontend's stat logger
(:mod:`vllm_hybrid.v1.metrics.loggers`) reads it when vLLM hands it the
scheduler stats of the same step.

The directory is named in ``VLLM_HYBRID_STATS_DIR``; the first process that
activates the overlay sets it and every child process inherits it. The engine
core only writes when the directory exists, i.e. when a frontend with the
stat logger (``vllm serve``) asked for the numbers; offline ``LLM`` runs write
nothing.

This lives on the metrics side so that the core only hands over values: the
pooled schedulers pass each step's
:class:`~vllm_hybrid.v1.core.pooled.usage.ArenaUsage` to the publisher that
:func:`install` sets in :mod:`~vllm_hybrid.v1.core.pooled.usage`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict

from vllm_hybrid.envs import STATS_DIR_VAR
from vllm_hybrid.v1.core.pooled.usage import (
    ArenaUsage,
    PoolUsage,
    UsagePublisher,
    set_usage_publisher,
)


def to_json(usage: ArenaUsage) -> str:
    return json.dumps(asdict(usage), sort_keys=True)


def from_json(text: str) -> ArenaUsage:
    raw = json.loads(text)
    pools = tuple(PoolUsage(**p) for p in raw["pools"])
    return ArenaUsage(raw["arena_bytes"], raw["boundary_bytes"], pools)


def stats_dir(environ: dict[str, str] | None = None) -> str:
    """The snapshot directory shared by a frontend and its engine cores.

    Set once per process tree: a process that finds the variable unset names
    a directory after its own pid and exports it to its children.
    """
    env = os.environ if environ is None else environ
    path = env.get(STATS_DIR_VAR)
    if not path:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(base, f"vllm-hybrid-stats-{os.getpid()}")
        env[STATS_DIR_VAR] = path
    return path


def snapshot_path(directory: str, engine_index: int) -> str:
    return os.path.join(directory, f"engine-{engine_index}.json")


class PoolStatsPublisher:
    """Engine-core side: writes a snapshot when it changed and a reader exists."""

    def __init__(self, engine_index: int = 0, directory: str | None = None) -> None:
        self.directory = directory or stats_dir()
        self.path = snapshot_path(self.directory, engine_index)
        self._last: str | None = None

    def publish(self, usage: ArenaUsage) -> bool:
        """Write ``usage`` atomically; returns whether a file was written."""
        if not os.path.isdir(self.directory):
            return False
        text = to_json(usage)
        if text == self._last:
            return False
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except OSError:
            return False
        self._last = text
        return True


def read_snapshot(directory: str, engine_index: int) -> ArenaUsage | None:
    """Frontend side: the engine's latest snapshot, or None if there is none."""
    try:
        with open(snapshot_path(directory, engine_index)) as f:
            return from_json(f.read())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _publisher(engine_index: int) -> UsagePublisher:
    return PoolStatsPublisher(engine_index).publish


def install() -> None:
    """Name the snapshot directory for this process tree and have the pooled
    schedulers of this process write their snapshots there.

    Called by the plugin in every process, before any engine process starts,
    so the frontend and its engine cores agree on the directory."""
    stats_dir()
    set_usage_publisher(_publisher)


def uninstall() -> None:
    """Stop publishing (the overlay was switched off in this process)."""
    set_usage_publisher(None)
