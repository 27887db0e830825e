"""Hybrid-aware versions of KV cache planning helpers (issue 4).

Three places in ``vllm.v1.core.kv_cache_utils`` assume every KV cache group
is attention with pages that divide each other:

* :func:`unify_kv_cache_spec_page_size` gives up (``NotImplementedError``) or
  pads attention pages, which defeats quantized KV caches and forbids the
  kernel-block split, when a page does not divide the largest page.
* :func:`update_kv_cache_capacity` reports a token capacity derived from a
  concurrency in which constant-size state groups (Mamba, GDN, short conv)
  weigh like attention, so "KV cache size: N tokens" does not say how many
  tokens fit.
* The routed-experts store of the AuxOutput connector is sized from the
  scheduler block size, the LCM of every group's block size, which state
  groups can inflate far beyond the token slots that exist
  (:func:`routed_experts_store_bytes`).

The replacements keep upstream's names and signatures; the patch registry
(:mod:`vllm_hybrid.patches.registry`) installs them. For models without state
groups they return exactly what upstream returns.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import vllm.v1.core.kv_cache_utils as _upstream_utils
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from vllm_hybrid.logger import init_logger
from vllm_hybrid.patches.registry import upstream

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

_HOME = "vllm.v1.core.kv_cache_utils"
UNIFY_KV_CACHE_SPEC_PAGE_SIZE = f"{_HOME}:unify_kv_cache_spec_page_size"
GET_KV_CACHE_GROUPS = f"{_HOME}:get_kv_cache_groups"
GET_KV_CACHE_CAPACITY = f"{_HOME}:get_kv_cache_capacity"
UPDATE_KV_CACHE_CAPACITY = f"{_HOME}:update_kv_cache_capacity"

# ---------------------------------------------------------------------------
# Options of the page unification
# ---------------------------------------------------------------------------

#: Key of the overlay's options in ``--additional-config``.
ADDITIONAL_CONFIG_KEY = "hybrid_kv"
MAX_PAGE_PADDING_PCT = "max_page_padding_pct"
MAX_PAGE_GROWTH = "max_page_growth"
#: Environment variables used when ``--additional-config`` does not set them.
MAX_PAGE_PADDING_PCT_ENV = "VLLM_HYBRID_MAX_PAGE_PADDING_PCT"
MAX_PAGE_GROWTH_ENV = "VLLM_HYBRID_MAX_PAGE_GROWTH"

#: Default cap on the padding added to a state page, in percent of the page.
#: Large enough for every plan vLLM 0.32's own hybrid alignment produces on
#: GPU for Qwen3-Next/Qwen3.5-shaped models (at most 1.49%), small enough that
#: a plan which wastes a noticeable share of state memory needs an opt-in.
DEFAULT_MAX_PAGE_PADDING_PCT = 2.0
#: Default cap on the common page relative to the largest page of the model.
#: Scaling attention blocks to the LCM of their pages costs no bytes but makes
#: blocks coarser; pages whose LCM is hundreds of times their size would turn
#: blocks into thousands of tokens, which is worth a deliberate opt-in.
DEFAULT_MAX_PAGE_GROWTH = 16.0


@dataclass(frozen=True)
class PageUnificationLimits:
    """What :func:`unify_kv_cache_spec_page_size` may spend on a common page.

    ``max_page_padding_pct`` bounds the bytes added to each state page, as a
    percentage of the common page. ``max_page_growth`` bounds the common page
    as a multiple of the largest page the model asked for.
    """

    max_page_padding_pct: float = DEFAULT_MAX_PAGE_PADDING_PCT
    max_page_growth: float = DEFAULT_MAX_PAGE_GROWTH


def _hybrid_kv_options(vllm_config: VllmConfig | None) -> Mapping[str, Any]:
    """The ``hybrid_kv`` entry of ``--additional-config``, or nothing."""
    if vllm_config is None:
        return {}
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, Mapping):
        return {}
    options = additional.get(ADDITIONAL_CONFIG_KEY)
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ValueError(
            f"--additional-config {ADDITIONAL_CONFIG_KEY!r} must be a JSON object "
            f"such as {{{ADDITIONAL_CONFIG_KEY!r}: {{{MAX_PAGE_PADDING_PCT!r}: 5}}}}, "
            f"got {options!r}"
        )
    return options


def _read_limit(
    options: Mapping[str, Any],
    key: str,
    environ: Mapping[str, str],
    env_var: str,
    default: float,
    minimum: float,
    maximum: float | None,
) -> float:
    """One limit: ``--additional-config`` wins over the environment."""
    if key in options:
        raw: Any = options[key]
        source = f"--additional-config {ADDITIONAL_CONFIG_KEY}.{key}"
    elif environ.get(env_var, "").strip():
        raw = environ[env_var]
        source = env_var
    else:
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = math.nan
    if not (value >= minimum and (maximum is None or value <= maximum)):
        upper = "" if maximum is None else f" and at most {maximum:g}"
        raise ValueError(
            f"{source}={raw!r} is not valid: expected a number of at least "
            f"{minimum:g}{upper}"
        )
    return value


def resolve_page_unification_limits(
    vllm_config: VllmConfig | None = None,
    environ: Mapping[str, str] | None = None,
) -> PageUnificationLimits:
    """Limits from ``--additional-config``, else the environment, else defaults.

    ``--additional-config '{"hybrid_kv": {"max_page_padding_pct": 5,
    "max_page_growth": 128}}'`` sets both; ``VLLM_HYBRID_MAX_PAGE_PADDING_PCT``
    and ``VLLM_HYBRID_MAX_PAGE_GROWTH`` are used where it does not.
    """
    options = _hybrid_kv_options(vllm_config)
    env = os.environ if environ is None else environ
    return PageUnificationLimits(
        max_page_padding_pct=_read_limit(
            options,
            MAX_PAGE_PADDING_PCT,
            env,
            MAX_PAGE_PADDING_PCT_ENV,
            DEFAULT_MAX_PAGE_PADDING_PCT,
            minimum=0.0,
            maximum=100.0,
        ),
        max_page_growth=_read_limit(
            options,
            MAX_PAGE_GROWTH,
            env,
            MAX_PAGE_GROWTH_ENV,
            DEFAULT_MAX_PAGE_GROWTH,
            minimum=1.0,
            maximum=None,
        ),
    )


#: The config of the KV cache planning in progress. Upstream calls the page
#: unification without the config; :func:`get_kv_cache_groups` publishes it
#: here so that ``--additional-config`` reaches the limits.
_planning_config: ContextVar[VllmConfig | None] = ContextVar(
    "vllm_hybrid_planning_config", default=None
)


def _current_vllm_config() -> VllmConfig | None:
    config = _planning_config.get()
    if config is not None:
        return config
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def get_kv_cache_groups(
    vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec]
) -> list[KVCacheGroupSpec]:
    """Upstream's grouping, with ``vllm_config`` visible to the unification.

    The grouping itself is upstream's; this only makes the config of the
    planning available to :func:`unify_kv_cache_spec_page_size`, which upstream
    calls with the specs alone, for the whole duration of the call.
    """
    token = _planning_config.set(vllm_config)
    try:
        return upstream(GET_KV_CACHE_GROUPS)(vllm_config, kv_cache_spec)
    finally:
        _planning_config.reset(token)


# ---------------------------------------------------------------------------
# F1: page size unification
# ---------------------------------------------------------------------------


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


def check_page_size_plan(
    plan: PageSizePlan,
    kv_cache_spec: Mapping[str, KVCacheSpec],
    limits: PageUnificationLimits,
) -> None:
    """Fail at start-up, with what to change, when a plan exceeds a limit."""
    problems: list[str] = []
    fixes: list[tuple[str, str, str]] = []
    if plan.max_padding_pct > limits.max_page_padding_pct:
        problems.append(
            f"state pages would be padded to {plan.page_size:,} B, up to "
            f"{plan.max_padding_pct:.2f}% of each page (limit "
            f"{limits.max_page_padding_pct:g}%)"
        )
        fixes.append(
            (
                MAX_PAGE_PADDING_PCT,
                MAX_PAGE_PADDING_PCT_ENV,
                _suggested(plan.max_padding_pct),
            )
        )
    if plan.page_growth > limits.max_page_growth:
        problems.append(
            f"the common page ({plan.page_size:,} B, a multiple of the LCM "
            f"{plan.scalable_lcm:,} B of the attention pages) would be "
            f"{plan.page_growth:.2f}x the largest page ({plan.largest_page_size:,}"
            f" B), multiplying block sizes as much (limit "
            f"{limits.max_page_growth:g}x)"
        )
        fixes.append(
            (MAX_PAGE_GROWTH, MAX_PAGE_GROWTH_ENV, _suggested(plan.page_growth))
        )
    if not problems:
        return
    options = ", ".join(f'"{key}": {value}' for key, _, value in fixes)
    env = " ".join(f"{var}={value}" for _, var, value in fixes)
    raise PageSizeUnificationError(
        "vllm-hybrid will not unify the KV cache page sizes of this model: "
        + "; ".join(problems)
        + ".\nLayers and their page sizes:\n"
        + _layer_table(kv_cache_spec)
        + "\nTo accept this plan, start vLLM with --additional-config "
        f"'{{\"{ADDITIONAL_CONFIG_KEY}\": {{{options}}}}}' (or set {env})."
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


def unify_kv_cache_spec_page_size(
    kv_cache_spec: dict[str, KVCacheSpec],
    limits: PageUnificationLimits | None = None,
) -> dict[str, KVCacheSpec]:
    """Give every layer the same page size without padding attention pages.

    When every page divides the largest one (or is a state page), upstream's
    result is returned unchanged. Otherwise the common page is the LCM of the
    pages that grow with the block size, rounded up to cover the largest page
    (:func:`plan_page_size_unification`): attention layers (MLA included)
    scale their block size by an integer, only state pages are padded, so the
    kernel-block split stays legal. ``limits`` (default: from
    ``--additional-config`` ``hybrid_kv``, else the environment,
    :func:`resolve_page_unification_limits`) bound the padding and the block
    growth; a plan beyond them raises :class:`PageSizeUnificationError`
    naming the layers, their page sizes and the option that accepts it.
    """
    page_sizes = {spec.page_size_bytes for spec in kv_cache_spec.values()}
    if len(page_sizes) <= 1:
        return kv_cache_spec
    if _upstream_unifies(kv_cache_spec):
        unified = upstream(UNIFY_KV_CACHE_SPEC_PAGE_SIZE)(kv_cache_spec)
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

    plan = plan_page_size_unification(kv_cache_spec)
    if limits is None:
        limits = resolve_page_unification_limits(_current_vllm_config())
    check_page_size_plan(plan, kv_cache_spec, limits)
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


# ---------------------------------------------------------------------------
# F2: token capacity
# ---------------------------------------------------------------------------

#: Specs whose memory grows with the sequence length (MLA and hidden-state
#: caches are FullAttentionSpec subclasses, sliding-window MLA a
#: SlidingWindowSpec). Mamba/GDN/short-conv state, cross-attention (encoder
#: length), encoder-only, ring buffers and HiSparse scratch are per request.
_TOKEN_SPEC_TYPES: tuple[type[KVCacheSpec], ...] = (
    FullAttentionSpec,
    SlidingWindowSpec,
    ChunkedLocalAttentionSpec,
)


def is_token_capacity_spec(spec: KVCacheSpec) -> bool:
    """Whether a group with this spec needs memory per token of the sequence."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        if not spec.kv_cache_specs:
            return False
        spec = spec.first_spec
    return isinstance(spec, _TOKEN_SPEC_TYPES)


