"""The eviction order of pooled mode as data: every module that orders free
blocks asks this one. docs/pooled-mode.md ("Eviction order") is rendered
from it by ``scripts/eviction_order.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_utils import KVCacheBlock

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

#: Prefix hits after which a cached block is protected: one can be chance, two
#: mean it is shared (benchmarks/results/bench-20261125-checkpoints-small-blocks.md).
PROTECT_AFTER_HITS = 2


class Segment(Enum):
    """A part of a pool's free queue, handed out in :data:`HAND_OUT_ORDER`."""

    #: Blocks without a prefix-cache hash, farthest from the boundary first, so
    #: that the boundary stays movable.
    CLEAN = "clean"
    #: Cached blocks, least recently freed first; in the state pool, of the
    #: :data:`STATE_EVICTION_WINDOW` oldest, those worth no more per byte than
    #: attention KV first, then the one farthest from the boundary.
    CACHED = "cached"
    #: The token pool's clean blocks among the ids next to the boundary
    #: (:data:`BOUNDARY_CLEAR_STATE_BLOCKS` state blocks' worth).
    CLEAN_AT_BOUNDARY = "clean_at_boundary"
    #: Cached blocks that served :data:`PROTECT_AFTER_HITS` hits, in an LRU of
    #: their own, so that a burst of one-off entries cannot flush them.
    PROTECTED = "protected"


#: Segments of blocks without a prefix-cache hash.
CLEAN_SEGMENTS = (Segment.CLEAN, Segment.CLEAN_AT_BOUNDARY)

#: Oldest cached state blocks among which the state pool hands out the one
#: farthest from the boundary (1: plain LRU): one handed out next to it pins it
#: (benchmarks/results/sim-20261128-admission.md).
STATE_EVICTION_WINDOW = 8

#: While the arena refuses new requests, a running state block this close to
#: the boundary moves away at its next unkept edge, or it would pin the
#: boundary for its request's life (benchmarks/results/sim-20261128-relocation.md).
RELOCATE_NEAR_BOUNDARY = 4

#: Segments in the order their blocks are handed out
#: (benchmarks/results/bench-20261125-checkpoints-small-blocks.md).
HAND_OUT_ORDER: tuple[Segment, ...] = (
    Segment.CLEAN,
    Segment.CLEAN_AT_BOUNDARY,
    Segment.CACHED,
    Segment.PROTECTED,
)

#: The order while the arena refuses new requests: token blocks next to the
#: boundary go after the cached ones, so that the state pool can grow past them
#: (benchmarks/results/sim-20261129-boundary-clear.md).
CLEARING_ORDER: tuple[Segment, ...] = (
    Segment.CLEAN,
    Segment.CACHED,
    Segment.CLEAN_AT_BOUNDARY,
    Segment.PROTECTED,
)

#: State blocks' worth of token ids in :attr:`Segment.CLEAN_AT_BOUNDARY` (0:
#: none): the size whose sweep gave the shortest first-token wait
#: (benchmarks/results/sim-20261129-boundary-clear.md).
BOUNDARY_CLEAR_STATE_BLOCKS = 16


class Entry(Enum):
    """What a caller knows about a free cached block that the LRU does not."""

    #: A freed turn-end (decode) checkpoint: serves a follow-up turn, if any.
    TURN_END = "turn_end"
    #: A freed prefill checkpoint: serves a request sharing the prefix to it.
    PREFILL = "prefill"
    #: A freed prefill checkpoint at an anchor (every few prefill checkpoints).
    PREFILL_ANCHOR = "prefill_anchor"
    #: A prompt's last prefill checkpoint that is no anchor.
    PREFILL_LAST = "prefill_last"
    #: A prompt's own checkpoint (its replay boundary), once freed.
    PROMPT = "prompt"
    #: A decode checkpoint a later edge of the same request replaced.
    SUPERSEDED = "superseded"
    #: An entry whose other half the other pool evicted (see ``coupling``).
    DEAD = "dead"


class Place(Enum):
    """Where a free block goes when its caller ranks it."""

    #: First of its segment: it only uses memory no other entry wants.
    HEAD = "head"
    #: Last of its segment, ranked like any freed block.
    TAIL = "tail"
    #: Out of the prefix cache at once: clean, handed out first.
    EVICT = "evict"


