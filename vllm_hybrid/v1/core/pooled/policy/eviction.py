"""The eviction order of pooled mode, in one place.

Every decision about which free block is handed out (and so evicted) next
lives here; the free queues, retention, coupling, the boundary and the
coordinator ask this module instead of reordering queues themselves.

Hand-out order of one pool's free blocks, first to last (:data:`HAND_OUT_ORDER`):

1. ``CLEAN``: blocks without a prefix-cache hash, farthest from the arena's
   boundary first (token pool: lowest id, state pool: highest id), so blocks
   next to the boundary stay free and the boundary stays movable (while the
   arena refuses requests, the token pool's next to it go after the cached
   ones: :data:`CLEARING_ORDER`);
2. ``CACHED``: evictable cached blocks, least recently freed first, as
   upstream does, except that in the state pool, of the
   :data:`STATE_EVICTION_WINDOW` least recently freed, entries worth no more
   per byte than attention KV (:func:`worth_more_than_attention`) go
   first, then the one farthest from the boundary; a freed turn-end
   (decode) or prefill checkpoint goes to the head of its segment
   (:data:`PLACES`), so it only uses memory no other entry wants (entries
   filed at the head go before the rest, the window applying among them);
   of a prompt's own and its last prefill checkpoint, the kind that served
   fewer hits lately goes there too (:data:`RIVALS`);
3. ``PROTECTED``: cached blocks that served :data:`PROTECT_AFTER_HITS` prefix
   hits since they were cached (a shared system prompt, a conversation that
   was followed up), in their own LRU: a burst of one-off entries cannot
   flush them (a segmented LRU).

Entries that can no longer serve any hit are evicted when they are found
(:data:`PLACES`): a superseded decode checkpoint (retention) and a *dead*
entry, whose other half the other pool has evicted (coupling, which says
what dead means). Evicted, they are clean and handed out first.

Admission (:data:`ADMISSION`): a request is first served without reaching
into the protected segment (the boundary may move for that); then a running
request may cross its state block edge in place, losing a checkpoint that has
served no hit yet; only then may a protected entry go.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from vllm.v1.core.kv_cache_utils import KVCacheBlock

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

#: Prefix hits after which a cached block joins its free queue's protected
#: segment. One hit can be chance (a retried request); two mean the entry is
#: shared or followed up.
PROTECT_AFTER_HITS = 2


class Segment(Enum):
    """A part of a pool's free queue; see :data:`HAND_OUT_ORDER`."""

    CLEAN = "clean"
    CACHED = "cached"
    #: The token pool's clean blocks next to the boundary
    #: (:data:`BOUNDARY_CLEAR_STATE_BLOCKS`)
    CLEAN_AT_BOUNDARY = "clean_at_boundary"
    PROTECTED = "protected"


#: Segments of blocks without a prefix-cache hash.
CLEAN_SEGMENTS = (Segment.CLEAN, Segment.CLEAN_AT_BOUNDARY)


#: Least recently freed cached blocks of the state pool among which it hands
#: out the one farthest from the arena's boundary (1: plain LRU). A state
#: block handed out next to the boundary pins it until its request ends
#: (docs/pooled-mode.md, "The boundary"). The token pool keeps plain
#: LRU: upstream frees a request's blocks last block first, so a cached
#: prefix is evicted from its end; picking by position would orphan it.
STATE_EVICTION_WINDOW = 8

#: A running request's state block among this many ids above the state
#: pool's lowest (next to the arena's boundary) moves to a fresh block, at the
#: price of one state copy, at its next state block edge that no checkpoint
#: keeps, while the arena refuses requests that hold no blocks yet; 0: never.
#: Decode advances a state in place at such edges, so without a move a
#: request keeps one block for its whole life and, next to the boundary,
#: stops the token pool from growing (docs/pooled-mode.md, "The boundary").
RELOCATE_NEAR_BOUNDARY = 4

#: Segments in the order their blocks are handed out.
HAND_OUT_ORDER: tuple[Segment, ...] = (
    Segment.CLEAN,
    Segment.CLEAN_AT_BOUNDARY,
    Segment.CACHED,
    Segment.PROTECTED,
)

#: The order while the arena refuses requests that hold no blocks yet: the
#: token pool's clean blocks next to the boundary go after its unprotected
#: cached ones, so that the state pool can grow past them (a token block
#: handed out there stays live as long as its request;
#: benchmarks/results/sim-20261129-boundary-clear.md).
CLEARING_ORDER: tuple[Segment, ...] = (
    Segment.CLEAN,
    Segment.CACHED,
    Segment.CLEAN_AT_BOUNDARY,
    Segment.PROTECTED,
)

