"""Running an attention step on pooled views and on twins, and the checker.

:class:`Setup` is one arena with its twins, requests, inputs and backend
impl; :meth:`Setup.store` and :meth:`Setup.attend` run one kernel on either
set of views; :func:`compare` turns the two runs into a :class:`Verdict`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from arena_views import DEVICE, ArenaViews
from attention_harness import (
    BF16,
    HEAD_SIZE,
    NUM_KV_HEADS,
    Batch,
    Case,
    Flavor,
    Inputs,
    Requests,
    attention_layer,
    layout_twin,
    make_impl,
    metadata,
    queries,
)

from vllm_hybrid.v1.core.pooled.spec import PoolKind

#: A view transform (identity, or a fault from attention_harness).
ViewFn = Callable[[ArenaViews, torch.Tensor], torch.Tensor]


def same_view(arena: ArenaViews, view: torch.Tensor) -> torch.Tensor:
    return view


@dataclass
class Verdict:
    """What differs between a pooled run and its twin run."""

    #: Output elements (of the rows the model consumes) that differ bitwise.
    output_mismatches: int = 0
    #: ``(layer, block id)`` of owned token pages whose bytes differ.
    pages_unequal: list[tuple[str, int]] = field(default_factory=list)
    #: Arena bytes changed outside the pages the requests own.
    bytes_outside: int = 0

    def problems(self) -> list[str]:
        found = []
        if self.output_mismatches:
            found.append(f"{self.output_mismatches} output elements differ")
        if self.pages_unequal:
            found.append(f"owned pages differ: {self.pages_unequal[:6]}")
        if self.bytes_outside:
            found.append(f"{self.bytes_outside} bytes changed outside owned pages")
        return found


@dataclass
class Setup:
    """One case's arena, twins and requests, ready for kernel runs."""

    case: Case
    arena: ArenaViews
    twins: dict[str, torch.Tensor]
    requests: Requests
    inputs: Inputs
    impl: object
    layer: object
    #: Verdict of the store step, for the tests that read after it.
    store_verdict: Verdict | None = None
    #: Twin outputs by read step, when several pooled runs compare to one.
    twin_outputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, case: Case, seq_lens: tuple[int, ...]) -> Setup:
        arena = case.build()
        layout = case.layout or case.flavor.layout()
        twins = {
            name: layout_twin(arena.views[name], layout) for name in arena.token_layers
        }
        requests = Requests.place(arena, seq_lens, seed=case.seed)
        inputs = Inputs.random(arena, requests, seed=case.seed)
        impl = make_impl(case.flavor)
        return cls(case, arena, twins, requests, inputs, impl, attention_layer())

    @property
    def flavor(self) -> Flavor:
        return self.case.flavor

    @property
    def read_layer(self) -> str:
        return self.arena.token_layers[self.case.layer]

    def views(self, pooled: bool) -> dict[str, torch.Tensor]:
        return self.arena.views if pooled else self.twins

    def store(
        self,
        batch: Batch,
        pooled: bool,
        fault: ViewFn = same_view,
        requests: Requests | None = None,
        layers: tuple[str, ...] | None = None,
    ) -> None:
        """``do_kv_cache_update`` for every attention layer (or ``layers``);
        ``requests`` overrides the slots (fault injection), not the K/V."""
        slots = batch.slot_mapping(requests or self.requests)
        for name in layers or self.arena.token_layers:
            view = fault(self.arena, self.views(pooled)[name])
            key, value = self.inputs.step_kv(name, self.requests, batch)
            self.impl.do_kv_cache_update(self.layer, key, value, view, slots)

    def attend(
        self,
        batch: Batch,
        pooled: bool,
        fault: ViewFn = same_view,
        requests: Requests | None = None,
    ) -> torch.Tensor:
        """``forward`` on the read layer; the output rows the model uses."""
        view = fault(self.arena, self.views(pooled)[self.read_layer])
        meta = metadata(self.flavor, requests or self.requests, batch)
        query = queries(self.flavor, batch, seed=self.case.seed + 1)
        key, value = self.inputs.step_kv(self.read_layer, self.requests, batch)
        heads = self.flavor.num_q_heads
        shape = (batch.num_tokens, heads, HEAD_SIZE)
        out = torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
        if self.flavor is not BF16:
            out = out.flatten(1)
        self.impl.forward(self.layer, query, key, value, view, meta, out)
        return out[: batch.real_tokens].view(batch.real_tokens, heads, HEAD_SIZE)

    def compare(
        self,
        out_pooled: torch.Tensor | None = None,
        out_twin: torch.Tensor | None = None,
    ) -> Verdict:
        return compare(self, out_pooled, out_twin)


