"""Entries a pool evicted lately, and how often they are asked for again.

An eviction is a bet that the entry will not be asked for before the memory
it held serves something better. A pool that keeps the keys of the entries
it evicted for room (not their content: a *ghost* costs a dict slot) learns
when the bet was lost: a later prefix lookup asks for a ghost's key, and the
tokens between that lookup's hit and the ghost's end are what the eviction
cost it. A pool's *regret* is those tokens per eviction, lately; per byte of
the pool's block, it says how much the pool's memory was worth, and the
arena's boundary follows the pool whose memory was worth more
(:attr:`~.eviction.ArenaSplit.MISSES`). This is the adaptive cache's ghost
list (ARC) over two pools whose blocks differ in size.

Only evictions for room count (a block handed out again, or leaving in a
boundary move); entries dropped because they can no longer serve a hit
(superseded, dead) are not bets.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

#: Evictions a pool must have made lately before its regret is compared:
#: fewer say nothing about where memory is worth more.
GHOST_MIN_EVICTIONS = 32

#: Ghosts a pool keeps at most, whatever its size: a key costs about 100 B
#: of host memory, and an entry asked for again after this many later
#: evictions says little about the split now.
GHOST_MAX_KEYS = 1 << 16

#: How much higher one pool's regret must be than the other's to outweigh
#: the recency comparison of their oldest entries.
GHOST_REGRET_MARGIN = 1.5


@dataclass
class Ghosts:
    """The keys of one pool's latest evictions for room, up to ``limit``
    (oldest forgotten first), and its decayed counts of evictions and of
    ghosts asked for again."""

    limit: int
    keys: OrderedDict[Hashable, None] = field(default_factory=OrderedDict)
    #: evictions for room, ghosts asked for again and the tokens those lost
    #: their lookups, since the start
    evicted: int = 0
    asked: int = 0
    lost_tokens: int = 0
    #: evictions and lost tokens decayed by ``1 - 1 / limit`` per eviction:
    #: the pool's recent behaviour over about one pool's worth of evictions
    recent_evicted: float = 0.0
    recent_lost: float = 0.0

    def __post_init__(self) -> None:
        self.limit = min(self.limit, GHOST_MAX_KEYS)

    def note_evicted(self, key: Hashable) -> None:
        """``key``'s entry left the pool for room."""
        if self.limit <= 0:
            return
        keys = self.keys
        keys[key] = None
        keys.move_to_end(key)
        if len(keys) > self.limit:
            keys.popitem(last=False)
        self.evicted += 1
        decay = 1.0 - 1.0 / self.limit
        self.recent_evicted = self.recent_evicted * decay + 1.0
        self.recent_lost *= decay

    def forget(self, key: Hashable) -> bool:
        """Whether ``key`` was a ghost; it is one no more."""
        if key not in self.keys:
            return False
        del self.keys[key]
        return True

    def lost(self, tokens: int) -> None:
        """A lookup asked for one of this pool's ghosts and hit ``tokens``
        fewer than the ghost would have let it."""
        self.asked += 1
        self.lost_tokens += tokens
        self.recent_lost += tokens

    def regret(self) -> float | None:
        """Tokens lost per recent eviction; None before
        :data:`GHOST_MIN_EVICTIONS` recent ones (or half the pool's ghosts,
        if fewer: the decayed count never exceeds ``limit``)."""
        if self.recent_evicted < min(GHOST_MIN_EVICTIONS, self.limit / 2):
            return None
        return self.recent_lost / self.recent_evicted


def regret_favours(
    mine: Ghosts, other: Ghosts, mine_bytes: int, other_bytes: int
) -> bool | None:
    """Whether the regrets say a pool (``mine``, blocks of ``mine_bytes``)
    should take memory from the ``other``: True when its regret per byte
    exceeds the other's by :data:`GHOST_REGRET_MARGIN`, False when the
    other's exceeds its own so, None when neither (or either is not measured
    yet)."""
    a, b = mine.regret(), other.regret()
    if a is None or b is None:
        return None
    a, b = a / mine_bytes, b / other_bytes
    if a > b * GHOST_REGRET_MARGIN and a > 0:
        return True
    if b > a * GHOST_REGRET_MARGIN and b > 0:
        return False
    return None