#: State blocks' worth of token ids next to the boundary in
#: :attr:`Segment.CLEAN_AT_BOUNDARY` (0: none).
BOUNDARY_CLEAR_STATE_BLOCKS = 16


class Entry(Enum):
    """What a caller knows about a free cached block that the LRU does not."""

    #: A freed turn-end (decode) checkpoint: serves a follow-up turn, if any.
    TURN_END = "turn_end"
    #: A freed prefill checkpoint: serves a later request sharing the prefix
    #: up to it, if any (see ``positions``).
    PREFILL = "prefill"
    #: A freed prefill checkpoint at an anchor (see ``positions``).
    PREFILL_ANCHOR = "prefill_anchor"
    #: A prompt's last prefill checkpoint that is no anchor: the state page
    #: edge before the prompt's end, where upstream's single pool keeps one.
    PREFILL_LAST = "prefill_last"
    #: A prompt's own checkpoint (its replay boundary, the last block edge
    #: before its end), once freed.
    PROMPT = "prompt"
    #: A decode checkpoint a later edge of the same request replaced.
    SUPERSEDED = "superseded"
    #: An entry the other pool made useless (see ``coupling``).
    DEAD = "dead"


class Place(Enum):
    """Where a free block goes when its caller ranks it."""

    #: First of its segment.
    HEAD = "head"
    #: Last of its segment.
    TAIL = "tail"
    #: Out of the prefix cache: clean, handed out first.
    EVICT = "evict"


#: Where each kind of entry goes. A turn end goes to the head: ranked like
#: any freed block it would be newer than the prompt checkpoints retired
#: before it, which a full pool would evict first for an answer nobody may
#: follow up on. A prefill checkpoint is as speculative: kept like any entry,
#: a long prompt's checkpoints push a repeated prompt's own out. An anchor,
#: every few prefill checkpoints, is kept like any entry. The measurements
#: are in docs/pooled-mode.md ("Turn-end checkpoints", "Prefill checkpoints").
PLACES: dict[Entry, Place] = {
    Entry.TURN_END: Place.HEAD,
    Entry.PREFILL: Place.HEAD,
    Entry.PREFILL_ANCHOR: Place.TAIL,
    Entry.PREFILL_LAST: Place.TAIL,
    Entry.PROMPT: Place.TAIL,
    Entry.SUPERSEDED: Place.EVICT,
    Entry.DEAD: Place.EVICT,
}


#: Kinds that compete for the LRU order by the prefix hits their entries
#: served: while the rival kind's entries served more hits lately, an entry
#: of the key's kind goes to the head of its segment instead of where
#: :data:`PLACES` says (ties, no hits yet included, keep :data:`PLACES`).
#: Near its end a prompt keeps two states for two kinds of follow-up: its
#: own checkpoint, hit by a request that repeats the whole prompt (a chat
#: turn, a retry), and its last prefill checkpoint, hit by one that shares
#: it only up to a point before its end (a document with a new question; a
#: trace recorded in fixed-size blocks, as Mooncake's 512 tokens), where
#: upstream's block keeps its state. Traffic mostly asks for one of them;
#: that one stays an ordinary entry and the other only uses memory no other
#: entry wants (the simulator at 80 GB turboquant_k8v4: Mooncake 0.98x
#: upstream's prefill tokens instead of 1.009x; the measurements are in
#: benchmarks/results/sim-20261129-prompt-end-rivals.md).
RIVALS: dict[Entry, Entry] = {
    Entry.PREFILL_LAST: Entry.PROMPT,
    Entry.PROMPT: Entry.PREFILL_LAST,
}

#: Kinds filed at the head (:data:`PLACES`) that go to the tail of their
#: segment, ranked like any entry, while their entries served more prefix
#: hits lately than the value's kind did. A coding agent's turn end is hit
#: when its tool returns; at the head, the next allocation of another task
#: took it while the tool ran (the simulator at 80 GB: 0.79x tq and 0.97x
#: bf16 of upstream-best's prefill tokens above the floor, 0.10x and 0.06x
#: ranked so). Chat conversations that cycle through more turn ends than
#: the state pool holds lose some of theirs in LRU order that the head's
#: last-in-first-out order kept (chat_server at 80 GB tq: 1.12x the prefill
#: tokens; benchmarks/results/sim-20261129-arena-split.md).
PROMOTED: dict[Entry, Entry] = {Entry.TURN_END: Entry.PREFILL}