def compare(
    setup: Setup, out_pooled: torch.Tensor | None, out_twin: torch.Tensor | None
) -> Verdict:
    """Outputs bitwise, every owned token page of every attention layer
    bytewise, and the canary outside the pages the requests own."""
    arena = setup.arena
    verdict = Verdict()
    if out_pooled is not None:
        differ = out_pooled.view(torch.int16) != out_twin.view(torch.int16)
        verdict.output_mismatches = int(differ.sum())
    owned = list(arena.token_ids)
    for name in arena.token_layers:
        pooled = page_bytes(arena.views[name][owned])
        twin = page_bytes(setup.twins[name][owned])
        rows = (pooled != twin).any(dim=1).nonzero().flatten().tolist()
        verdict.pages_unequal += [(name, owned[i]) for i in rows]
    used = arena.page_ranges(PoolKind.TOKEN, setup.requests.used_ids)
    verdict.bytes_outside = arena.bytes_changed_outside(used)
    return verdict


def page_bytes(pages: torch.Tensor) -> torch.Tensor:
    """``[n, page bytes]`` of gathered pages (logical order on both sides,
    and both sides store a page in the same physical order)."""
    return pages.contiguous().view(torch.uint8).reshape(pages.shape[0], -1)


def reference(
    setup: Setup, batch: Batch, cached: int | None = None, from_store: bool = False
) -> torch.Tensor:
    """Causal GQA attention of the batch's queries over what the cache
    holds of the inputs, in float32: what the kernels should compute (guards
    against two runs agreeing on garbage). ``cached``: TurboQuant's long
    continuation reads only that many positions from the cache and attends
    to the chunk's own K/V as they are. ``from_store`` (TurboQuant): over
    the bytes the store wrote instead, which separates a store that differs
    from the modeled format from a read that differs from attention."""
    query = queries(setup.flavor, batch, seed=setup.case.seed + 1).float().cpu()
    lengths = batch.lengths_of(setup.requests)
    starts = [0, *itertools.accumulate(batch.query_lens)]
    rows = []
    for r, (n, q) in enumerate(zip(lengths, batch.query_lens, strict=True)):
        if from_store:
            keys, values = stored_context(setup, r, n)
        else:
            keys, values = context(setup, r, n, cached)
        positions = torch.arange(n - q, n)
        visible = torch.arange(n)[None, :] <= positions[:, None]
        scores = torch.einsum("qhd,thd->hqt", query[starts[r] : starts[r + 1]], keys)
        scores = (scores * HEAD_SIZE**-0.5).masked_fill(~visible, float("-inf"))
        rows.append(torch.einsum("hqt,thd->qhd", scores.softmax(-1), values))
    return torch.cat(rows)


def context(setup: Setup, request: int, n: int, cached: int | None):
    """The first ``n`` keys and values of a request as the kernel sees them,
    repeated for each query head of a KV head."""
    keys = setup.inputs.keys[setup.read_layer][request][:n].float().cpu()
    values = setup.inputs.values[setup.read_layer][request][:n].float().cpu()
    if setup.flavor is not BF16:
        stored = n if cached is None else cached
        quantized = turboquant_k8v4(keys[:stored], values[:stored])
        keys = torch.cat([quantized[0], keys[stored:]])
        values = torch.cat([quantized[1], values[stored:]])
    group = setup.flavor.num_q_heads // NUM_KV_HEADS
    return keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)


def turboquant_k8v4(keys: torch.Tensor, values: torch.Tensor):
    """What ``turboquant_k8v4`` keeps of K and V: keys as fp8 e4m3, each
    (token, head) value vector on 16 uniform levels between its min and max,
    scale and zero stored as fp16."""
    levels, scale_zero, _ = turboquant_model(values)
    return keys.to(torch.float8_e4m3fn).float(), dequantize(levels, scale_zero)


