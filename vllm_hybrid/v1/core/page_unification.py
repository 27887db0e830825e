"""Page-size unification of a hybrid's single shared pool, without padding
attention.

Only models with state layers get this: every other model is planned by
upstream's function unchanged. Upstream's ``unify_kv_cache_spec_page_size``
gives up (``NotImplementedError``) or pads attention pages when a page does
not divide the largest page, which defeats quantized KV caches and forbids
the kernel-block split. Here the common page is the LCM of the attention
pages, rounded up to cover the largest page: attention blocks scale by
integers and only state pages are padded, within limits the user can raise
(:mod:`vllm_hybrid.config.hybrid_kv`). The upstream entry point that calls
this is in :mod:`vllm_hybrid.v1.core.kv_cache_utils`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from vllm_hybrid.config.hybrid_kv import (
    ADDITIONAL_CONFIG_KEY,
    MAX_PAGE_GROWTH,
    MAX_PAGE_PADDING_PCT,
    PageUnificationLimits,
)
from vllm_hybrid.logger import init_logger

logger = init_logger(__name__)


class PageSizeUnificationError(NotImplementedError):
    """The KV cache pages of a model cannot share one page size.

    A ``NotImplementedError`` on purpose: upstream's ``get_kv_cache_groups``
    catches that type to try its full-allocation fallback for MLA next to
    sliding-window layers before it gives up with this message.
    """


def _is_state_spec(spec: KVCacheSpec) -> bool:
    """Whether the page holds a per-request state, whose size no block changes.

    Only these pages are padded: a padded attention page cannot be split into
    kernel blocks and wastes bytes in proportion to the tokens cached.
    """
    return isinstance(spec, MambaSpec)


def _with_page(
    spec: KVCacheSpec, changes: Mapping[str, int], page_size: int
) -> KVCacheSpec | None:
    """``replace(spec, **changes)`` if its page is exactly ``page_size`` bytes."""
    try:
        changed = replace(spec, **changes)
        return changed if changed.page_size_bytes == page_size else None
    except (AssertionError, ValueError, TypeError):
        return None


def _scaled_spec(spec: KVCacheSpec, ratio: int) -> KVCacheSpec | None:
    """``spec`` with ``ratio`` times the tokens per block and page bytes.

    Tries the plain block size change first (what upstream does when pages
    divide), then also scales an explicit ``page_size_padded``. Returns None
    when neither gives exactly ``ratio`` times the page, i.e. the page does not
    grow with the block size.
    """
    if ratio == 1:
        return spec
    target = spec.page_size_bytes * ratio
    block_size = spec.block_size * ratio
    scaled = _with_page(spec, {"block_size": block_size}, target)
    padded = getattr(spec, "page_size_padded", None)
    if scaled is None and padded is not None:
        changes = {"block_size": block_size, "page_size_padded": padded * ratio}
        scaled = _with_page(spec, changes, target)
    return scaled


def _upstream_gives_up(kv_cache_spec: Mapping[str, KVCacheSpec]) -> bool:
    """Whether upstream's unification raises: a page that neither divides
    the largest page nor may be padded (MLA and non-attention pages)."""
    largest = max(spec.page_size_bytes for spec in kv_cache_spec.values())
    return any(
        spec.page_size_bytes != largest
        and not isinstance(spec, MambaSpec)
        and largest % spec.page_size_bytes != 0
        and (not isinstance(spec, AttentionSpec) or isinstance(spec, MLAAttentionSpec))
        for spec in kv_cache_spec.values()
    )


def _upstream_falls_back(kv_cache_spec: Mapping[str, KVCacheSpec]) -> bool:
    """Whether upstream's grouping has an answer when its unification gives
    up: MLA next to regular sliding-window layers get one full-allocation
    group (sliding windows allocated as full attention, compute unchanged).
    That keeps MLA's block size, which LCM scaling would multiply."""
    specs = list(kv_cache_spec.values())
    if any(
        isinstance(s, SlidingWindowMLASpec | ChunkedLocalAttentionSpec) for s in specs
    ):
        return False
    return any(isinstance(s, MLAAttentionSpec) for s in specs) and any(
        isinstance(s, SlidingWindowSpec) for s in specs
    )


