"""Per-pool usage of the pooled KV arena, and its way from engine core to frontend.

:meth:`~.arena.KVArena.usage` takes an :class:`ArenaUsage` snapshot; the
pooled schedulers publish one per step from their stats path
(``make_stats``), and ``/metrics`` and the benchmarks read the same type.

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
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass

from vllm_hybrid.envs import STATS_DIR_VAR


@dataclass(frozen=True)
class PoolUsage:
    """One pool of the arena: what it owns now and how much of it is used."""

    pool: str
    page_bytes: int
    owned_blocks: int
    used_blocks: int

    @property
    def usage(self) -> float:
        return self.used_blocks / self.owned_blocks if self.owned_blocks else 0.0

    @property
    def owned_bytes(self) -> int:
        return self.owned_blocks * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.page_bytes


@dataclass(frozen=True)
class ArenaUsage:
    """Usage of every pool of one engine's arena, plus the boundary."""

    arena_bytes: int
    boundary_bytes: int
    pools: tuple[PoolUsage, ...]

    @property
    def usage(self) -> float:
        """Bytes used by both pools over the arena's bytes."""
        used = sum(p.used_bytes for p in self.pools)
        return used / self.arena_bytes if self.arena_bytes else 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ArenaUsage:
        raw = json.loads(text)
        pools = tuple(PoolUsage(**p) for p in raw["pools"])
        return cls(raw["arena_bytes"], raw["boundary_bytes"], pools)


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
        text = usage.to_json()
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
            return ArenaUsage.from_json(f.read())
    except (OSError, ValueError, KeyError, TypeError):
        return None