def stored_kv_matches(setup: Setup) -> bool:
    """bf16 only: the twin holds exactly the K/V the store was given, at
    the slots of the requests (the impl's own split into K and V halves)."""
    for name, twin in setup.twins.items():
        cache = twin.transpose(1, 2)
        for r, n in enumerate(setup.requests.seq_lens):
            for pos in range(n):
                block, offset = divmod(setup.requests.slot(r, pos), cache.shape[1])
                kv = cache[block, offset]
                key, value = kv[..., :HEAD_SIZE], kv[..., HEAD_SIZE:]
                if not torch.equal(key, setup.inputs.keys[name][r][pos]):
                    return False
                if not torch.equal(value, setup.inputs.values[name][r][pos]):
                    return False
    return True


def turboquant_stored(setup: Setup, request: int, n: int):
    """A request's first ``n`` positions as the twin of the read layer holds
    them, decoded by hand from the k8v4 slot format: ``HEAD_SIZE`` fp8 key
    bytes, ``HEAD_SIZE / 2`` bytes of 4-bit value levels (low nibble first),
    then the value vector's fp16 scale and zero. Returns keys, value levels
    and ``[..., 2]`` scale and zero, in float32."""
    # the impl's own transpose: [blocks, KV heads, ...] -> [blocks, slots, ...]
    cache = setup.twins[setup.read_layer].transpose(1, 2).cpu()
    block_size = cache.shape[1]
    slots = [setup.requests.slot(request, pos) for pos in range(n)]
    rows = torch.stack([cache[s // block_size, s % block_size] for s in slots])
    keys = rows[..., :HEAD_SIZE].contiguous().view(torch.float8_e4m3fn).float()
    packed = rows[..., HEAD_SIZE : HEAD_SIZE + HEAD_SIZE // 2].long()
    levels = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).float()
    tail = HEAD_SIZE + HEAD_SIZE // 2
    scale_zero = rows[..., tail : tail + 4].contiguous().view(torch.float16).float()
    return keys, levels, scale_zero


#: How close to a rounding tie (a quotient of k + 1/2) a value's quotient
#: ``(v - min) / scale`` may be for its 4-bit level to go either way. bf16
#: inputs make exact ties common (9 to 39 of the tier cases' 10-19k value
#: elements), and compiled Triton divides in float32 without correct
#: rounding where the interpreter (numpy) rounds correctly: on an H200 the
#: store put 15 and 32 of them one level down. A few float32 ulps of a
#: quotient below 16 are under 1e-5; a wrong byte is off by far more.
TIE = 1e-5


def turboquant_model(values: torch.Tensor):
    """:func:`turboquant_k8v4`'s value levels, fp16 scale and zero, and
    where a level sits on a rounding tie (see :data:`TIE`)."""
    low = values.amin(-1, keepdim=True)
    scale = ((values.amax(-1, keepdim=True) - low) / 15).clamp_min(1e-8)
    quotient = (values - low) / scale
    levels = (quotient + 0.5).floor().clamp(0, 15)
    ties = ((quotient - quotient.floor()) - 0.5).abs() < TIE
    return levels, torch.cat([scale.half().float(), low.half().float()], -1), ties


def dequantize(levels: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """k8v4 values from their 4-bit levels and ``[..., 2]`` scale and zero."""
    return levels * scale_zero[..., :1] + scale_zero[..., 1:]


def turboquant_store_differences(setup: Setup) -> dict[str, int]:
    """How many stored key bytes, value levels, and value scales or zeros
    differ from what :func:`turboquant_k8v4` keeps of the inputs, over every
    stored position of the read layer; a level one step off on a rounding
    tie is not a difference (:data:`TIE`)."""
    differ = {"keys": 0, "levels": 0, "scale_zero": 0}
    for r, n in enumerate(setup.requests.seq_lens):
        keys, levels, scale_zero = turboquant_stored(setup, r, n)
        given_k = setup.inputs.keys[setup.read_layer][r][:n].float().cpu()
        given_v = setup.inputs.values[setup.read_layer][r][:n].float().cpu()
        model_levels, model_scale_zero, ties = turboquant_model(given_v)
        off = (levels - model_levels).abs()
        differ["keys"] += int((keys != given_k.to(torch.float8_e4m3fn).float()).sum())
        differ["levels"] += int(((off > 1) | ((off == 1) & ~ties)).sum())
        differ["scale_zero"] += int((scale_zero != model_scale_zero).sum())
    return differ


def stored_context(setup: Setup, request: int, n: int):
    """Like :func:`context`, from the bytes the store wrote (TurboQuant)."""
    keys, levels, scale_zero = turboquant_stored(setup, request, n)
    values = dequantize(levels, scale_zero)
    group = setup.flavor.num_q_heads // NUM_KV_HEADS
    return keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
