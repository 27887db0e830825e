"""Conformance of a state kernel on pooled views against contiguous twins.

:func:`check_state_op` runs an operation (one or more upstream kernels, called
the way a model layer calls them) twice: on the typed state views a pooled
worker binds, and on :func:`~arena_views.contiguous_twin` copies of them
(each layer its own dense tensor). Both runs start from the same request
states, seeded into the pages the requests own. Then it compares

* the operation's outputs,
* each owned page as the *layout* places it (cut from the arena bytes at
  ``offset + id * block_stride + layer * layer_stride``, independent of the
  views under test) against the twin's rows,
* and counts arena bytes outside those pages that differ from the canary.

Comparing pages through the layout rather than through the views is what lets
the check see views that are wrong themselves: a view shifted by a few bytes,
a wrong block stride, a ``.contiguous()`` copy, or a wrong state id all leave
the layout's pages different from the twin's (see test_state_faults.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from math import prod

import torch
from arena_views import ArenaViews, MiB, attention_spec, build_arena, contiguous_twin
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_hybrid.v1.core.pooled.spec import PoolKind

#: ``op(states, state_ids)``: run the kernels on ``states`` (layer name ->
#: typed state tensors) for requests whose state ids are ``state_ids`` (int32,
#: 0 marks a padded row); return what the layer would output.
StateOp = Callable[[Mapping[str, tuple[torch.Tensor, ...]], torch.Tensor], torch.Tensor]

FLOORS = ("min", "initial", "max")

#: Added to a budget to make it odd: the planner rounds the arena down to 256
#: bytes, so with overlapping null blocks the state view (aligned to the
#: arena's top) then starts 256 bytes off every larger power of two.
ODD_BYTES = 259


@dataclass(frozen=True)
class Case:
    """Where the boundary sits, whether null blocks overlap owned ones, and
    whether the budget is odd."""

    overlap: bool
    floor: str
    odd_budget: bool = False

    def __str__(self) -> str:
        mode = "overlap" if self.overlap else "reserved"
        return f"{mode}-{self.floor}{'-odd' if self.odd_budget else ''}"


def case_arena(
    case: Case,
    state_spec: MambaSpec,
    *,
    arena_bytes: int = 64 * MiB,
    num_state_layers: int = 3,
) -> ArenaViews:
    """A pooled arena (Qwen3.6 attention layers next to ``state_spec`` ones)
    with its boundary at ``case.floor``."""
    arena = build_arena(
        attention_spec(state_spec.block_size),
        state_spec,
        arena_bytes=arena_bytes + (ODD_BYTES if case.odd_budget else 0),
        num_state_layers=num_state_layers,
        null_blocks_overlap=case.overlap,
    )
    layout = arena.config.layout
    floor = {
        "min": layout.min_state_floor,
        "initial": layout.initial_state_floor,
        "max": layout.max_state_floor,
    }[case.floor]
    return dataclasses.replace(arena, state_floor=floor)


def state_spec_of(arena: ArenaViews) -> MambaSpec:
    group = arena.config.pool_by_kind(PoolKind.STATE).group_ids[0]
    return arena.config.kv_cache_groups[group].kv_cache_spec


def page_start(arena: ArenaViews, layer: str, state_id: int) -> int:
    """Arena byte where the layout puts ``layer``'s page of ``state_id``."""
    tensor = next(t for t in arena.config.kv_cache_tensors if layer in t.layers)
    index = tensor.layers.index(layer)
    return tensor.offset + state_id * tensor.block_stride + index * tensor.layer_stride


def page_states(
    arena: ArenaViews, layer: str, state_id: int
) -> tuple[torch.Tensor, ...]:
    """The typed states of one page, cut from the arena bytes where the
    layout puts it (the spec's states packed in order, as upstream binds
    them)."""
    spec = state_spec_of(arena)
    data = arena.raw.view(torch.uint8)
    pos = page_start(arena, layer, state_id)
    states = []
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        size = prod(shape) * dtype.itemsize
        states.append(data[pos : pos + size].view(dtype).view(shape))
        pos += size
    return tuple(states)


