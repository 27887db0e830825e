"""Per-pool usage snapshots of the arena, and the hook their publisher is
installed in: the core hands values over and writes no file (the metrics
side installs the transport; docs/pooled-mode.md, "Metrics").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


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


#: Takes one engine's snapshot each step.
UsagePublisher = Callable[[ArenaUsage], object]
#: Makes the publisher of the engine with the given index.
UsagePublisherFactory = Callable[[int], UsagePublisher]

_publisher_factory: UsagePublisherFactory | None = None


def set_usage_publisher(factory: UsagePublisherFactory | None) -> None:
    """Install where the pooled schedulers hand their snapshots (None:
    nowhere); the plugin does, in every process it activates."""
    global _publisher_factory
    _publisher_factory = factory


def usage_publisher(engine_index: int) -> UsagePublisher | None:
    """The publisher of engine ``engine_index``; None when none is installed."""
    if _publisher_factory is None:
        return None
    return _publisher_factory(engine_index)