#: Hits on the rivals' entries after which every kind's count is halved, so
#: that recent hits weigh more and a change of traffic shows.
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
    worth more per byte than attention KV, of which a state block's bytes
    hold ``break_even`` tokens.

    An attention block saves the recomputation of its own tokens, so per
    byte it is worth one token per token's KV; a state entry saves the
    tokens between the previous checkpoint its request kept (or hit) and its
    own position, in one state block. Unknown on either side: not more.
    """
    return saves is not None and break_even is not None and saves > break_even


#: Share of the token blocks the planner gave the token pool that a recency
#: move of the state pool leaves free beyond the need at hand. Clean token
#: blocks are older than any entry: without a floor the state pool took
#: them all while states were short, and running requests then waited for
#: room to grow (the simulator, reasoning-chat at 48 GB bf16: TTFT p99 17 s
#: with a share of what the token pool owns at the time, 0.30 s with this).
SPLIT_TOKEN_RESERVE = 0.5


#: The ways to serve a request, tried in this order.
ADMISSION: tuple[AdmissionAttempt, ...] = (
    AdmissionAttempt(Reach.SPARE_PROTECTED),
    AdmissionAttempt(Reach.ANY, in_place=True),
    AdmissionAttempt(Reach.ANY),
)


class EvictionPolicy:
    """The per-pool state of the order: prefix hits of each cached block.

    Owned by a pool's free queue, which files each free block in the segment
    :meth:`segment_of` names.
    """

    def __init__(self) -> None:
        self._hits: dict[int, int] = {}
        #: Kind of each cached block ranked as a kind whose hits are counted
        #: (:data:`RIVALS`, :data:`PROMOTED` and the kinds they weigh against).
        self._kinds: dict[int, Entry] = {}
        #: Recent prefix hits per counted kind (halved now and then).
        self.rival_hits: dict[Entry, float] = dict.fromkeys(
            (*RIVALS, *PROMOTED, *PROMOTED.values()), 0.0
        )
        #: Tokens of recomputation each ranked cached block saves: its
        #: position past the previous checkpoint its request kept or hit.
        self._saves: dict[int, int] = {}
        #: Tokens of attention KV one of this pool's blocks holds, when its
        #: entries are weighed against attention KV (the state pool's)
        self.break_even: float | None = None
        #: First id of the clean blocks handed out after the cached ones
        #: (:attr:`Segment.CLEAN_AT_BOUNDARY`; None: none are)
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
        """File a free cached block as ``entry``: remember a counted kind
        for its later hits and the recomputation it saves (``saves`` tokens,
        when its caller knows), and say where it goes (:data:`PLACES`,
        :data:`PROMOTED`, :data:`RIVALS`)."""
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
        """Whether the cached block ``block_id`` saves more per byte than
        attention KV (:func:`worth_more_than_attention`)."""
        return worth_more_than_attention(self._saves.get(block_id), self.break_even)

    def saves_of(self, block: KVCacheBlock) -> int | None:
        """Tokens of recomputation a cached block saves, if it was ranked
        with them (see :meth:`rank`)."""
        return self._saves.get(block.block_id)

    def hit_counts(self) -> dict[int, int]:
        """Prefix hits per cached block id since it was cached (a copy)."""
        return dict(self._hits)

    def is_proven(self, block: KVCacheBlock) -> bool:
        """Whether a cached block served :data:`PROTECT_AFTER_HITS` hits."""
        return self._hits.get(block.block_id, 0) >= PROTECT_AFTER_HITS

    def segment_of(self, block: KVCacheBlock) -> Segment:
        """The segment a free block belongs in."""
        if block.block_hash is None:
            held = self.held_from is not None and block.block_id >= self.held_from
            return Segment.CLEAN_AT_BOUNDARY if held else Segment.CLEAN
        return Segment.PROTECTED if self.is_proven(block) else Segment.CACHED


@runtime_checkable
class RanksEntries(Protocol):
    """A pool that files ranked entries itself (the arena's pools)."""

    def rank_entry(
        self, block: KVCacheBlock, entry: Entry, saves: int | None = None
    ) -> None: ...


def rank_entry(
    pool: BlockPool, block: KVCacheBlock, entry: Entry, saves: int | None = None
) -> None:
    """Put a free cached block of ``pool`` where :data:`PLACES` says.

    The arena's pools file it in their segments, with the recomputation it
    saves (``saves`` tokens); upstream's single pool (one LRU list, used with
    turn-end retention outside pooled mode) gets the same place in its one
    list.
    """
    # what isinstance(pool, RanksEntries) asks, without the protocol check's
    # cost (tens of microseconds, at every decode edge)
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