def page_ranges(
    arena: ArenaViews, layers: Sequence[str], ids: Sequence[int]
) -> list[tuple[int, int]]:
    """Arena byte ranges of the pages of ``ids`` in ``layers``."""
    page = state_spec_of(arena).page_size_bytes
    return [
        (start, start + page)
        for layer in layers
        for i in ids
        for start in [page_start(arena, layer, i)]
    ]


def seed_states(arena: ArenaViews, layers: Sequence[str], ids: Sequence[int]) -> None:
    """Write request states into the owned pages, through the layout.

    Values depend on the layer's position and the request's row only (not on
    the state id), so every boundary case starts from the same states."""
    for li, layer in enumerate(layers):
        for row, sid in enumerate(ids):
            gen = torch.Generator().manual_seed(1000 * li + row)
            for state in page_states(arena, layer, sid):
                values = torch.randn(state.shape, generator=gen) * 0.5
                state.copy_(values.to(state.dtype))


@dataclass
class Conformance:
    """What :func:`check_state_op` found."""

    outputs_equal: bool
    #: (layer, state id, state index) of owned states that differ.
    page_mismatches: list[tuple[str, int, int]]
    #: Arena bytes outside the owned pages that differ from the canary.
    bytes_outside: int
    #: ... of which outside the null region too.
    bytes_outside_null_region: int

    @property
    def ok(self) -> bool:
        return (
            self.outputs_equal and not self.page_mismatches and not self.bytes_outside
        )

    def __str__(self) -> str:
        return (
            f"outputs equal: {self.outputs_equal}, page mismatches: "
            f"{self.page_mismatches[:6]}, bytes changed outside owned pages: "
            f"{self.bytes_outside} ({self.bytes_outside_null_region} outside "
            "the null region too)"
        )


def twins_of(
    states: Mapping[str, tuple[torch.Tensor, ...]], layers: Sequence[str]
) -> dict[str, tuple[torch.Tensor, ...]]:
    return {layer: tuple(contiguous_twin(t) for t in states[layer]) for layer in layers}


def check_state_op(
    arena: ArenaViews,
    op: StateOp,
    state_ids: Sequence[int],
    *,
    layers: Sequence[str] | None = None,
    pooled_states: Mapping[str, tuple[torch.Tensor, ...]] | None = None,
    pooled_ids: Sequence[int] | None = None,
) -> Conformance:
    """Run ``op`` on the pooled views and on contiguous twins; compare.

    ``state_ids`` are the rows' state ids (0 = padded row); the requests own
    the non-zero ones. ``layers`` defaults to every state layer. Fault
    injection hands the pooled run other tensors (``pooled_states``) or ids
    (``pooled_ids``); the twins are always copies of the views upstream
    binds, run with ``state_ids``."""
    layers = list(arena.state_layers if layers is None else layers)
    owned = [i for i in state_ids if i != 0]
    arena.fill_canary()
    seed_states(arena, layers, owned)
    twins = twins_of(arena.states, layers)
    pooled = arena.states if pooled_states is None else pooled_states
    ids = torch.tensor(state_ids, dtype=torch.int32, device=arena.raw.device)
    ids_p = (
        ids
        if pooled_ids is None
        else torch.tensor(pooled_ids, dtype=torch.int32, device=ids.device)
    )
    out_pooled = op({layer: pooled[layer] for layer in layers}, ids_p)
    out_twin = op(twins, ids.clone())
    mismatches = [
        (layer, sid, k)
        for layer in layers
        for sid in owned
        for k, (page, twin) in enumerate(
            zip(page_states(arena, layer, sid), twins[layer], strict=True)
        )
        if not torch.equal(page, twin[sid])
    ]
    ranges = page_ranges(arena, layers, owned)
    null_region = (0, arena.config.layout.null_region_bytes)
    return Conformance(
        outputs_equal=torch.equal(out_pooled, out_twin),
        page_mismatches=mismatches,
        bytes_outside=arena.bytes_changed_outside(ranges),
        bytes_outside_null_region=arena.bytes_changed_outside([*ranges, null_region]),
    )


def pick_ids(arena: ArenaViews, n: int, seed: int = 0) -> list[int]:
    """Up to ``n`` owned state ids (scattered, both edges first)."""
    return arena.pick(PoolKind.STATE, min(n, len(arena.state_ids)), seed=seed)
