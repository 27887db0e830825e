"""Admission: how the arena serves one allocation, decided as a value.

A request's next allocation needs new blocks in each KV cache group.
Pooled mode serves them from two pools whose boundary can move, and short of
memory a running request may cross a state block edge in the block it
already owns. :class:`Admitter` decides which, without changing anything, as
an :class:`Admission` that the allocation carries out; upstream's count
(``get_num_blocks_to_allocate``) asks the same question.

The ways, in order:

1. A request that holds no blocks yet is admitted only with the growth
   reserve free beyond its own blocks (``reserve``: the running requests'
   growth, :func:`~.policy.steps.growth_blocks`), the boundary moving for
   both if needed.
2. A running request at a state block edge nobody keeps
   (``keeps_edge`` says which are kept) advances its state in the block it
   owns: no copy, one state block fewer. Next to the boundary while the
   arena refuses new requests, it takes a fresh block farther away instead
   where the state pool has one as it stands, so that the boundary can move
   (one copy).
3. At an edge a policy keeps, the request takes a fresh block (the block it
   leaves holds the checkpoint) only where the state pool has one as it
   stands: a block held for one step is not worth a boundary move; else it
   advances in place and the checkpoint is lost.
4. Otherwise the boundary's ways (:meth:`~.boundary.ArenaBoundary.plan`):
   sparing protected entries, then advancing in place (the checkpoint is
   lost), then reaching every free block.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from types import MappingProxyType
from typing import NamedTuple

from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.request import Request

from vllm_hybrid.v1.core.pooled.arena import KVArena
from vllm_hybrid.v1.core.pooled.boundary import BoundaryPlan
from vllm_hybrid.v1.core.pooled.policy.eviction import RELOCATE_NEAR_BOUNDARY, Reach
from vllm_hybrid.v1.core.pooled.policy.steps import growth_blocks
from vllm_hybrid.v1.core.pooled.spec import PoolKind


class Way(Enum):
    """How an admission served a request when memory was short."""

    #: crossed a state block edge nobody keeps in the block it owns
    EDGE_IN_PLACE = "edges_in_place"
    #: crossed a kept edge in place: the arena had no room for a fresh block
    STATE_IN_PLACE = "state_in_place"
    #: took a fresh state block away from the boundary instead of advancing
    #: next to it while the arena refuses new requests
    RELOCATED = "relocations"


class Admission(NamedTuple):
    """What the arena does for one allocation: the new blocks of each pool,
    the boundary's plan, and the running state block of each state group
    (by index) that advances in place (a tuple: one per allocation)."""

    token_blocks: int
    state_blocks: int
    boundary: BoundaryPlan
    in_place: Mapping[int, KVCacheBlock] = MappingProxyType({})
    way: Way | None = None

    @property
    def token_blocks_taken(self) -> int:
        """Token blocks the allocation takes from those free now, the
        boundary's move counted (negative when the move gives more)."""
        return self.token_blocks - self.boundary.token_gain


#: Whether a request crossing a state block edge (tokens computed, state
#: block) must keep the state there in a block of its own.
KeepsEdge = Callable[[str, int, int], bool]