#: Where each kind of entry goes once freed: speculative ones first, so that
#: they never push out an entry asked for again; anchors stay where states are
#: scarce (benchmarks/results/sim-20261127-gpu-sizes.md).
PLACES: dict[Entry, Place] = {
    Entry.TURN_END: Place.HEAD,
    Entry.PREFILL: Place.HEAD,
    Entry.PREFILL_ANCHOR: Place.TAIL,
    Entry.PREFILL_LAST: Place.TAIL,
    Entry.PROMPT: Place.TAIL,
    Entry.SUPERSEDED: Place.EVICT,
    Entry.DEAD: Place.EVICT,
}

#: A prompt's own and last prefill checkpoints, of which traffic mostly asks
#: for one: while the rival kind served more hits lately, the key's kind goes to
#: the head (benchmarks/results/sim-20261129-prompt-end-rivals.md).
RIVALS: dict[Entry, Entry] = {
    Entry.PREFILL_LAST: Entry.PROMPT,
    Entry.PROMPT: Entry.PREFILL_LAST,
}

#: Kinds that go to the tail while they served more hits lately than the
#: value's kind: an agent's turn end is asked for after its tool has run
#: (benchmarks/results/sim-20261129-arena-split.md).
PROMOTED: dict[Entry, Entry] = {Entry.TURN_END: Entry.PREFILL}

#: Hits after which every kind's count is halved, so that a change of traffic
#: shows (benchmarks/results/sim-20261129-prompt-end-rivals.md).
RIVAL_HALF_LIFE_HITS = 512


class Reach(Enum):
    """How far into the free queues an allocation may reach."""

    #: Every free block but the protected segment's.
    SPARE_PROTECTED = "spare_protected"
    #: Every free block.
    ANY = "any"


#: Segments an allocation of each reach must leave alone.
SPARED: dict[Reach, frozenset[Segment]] = {
    Reach.SPARE_PROTECTED: frozenset({Segment.PROTECTED}),
    Reach.ANY: frozenset(),
}


@dataclass(frozen=True)
class AdmissionAttempt:
    """One way to serve a request's blocks."""

    reach: Reach
    #: A running request advances its state in the block it owns instead of
    #: taking a fresh one at a state block edge (its checkpoint is lost).
    in_place: bool = False


def worth_more_than_attention(saves: int | None, break_even: float | None) -> bool:
    """Whether a state entry that saves ``saves`` tokens of recomputation is
    worth more per byte than attention KV, of which its block's bytes hold
    ``break_even`` tokens (an attention block saves its own tokens); unknown
    on either side: not more."""
    return saves is not None and break_even is not None and saves > break_even


#: Share of the planned token blocks a recency move of the state pool leaves:
#: without it the state pool took them all and requests waited to grow
#: (benchmarks/results/sim-20261129-arena-split.md).
SPLIT_TOKEN_RESERVE = 0.5

#: The ways to serve a request, in order: an unproven checkpoint costs less than
#: a protected entry (benchmarks/results/bench-20261125-checkpoints-small-blocks.md).
ADMISSION: tuple[AdmissionAttempt, ...] = (
    AdmissionAttempt(Reach.SPARE_PROTECTED),
    AdmissionAttempt(Reach.ANY, in_place=True),
    AdmissionAttempt(Reach.ANY),
)