def _upstream_unifies(kv_cache_spec: Mapping[str, KVCacheSpec]) -> bool:
    """Whether upstream's unification succeeds by block scaling alone.

    True when every page is the largest, a state page (padded to the largest)
    or a divisor of the largest whose block size scales to it. Upstream's
    result is then kept unchanged.
    """
    largest = max(spec.page_size_bytes for spec in kv_cache_spec.values())
    for spec in kv_cache_spec.values():
        page = spec.page_size_bytes
        if page == largest or _is_state_spec(spec):
            continue
        if largest % page != 0:
            return False
        scaled_block = {"block_size": spec.block_size * (largest // page)}
        if _with_page(spec, scaled_block, largest) is None:
            return False
    return True


@dataclass(frozen=True)
class PageSizePlan:
    """How every layer of a model reaches one common page size."""

    #: The common page size, in bytes.
    page_size: int
    #: The largest page any layer asked for.
    largest_page_size: int
    #: LCM of the pages that grow with the block size (1 if there are none).
    scalable_lcm: int
    #: The unified spec of every layer.
    specs: dict[str, KVCacheSpec]
    #: Block size multiplier of every layer whose page grows with its block.
    block_scale: dict[str, int]
    #: Bytes of padding added to every state page.
    state_padding: dict[str, int]

    @property
    def page_growth(self) -> float:
        """The common page as a multiple of the largest requested page."""
        return self.page_size / self.largest_page_size

    @property
    def max_padding_pct(self) -> float:
        """The largest padding added to a state page, in percent of the page."""
        return 100.0 * max(self.state_padding.values(), default=0) / self.page_size


def _layer_table(kv_cache_spec: Mapping[str, KVCacheSpec]) -> str:
    """Every layer with its spec type and page size, grouped by page."""
    rows: dict[tuple[int, str], list[str]] = {}
    for name, spec in kv_cache_spec.items():
        key = (spec.page_size_bytes, type(spec).__name__)
        rows.setdefault(key, []).append(name)
    lines = [
        f"  {page:,} B per page, {kind} x{len(names)}: {', '.join(names)}"
        for (page, kind), names in sorted(rows.items())
    ]
    return "\n".join(lines)


def _unification_impossible(
    kv_cache_spec: Mapping[str, KVCacheSpec], reason: str
) -> PageSizeUnificationError:
    return PageSizeUnificationError(
        f"vllm-hybrid cannot give the KV cache layers one page size: {reason}. "
        "No limit changes this; the layers and their page sizes are:\n"
        + _layer_table(kv_cache_spec)
    )


def _common_page_size(
    kv_cache_spec: Mapping[str, KVCacheSpec],
    scalable: Mapping[str, int],
    fixed: Mapping[str, int],
    largest: int,
) -> tuple[int, int]:
    """``(common page, LCM of the scalable pages)``.

    The common page must be a multiple of every page that grows with its block
    (so those layers only scale their block size by an integer), at least
    every state page (those are padded) and equal to any page that can neither
    grow nor be padded. The smallest such page is the LCM rounded up to a
    multiple covering the largest page.
    """
    lcm = math.lcm(*set(scalable.values())) if scalable else 1
    if not fixed:
        return lcm * cdiv(largest, lcm), lcm
    fixed_pages = set(fixed.values())
    if len(fixed_pages) > 1:
        raise _unification_impossible(
            kv_cache_spec,
            "layers whose page neither grows with the block size nor can be "
            f"padded have different pages ({sorted(fixed_pages)} B)",
        )
    page = fixed_pages.pop()
    if page % lcm != 0 or page < largest:
        raise _unification_impossible(
            kv_cache_spec,
            f"layers whose page neither grows nor can be padded fix the page at "
            f"{page:,} B, which the other pages (LCM {lcm:,} B, largest "
            f"{largest:,} B) cannot match",
        )
    return page, lcm


def plan_page_size_unification(
    kv_cache_spec: Mapping[str, KVCacheSpec],
) -> PageSizePlan:
    """The smallest common page that pads nothing but state pages.

    Integer arithmetic only: layers whose page grows with the block size get
    their block size multiplied by ``common // page``; state (Mamba/GDN) pages
    get ``page_size_padded = common``.
    """
    pages = {name: spec.page_size_bytes for name, spec in kv_cache_spec.items()}
    largest = max(pages.values())
    scalable: dict[str, int] = {}
    fixed: dict[str, int] = {}
    for name, spec in kv_cache_spec.items():
        if _is_state_spec(spec):
            continue
        bucket = scalable if _scaled_spec(spec, 2) is not None else fixed
        bucket[name] = pages[name]
    page_size, lcm = _common_page_size(kv_cache_spec, scalable, fixed, largest)

    specs: dict[str, KVCacheSpec] = {}
    block_scale: dict[str, int] = {}
    state_padding: dict[str, int] = {}
    for name, spec in kv_cache_spec.items():
        if name in scalable:
            ratio = page_size // pages[name]
            scaled = _scaled_spec(spec, ratio)
            if scaled is None:
                raise _unification_impossible(
                    kv_cache_spec,
                    f"layer {name} cannot scale its block size by {ratio}",
                )
            specs[name] = scaled
            block_scale[name] = ratio
        elif name in fixed or pages[name] == page_size:
            specs[name] = spec
        else:
            specs[name] = replace(spec, page_size_padded=page_size)
            state_padding[name] = page_size - pages[name]
        assert specs[name].page_size_bytes == page_size
    return PageSizePlan(
        page_size=page_size,
        largest_page_size=largest,
        scalable_lcm=lcm,
        specs=specs,
        block_scale=block_scale,
        state_padding=state_padding,
    )


def _suggested(value: float) -> str:
    """``value`` rounded up to two decimals, as a user would type it."""
    return f"{math.ceil(value * 100 - 1e-9) / 100:g}"


@dataclass(frozen=True)
class PlanViolations:
    """How a page plan exceeds the limits, and the option values that would
    accept it."""

    problems: tuple[str, ...]
    #: (``hybrid_kv`` key, suggested value)
    fixes: tuple[tuple[str, str], ...]

    @property
    def acceptable(self) -> bool:
        """Whether options can accept the plan (a block longer than
        ``max_model_len`` has no option: upstream's plan is used)."""
        return len(self.fixes) == len(self.problems)

    def accept_hint(self) -> str:
        """The option values that lift the padding and growth limits."""
        options = ", ".join(f'"{key}": {value}' for key, value in self.fixes)
        return f"--additional-config '{{\"{ADDITIONAL_CONFIG_KEY}\": {{{options}}}}}'"


def page_plan_violations(
    plan: PageSizePlan, limits: PageUnificationLimits
) -> PlanViolations | None:
    """The limits ``plan`` exceeds, or None."""
    problems: list[str] = []
    fixes: list[tuple[str, str]] = []
    if plan.max_padding_pct > limits.max_page_padding_pct:
        problems.append(
            f"state pages would be padded to {plan.page_size:,} B, up to "
            f"{plan.max_padding_pct:.2f}% of each page (limit "
            f"{limits.max_page_padding_pct:g}%)"
        )
        fixes.append((MAX_PAGE_PADDING_PCT, _suggested(plan.max_padding_pct)))
    if plan.page_growth > limits.max_page_growth:
        problems.append(
            f"the common page ({plan.page_size:,} B, a multiple of the LCM "
            f"{plan.scalable_lcm:,} B of the attention pages) would be "
            f"{plan.page_growth:.2f}x the largest page ({plan.largest_page_size:,}"
            f" B), multiplying block sizes as much (limit "
            f"{limits.max_page_growth:g}x)"
        )
        fixes.append((MAX_PAGE_GROWTH, _suggested(plan.page_growth)))
    longest = _longest_scaled_block(plan)
    if (
        limits.max_block_tokens is not None
        and longest is not None
        and longest[1] > limits.max_block_tokens
    ):
        name, tokens = longest
        problems.append(
            f"layer {name} would get blocks of {tokens:,} tokens, longer than "
            f"max_model_len ({limits.max_block_tokens:,})"
        )
    if not problems:
        return None
    return PlanViolations(tuple(problems), tuple(fixes))


def _longest_scaled_block(plan: PageSizePlan) -> tuple[str, int] | None:
    """The layer whose block the plan scales the most, and its block tokens."""
    scaled = [
        (name, plan.specs[name].block_size)
        for name, scale in plan.block_scale.items()
        if scale > 1
    ]
    return max(scaled, key=lambda item: item[1], default=None)


def check_page_size_plan(
    plan: PageSizePlan,
    kv_cache_spec: Mapping[str, KVCacheSpec],
    limits: PageUnificationLimits,
) -> None:
    """Fail at start-up, with what to change, when a plan exceeds a limit."""
    violations = page_plan_violations(plan, limits)
    if violations is None:
        return
    raise PageSizeUnificationError(
        "vllm-hybrid will not unify the KV cache page sizes of this model: "
        + "; ".join(violations.problems)
        + ".\nLayers and their page sizes:\n"
        + _layer_table(kv_cache_spec)
        + "\nTo accept this plan, start vLLM with "
        + violations.accept_hint()
        + "."
    )


def _log_state_padding(page_size: int, state_padding: Mapping[str, int]) -> None:
    if not state_padding:
        return
    largest = max(state_padding.values())
    logger.info_once(
        "vllm-hybrid: padded %d state layer(s) to the common KV cache page of "
        "%s B; padding is up to %s B (%.2f%% of the page).",
        len(state_padding),
        f"{page_size:,}",
        f"{largest:,}",
        100.0 * largest / page_size,
    )


def _upstream_within_limits(
    kv_cache_spec: dict[str, KVCacheSpec],
    plan: PageSizePlan,
    limits: PageUnificationLimits,
    violations: PlanViolations,
    upstream_unify: Callable[[dict[str, KVCacheSpec]], dict[str, KVCacheSpec]],
) -> dict[str, KVCacheSpec]:
    """Upstream's unification for a plan beyond the limits (``violations``),
    with one line saying why; where upstream gives up too, the error naming
    the option."""
    try:
        unified = upstream_unify(kv_cache_spec)
    except NotImplementedError:
        if not violations.fixes:
            # Only the max_model_len bound is exceeded and upstream has no
            # plan at all: long blocks are better than no engine.
            return plan.specs
        check_page_size_plan(plan, kv_cache_spec, limits)
        raise
    hint = violations.accept_hint() if violations.acceptable else ""
    logger.warning_once(
        "vllm-hybrid: the LCM page plan of this model is beyond its limits (%s); "
        "using upstream's page unification instead (it pads attention pages to "
        "the largest page).%s",
        "; ".join(violations.problems),
        f" To use the LCM plan, start vLLM with {hint}." if hint else "",
    )
    return unified


def unify_page_sizes(
    kv_cache_spec: dict[str, KVCacheSpec],
    limits: Callable[[], PageUnificationLimits],
    upstream_unify: Callable[[dict[str, KVCacheSpec]], dict[str, KVCacheSpec]],
) -> dict[str, KVCacheSpec]:
    """Give every layer the same page size without padding attention pages.

    Without state layers, and when every page divides the largest one (or is
    a state page), upstream's result is returned unchanged. Otherwise the
    common page is the LCM of the pages that grow with the block size,
    rounded up to cover the largest page (:func:`plan_page_size_unification`):
    attention layers (MLA included) scale their block size by an integer, only
    state pages are padded, so the kernel-block split stays legal.
    ``limits()`` (asked only for such a plan) bound the padding and the block
    growth; a plan beyond them raises :class:`PageSizeUnificationError` naming
    the layers, their page sizes and the option that accepts it.
    """
    page_sizes = {spec.page_size_bytes for spec in kv_cache_spec.values()}
    if len(page_sizes) <= 1:
        return kv_cache_spec
    if not any(_is_state_spec(spec) for spec in kv_cache_spec.values()):
        # Models without state layers (dense, or a target with a draft of
        # another head size) keep upstream's plan exactly: padding where it
        # pads, its fallbacks where it gives up.
        return upstream_unify(kv_cache_spec)
    if _upstream_unifies(kv_cache_spec):
        unified = upstream_unify(kv_cache_spec)
        page_size = max(page_sizes)
        _log_state_padding(
            page_size,
            {
                name: page_size - spec.page_size_bytes
                for name, spec in kv_cache_spec.items()
                if _is_state_spec(spec) and spec.page_size_bytes != page_size
            },
        )
        return unified
    if _upstream_gives_up(kv_cache_spec) and _upstream_falls_back(kv_cache_spec):
        raise PageSizeUnificationError(
            "MLA next to sliding-window layers: upstream's full-allocation "
            "grouping serves these pages"
        )

    plan = plan_page_size_unification(kv_cache_spec)
    plan_limits = limits()
    violations = page_plan_violations(plan, plan_limits)
    if violations is not None:
        return _upstream_within_limits(
            kv_cache_spec, plan, plan_limits, violations, upstream_unify
        )
    scales = sorted(set(plan.block_scale.values()))
    logger.info_once(
        "vllm-hybrid: KV cache pages do not divide each other; common page is "
        "%s B (LCM of the attention pages %s B, %.3fx the largest page), "
        "attention block sizes scaled by %s.",
        f"{plan.page_size:,}",
        f"{plan.scalable_lcm:,}",
        plan.page_growth,
        "/".join(str(scale) for scale in scales) or "1",
    )
    _log_state_padding(plan.page_size, plan.state_padding)
    return plan.specs