class Admitter:
    """Admission for one coordinator's managers over its arena; reads them,
    changes neither."""

    def __init__(
        self,
        arena: KVArena,
        managers: Sequence[SingleTypeKVCacheManager],
        kinds: Sequence[PoolKind],
        keeps_edge: KeepsEdge | None,
        growth: tuple[int, int, int] | None = None,
    ) -> None:
        self.arena = arena
        #: (horizon, token block, token groups) of the growth reserve; None:
        #: none (:func:`~.policy.steps.growth_reserve_geometry`)
        self.growth = growth
        self.managers = tuple(managers)
        self.kinds = tuple(kinds)
        #: None: no checkpoint policy (prefix caching off), no edge is kept
        self.keeps_edge = keeps_edge
        #: group indices of each pool
        self._token_groups = tuple(
            i for i, k in enumerate(kinds) if k is PoolKind.TOKEN
        )
        self._state_groups = tuple(
            i for i, k in enumerate(kinds) if k is PoolKind.STATE
        )
        state = self._state_groups
        self._state_block = managers[state[0]].block_size if state else None

    def admit(
        self,
        request_id: str,
        needs: Sequence[int],
        hits: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        reserve: int = 0,
    ) -> Admission | None:
        """How the arena serves ``needs`` (new blocks per group); None when
        it cannot. ``hits``: the prefix hits the allocation takes (free ones
        must stay cached); ``reserve``: token blocks to keep free beyond a
        request's own when it holds none."""
        boundary = self.arena.boundary
        if not reserve and not any(needs):
            # a step within the blocks it holds (most decode steps)
            return Admission(0, 0, BoundaryPlan(boundary.state_floor))
        need_token = sum(needs[i] for i in self._token_groups)
        need_state = sum(needs[i] for i in self._state_groups)
        if reserve:
            plan = boundary.plan(need_token + reserve, need_state, hits)
            return None if plan is None else Admission(need_token, need_state, plan)
        in_place = self._in_place_blocks(request_id, needs)
        unkept = bool(in_place) and self._unkept_edge(request_id, total_computed_tokens)
        relocated = (
            unkept and self._pins_boundary(in_place) and self._fits_as_is(0, need_state)
        )
        advanced = need_state - len(in_place)
        if unkept and not relocated:
            plan = boundary.plan(need_token, advanced, hits)
            if plan is None:
                return None
            return Admission(need_token, advanced, plan, in_place, Way.EDGE_IN_PLACE)
        if in_place and not unkept and not self._fits_as_is(need_token, need_state):
            plan = boundary.plan(need_token, advanced, hits)
            if plan is not None:
                way = Way.STATE_IN_PLACE
                return Admission(need_token, advanced, plan, in_place, way)
        plan = boundary.plan(need_token, need_state, hits, in_place=len(in_place))
        if plan is None:
            return None
        if plan.in_place:
            advanced = need_state - len(in_place)
            return Admission(need_token, advanced, plan, in_place, Way.STATE_IN_PLACE)
        way = Way.RELOCATED if relocated else None
        return Admission(need_token, need_state, plan, way=way)

    def growth_of(self, request: Request, num_tokens: int) -> int:
        """Token blocks ``request`` still grows into once it holds
        ``num_tokens`` tokens' blocks (0 without a growth reserve)."""
        if self.growth is None:
            return 0
        return growth_blocks(request, num_tokens, self.growth)

    def _fits_as_is(self, need_token: int, need_state: int) -> bool:
        """Whether both pools serve the needs where the boundary stands,
        sparing protected entries."""
        reach = Reach.SPARE_PROTECTED
        return (
            self.arena.token_pool.get_num_free_within(reach) >= need_token
            and self.arena.state_pool.get_num_free_within(reach) >= need_state
        )

    def _pins_boundary(self, in_place: Mapping[int, KVCacheBlock]) -> bool:
        """Whether a running state block the request would advance in place
        lies within :data:`~.policy.eviction.RELOCATE_NEAR_BOUNDARY` of the
        boundary while new requests are refused."""
        if not (self.arena.refusing_new and RELOCATE_NEAR_BOUNDARY):
            return False
        near = self.arena.boundary.state_floor + RELOCATE_NEAR_BOUNDARY
        return any(block.block_id < near for block in in_place.values())

    def _unkept_edge(self, request_id: str, total_computed_tokens: int) -> bool:
        """Whether the request is crossing a state block edge that no
        checkpoint policy keeps: a copy into a fresh block would leave behind
        a state nobody caches."""
        block = self._state_block
        if self.keeps_edge is None or block is None or total_computed_tokens % block:
            return False
        return not self.keeps_edge(request_id, total_computed_tokens, block)

    def _in_place_blocks(
        self, request_id: str, needs: Sequence[int]
    ) -> dict[int, KVCacheBlock]:
        """Running state block per state group, if the request may advance its
        state in place: every state group needs exactly one new block (a
        state block edge) and owns its running block alone.

        At an edge align mode copies the running state into a fresh block and
        keeps the old one (a checkpoint) until the next step: two state
        blocks per request. Advanced in place, only the checkpoint is lost.
        """
        state = self._state_groups
        if not state or any(needs[i] != 1 for i in state):
            return {}
        found: dict[int, KVCacheBlock] = {}
        for i in state:
            manager = self.managers[i]
            if (
                getattr(manager, "mamba_cache_mode", None) != "align"
                or manager.num_speculative_blocks
                or request_id not in manager._allocated_block_reqs
            ):
                return {}
            blocks = manager.req_to_blocks.get(request_id) or []
            if not blocks or blocks[-1].is_null:
                return {}
            if blocks[-1].ref_cnt != _own_slots(blocks, manager, request_id):
                return {}
            found[i] = blocks[-1]
        return found


def _own_slots(
    blocks: list[KVCacheBlock], manager: SingleTypeKVCacheManager, request_id: str
) -> int:
    """Slots of the request's block table that name its running state
    block: one, or two after it advanced in place, until upstream retires
    the slot it advanced from (the previous step may still be in flight).
    """
    last = blocks[-1]
    retiring = getattr(manager, "last_state_block_idx", {}).get(request_id)
    if retiring is not None and retiring < len(blocks) - 1:
        return 2 if blocks[retiring] is last else 1
    return 1