def token_capacity_kv_cache_groups(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> list[KVCacheGroupSpec]:
    """The groups whose memory grows with sequence length.

    Full, sliding-window, chunked-local and MLA attention count; Mamba, GDN
    and short-conv state and other constant-size caches do not. When no group
    qualifies (attention-free models) every group is returned, so token
    capacity stays defined. ``vllm_config`` is taken for parity with
    upstream's capacity helpers; 0.32 has no cache mode in which a state
    group grows with the sequence.
    """
    del vllm_config
    groups = list(kv_cache_config.kv_cache_groups)
    token_groups = [g for g in groups if is_token_capacity_spec(g.kv_cache_spec)]
    return token_groups or groups


def _split_groups(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[list[KVCacheGroupSpec], list[KVCacheGroupSpec]] | None:
    """``(token groups, other groups)`` when the hybrid formula applies.

    None when every group is a token group (dense and attention-free models)
    or a group lives in the HiSparse host pool: upstream's numbers stand then.
    """
    groups = kv_cache_config.kv_cache_groups
    if any(g.host_resident for g in groups):
        return None
    token_groups = token_capacity_kv_cache_groups(vllm_config, kv_cache_config)
    token_ids = {id(g) for g in token_groups}
    others = [g for g in groups if id(g) not in token_ids]
    if not others:
        return None
    return token_groups, others


def state_blocks_per_request(
    vllm_config: VllmConfig, groups: Iterable[KVCacheGroupSpec]
) -> int:
    """Blocks one running request holds at most in ``groups``.

    The per-group count upstream's concurrency uses as well:
    ``cdiv(max_memory_usage_bytes, page_size_bytes)``, i.e. ``1 + num_spec``
    per Mamba group in "none" mode, ``2 + num_spec + checkpoints`` in "align".
    """
    return sum(
        cdiv(
            g.kv_cache_spec.max_memory_usage_bytes(vllm_config),
            g.kv_cache_spec.page_size_bytes,
        )
        for g in groups
    )


def _max_tokens_within(num_blocks: int, blocks_for: Callable[[int], int]) -> int:
    """The largest token count ``t`` with ``blocks_for(t) <= num_blocks``.

    ``blocks_for`` must be non-decreasing, zero at zero and unbounded, which
    holds for token groups: each needs at least ``cdiv(t, block span)``.
    """
    if num_blocks <= 0:
        return 0
    high = 1
    while blocks_for(high) <= num_blocks:
        high *= 2
        if high > num_blocks << 40:
            raise ValueError("token groups must need more blocks for more tokens")
    low = high // 2  # fits (0 when high == 1)
    while high - low > 1:
        mid = (low + high) // 2
        if blocks_for(mid) <= num_blocks:
            low = mid
        else:
            high = mid
    return low


def kv_cache_token_capacity(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> int:
    """Tokens one request can hold in the shared pool of a hybrid model.

    All groups draw block ids from one pool of ``num_blocks`` blocks, of which
    block 0 is the null block. A request holding ``t`` tokens needs
    ``spec.max_num_blocks_per_req(t)`` blocks (``cdiv(t, block_size * dcp)``)
    in every token group, plus the state blocks of every other group
    (:func:`state_blocks_per_request`). The capacity is the largest ``t``
    that fits::

        sum(cdiv(t, b_g) for g in token_groups) <= num_blocks - 1 - state

    which for token groups of one block size ``b`` is
    ``(num_blocks - 1 - state) // len(token_groups) * b``. Sliding-window
    groups are counted as if they kept every token, so for them this is a
    lower bound. Each further concurrent request costs another ``state``
    blocks, which the maximum concurrency (all groups) accounts for.

    Models without state groups (and HiSparse configs) keep upstream's
    figure, ``max_concurrency * max_model_len``; a config without groups has
    no capacity.
    """
    split = _split_groups(vllm_config, kv_cache_config)
    if split is None:
        if not kv_cache_config.kv_cache_groups:
            return 0
        return upstream(GET_KV_CACHE_CAPACITY)(vllm_config, kv_cache_config)[0]
    token_groups, others = split
    free = (
        kv_cache_config.num_blocks - 1 - state_blocks_per_request(vllm_config, others)
    )

    def blocks_for(num_tokens: int) -> int:
        return sum(
            g.kv_cache_spec.max_num_blocks_per_req(vllm_config, num_tokens)
            for g in token_groups
        )

    return _max_tokens_within(free, blocks_for)


def get_kv_cache_capacity(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> tuple[int, float]:
    """``(token capacity, max concurrency)`` of a KV cache config.

    For hybrid models the token capacity is :func:`kv_cache_token_capacity`
    (token groups only); the maximum concurrency is upstream's, over every
    group. Models without state groups get upstream's pair unchanged.
    """
    pooled = _pooled_capacity(vllm_config, kv_cache_config)
    if pooled is not None:
        return pooled.token_capacity, pooled.max_concurrency
    if _split_groups(vllm_config, kv_cache_config) is None:
        return upstream(GET_KV_CACHE_CAPACITY)(vllm_config, kv_cache_config)
    max_concurrency = _upstream_utils.get_max_concurrency_for_kv_cache_config(
        vllm_config, kv_cache_config
    )
    return kv_cache_token_capacity(vllm_config, kv_cache_config), max_concurrency


def _pooled_capacity(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
    """Capacity figures of a pooled-mode config, or None for other configs."""
    from vllm_hybrid.v1.core.pooled_config import PooledKVCacheConfig
    from vllm_hybrid.v1.core.pooled_planner import pooled_capacity

    if not isinstance(kv_cache_config, PooledKVCacheConfig):
        return None
    return pooled_capacity(kv_cache_config, vllm_config.model_config.max_model_len)


def _update_pooled_capacity(vllm_config: VllmConfig, capacity: Any) -> None:
    cache_config = vllm_config.cache_config
    cache_config.kv_cache_size_tokens = capacity.token_capacity
    cache_config.kv_cache_max_concurrency = capacity.max_concurrency
    logger.info_once(
        "%s KV cache size: %s tokens (token pool only, after one request's "
        "state), Maximum concurrency for %s tokens per request: %.2fx (token "
        "and state pools)",
        _upstream_utils._kv_cache_device_name(vllm_config),
        f"{capacity.token_capacity:,}",
        f"{vllm_config.model_config.max_model_len:,}",
        capacity.max_concurrency,
    )


def update_kv_cache_capacity(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> None:
    """Store and log the KV cache capacity, counting only token groups.

    Sets ``cache_config.kv_cache_size_tokens`` and
    ``kv_cache_max_concurrency`` like upstream; for hybrid models the log line
    says that the tokens are those of the groups that grow with the sequence.
    """
    pooled = _pooled_capacity(vllm_config, kv_cache_config)
    if pooled is not None:
        _update_pooled_capacity(vllm_config, pooled)
        return
    split = _split_groups(vllm_config, kv_cache_config)
    if split is None:
        upstream(UPDATE_KV_CACHE_CAPACITY)(vllm_config, kv_cache_config)
        return
    token_groups, others = split
    num_tokens, max_concurrency = get_kv_cache_capacity(vllm_config, kv_cache_config)
    cache_config = vllm_config.cache_config
    cache_config.kv_cache_size_tokens = num_tokens
    cache_config.kv_cache_max_concurrency = max_concurrency
    logger.info_once(
        "%s KV cache size: %s tokens (counting only the %d of %d KV cache "
        "groups whose memory grows with sequence length; the other groups "
        "hold %d block(s) per request from the same pool), Maximum "
        "concurrency for %s tokens per request: %.2fx",
        _upstream_utils._kv_cache_device_name(vllm_config),
        f"{num_tokens:,}",
        len(token_groups),
        len(kv_cache_config.kv_cache_groups),
        state_blocks_per_request(vllm_config, others),
        f"{vllm_config.model_config.max_model_len:,}",
        max_concurrency,
    )


# ---------------------------------------------------------------------------
# F3: routed-experts store
# ---------------------------------------------------------------------------


def routed_experts_bytes_per_token(vllm_config: VllmConfig) -> int:
    """Host bytes of one token's routing: layers x top-k x expert id size.

    Same shape as the capturer's snapshot; ids are one byte up to 256
    experts and two beyond, as ``RoutedExpertsCapturer`` stores them.
    """
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        _get_routed_experts_shape,
    )

    num_layers, num_experts, top_k = _get_routed_experts_shape(vllm_config)
    id_bytes = 1 if num_experts <= 256 else 2
    return num_layers * top_k * id_bytes


def token_slots(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> int:
    """Token slots the token groups can address in the shared pool.

    ``num_blocks`` times the largest token span of a token-group block (DCP
    included), i.e. the slot address space of attention. State groups do not
    hold tokens, so their block sizes (which make the scheduler block size,
    an LCM, arbitrarily large) play no part.
    """
    token_groups = token_capacity_kv_cache_groups(vllm_config, kv_cache_config)
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    spans = [
        _upstream_utils.resolve_dcp_kv_block_size(g.kv_cache_spec, dcp)
        for g in token_groups
    ]
    block_span = max(spans, default=vllm_config.cache_config.block_size)
    return kv_cache_config.num_blocks * block_span


def routed_experts_store_bytes(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> int:
    """Default capacity of the routed-experts store for ``kv_cache_config``.

    The store keeps one object per hash block of routing, so that a prefix
    cache hit can replay the routing of its tokens; it therefore has to cover
    every token the attention pool can cache: :func:`token_slots` rounded up
    to whole hash blocks. Upstream uses ``num_blocks`` times the scheduler
    block size instead, which is the same for models whose groups share one
    block size and larger, up to orders of magnitude, when state groups have
    other block sizes.
    """
    _, hash_block_size = _upstream_utils.resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    num_objects = cdiv(token_slots(vllm_config, kv_cache_config), hash_block_size)
    return num_objects * hash_block_size * routed_experts_bytes_per_token(vllm_config)


def apply_routed_experts_store_bytes(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
) -> int | None:
    """Set ``aux_output_config.max_bytes`` unless the user did; return it.

    Must run before the model runner builds the AuxOutput connector, which
    reads the setting once (``initialize_kv_cache``). Does nothing when
    routed-experts capture is off.
    """
    aux_config = vllm_config.aux_output_config
    if not aux_config.enable_return_routed_experts:
        return aux_config.max_bytes
    if aux_config.max_bytes is not None:
        return aux_config.max_bytes
    max_bytes = routed_experts_store_bytes(vllm_config, kv_cache_config)
    aux_config.max_bytes = max_bytes
    logger.info_once(
        "vllm-hybrid: routed-experts store sized to %s B for %s token slots "
        "of the attention pool.",
        f"{max_bytes:,}",
        f"{token_slots(vllm_config, kv_cache_config):,}",
    )
    return max_bytes