class EvictionPolicy:
    """One pool's state of the order (prefix hits, kinds, savings), owned by
    its free queue, which files each free block where :meth:`segment_of` says."""

    def __init__(self) -> None:
        self._hits: dict[int, int] = {}
        #: Kind of each cached block of a counted kind (RIVALS, PROMOTED).
        self._kinds: dict[int, Entry] = {}
        #: Recent prefix hits per counted kind (halved now and then).
        self.rival_hits: dict[Entry, float] = dict.fromkeys(
            (*RIVALS, *PROMOTED, *PROMOTED.values()), 0.0
        )
        #: Tokens of recomputation each ranked cached block saves.
        self._saves: dict[int, int] = {}
        #: Tokens of attention KV one block holds (the state pool's entries)
        self.break_even: float | None = None
        #: First id of :attr:`Segment.CLEAN_AT_BOUNDARY` (None: none)
        self.held_from: int | None = None

    def record_hit(self, block: KVCacheBlock) -> None:
        """A prefix hit took a reference to ``block``."""
        if block.block_hash is not None and not block.is_null:
            self._hits[block.block_id] = self._hits.get(block.block_id, 0) + 1
            kind = self._kinds.get(block.block_id)
            if kind is not None:
                self._count_rival_hit(kind)

    def _count_rival_hit(self, kind: Entry) -> None:
        hits = self.rival_hits
        hits[kind] += 1
        if sum(hits.values()) > RIVAL_HALF_LIFE_HITS:
            for k in hits:
                hits[k] /= 2

    def forget(self, block: KVCacheBlock) -> None:
        """``block`` left the prefix cache: its hits no longer count."""
        self._hits.pop(block.block_id, None)
        self._kinds.pop(block.block_id, None)
        self._saves.pop(block.block_id, None)

    def rekey(self, old: int, new: int) -> None:
        """A block moved from id ``old`` to ``new`` (:mod:`..moves`): what
        the policy knows of it follows; ``new`` held nothing cached."""
        for known in (self._hits, self._kinds, self._saves):
            if old in known:
                known[new] = known.pop(old)

    def rank(
        self, block: KVCacheBlock, entry: Entry, saves: int | None = None
    ) -> Place:
        """File a free cached block as ``entry`` (with the tokens it
        ``saves``, if known) and say where it goes."""
        if entry in self.rival_hits:
            self._kinds[block.block_id] = entry
        if saves is not None:
            self._saves[block.block_id] = saves
        over = PROMOTED.get(entry)
        if over is not None:
            hits = self.rival_hits
            return Place.TAIL if hits[entry] > hits[over] else PLACES[entry]
        rival = RIVALS.get(entry)
        if rival is None:
            return PLACES[entry]
        if self.rival_hits[rival] > self.rival_hits[entry]:
            return Place.HEAD
        return PLACES[entry]

    def worth_more(self, block_id: int) -> bool:
        """:func:`worth_more_than_attention` for a cached block."""
        return worth_more_than_attention(self._saves.get(block_id), self.break_even)

    def saves_of(self, block: KVCacheBlock) -> int | None:
        """Tokens of recomputation a cached block saves, if ranked with them."""
        return self._saves.get(block.block_id)

    def hit_counts(self) -> dict[int, int]:
        """Prefix hits per cached block id since it was cached (a copy)."""
        return dict(self._hits)

    def is_proven(self, block: KVCacheBlock) -> bool:
        """Whether a cached block served :data:`PROTECT_AFTER_HITS` hits."""
        return self._hits.get(block.block_id, 0) >= PROTECT_AFTER_HITS

    def is_held(self, block_id: int) -> bool:
        """Whether a clean block with this id is :attr:`Segment.CLEAN_AT_BOUNDARY`'s."""
        return self.held_from is not None and block_id >= self.held_from

    def segment_of(self, block: KVCacheBlock) -> Segment:
        """The segment a free block belongs in."""
        if block.block_hash is None:
            held = self.is_held(block.block_id)
            return Segment.CLEAN_AT_BOUNDARY if held else Segment.CLEAN
        return Segment.PROTECTED if self.is_proven(block) else Segment.CACHED


def rank_entry(
    pool: BlockPool, block: KVCacheBlock, entry: Entry, saves: int | None = None
) -> None:
    """Put a free cached block of ``pool`` where :data:`PLACES` says, in an
    arena pool's segments or in upstream's single pool's one list."""
    # a getattr, not an isinstance check on a protocol: runs at every edge
    ranks = getattr(pool, "rank_entry", None)
    if ranks is not None:
        ranks(block, entry, saves)
        return
    place = PLACES[entry]
    if place is Place.EVICT:
        pool.evict_blocks({block.block_id})
        return
    queue = pool.free_block_queue
    queue.remove(block)
    if place is Place.HEAD:
        queue.prepend_n([block])
    else:
        queue.append_n([block])
