"""Environment variables read by the overlay.

``VLLM_HYBRID_KV`` is the run-time switch: unset or ``1`` means the overlay
is active, ``0`` gives pure upstream vLLM in the same process setup, which is
what A/B benchmarks rely on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import Enum
from typing import TypeVar

E = TypeVar("E", bound=Enum)

SWITCH_VAR = "VLLM_HYBRID_KV"

_ON = {"1", "true", "on", "yes"}
_OFF = {"0", "false", "off", "no"}


def _on_off(
    name: str, on_means: str, off_means: str, environ: dict[str, str] | None
) -> bool:
    """Read an on/off variable; unset or empty means on.

    Raises ``ValueError`` naming the variable and the accepted values when it
    holds anything else, so a typo never silently picks a mode.
    """
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return True
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(
        f"{name}={raw!r} is not understood: set {name}=1 ({on_means}, the "
        f"default) or {name}=0 ({off_means})."
    )


def overlay_enabled(environ: dict[str, str] | None = None) -> bool:
    """Return whether ``VLLM_HYBRID_KV`` asks for the overlay."""
    return _on_off(SWITCH_VAR, "overlay on", "pure upstream vLLM", environ)


TQ_NATIVE_VAR = "VLLM_HYBRID_TQ_NATIVE"


def tq_native_enabled(environ: dict[str, str] | None = None) -> bool:
    """Return whether ``VLLM_HYBRID_TQ_NATIVE`` allows the native TurboQuant kernel.

    Unset or ``1`` uses the C++ kernel when it is built; ``0`` forces the torch
    reference (for A/B timing and for bisecting numerical differences).
    """
    return _on_off(
        TQ_NATIVE_VAR, "native kernel when built", "torch reference", environ
    )


#: Page-unification limits of the single shared pool, used where
#: ``--additional-config '{"hybrid_kv": {...}}'`` does not set them
#: (:mod:`vllm_hybrid.config.hybrid_kv` parses them).
MAX_PAGE_PADDING_PCT_VAR = "VLLM_HYBRID_MAX_PAGE_PADDING_PCT"
MAX_PAGE_GROWTH_VAR = "VLLM_HYBRID_MAX_PAGE_GROWTH"
#: Directory of the per-pool usage snapshots an engine core writes and its
#: frontend's stat logger reads (:mod:`vllm_hybrid.v1.metrics.pool_snapshots`).
STATS_DIR_VAR = "VLLM_HYBRID_STATS_DIR"
#: Build time only (setup.py skips the native kernel); harmless when set later.
SKIP_NATIVE_VAR = "VLLM_HYBRID_SKIP_NATIVE"
#: Which state block edges a decoding request keeps a state at in pooled
#: mode: ``budget_end`` (the default), ``every`` or ``none``
#: (:class:`vllm_hybrid.v1.core.pooled.policy.positions.DecodeEdges`); for A/B runs.
DECODE_EDGES_VAR = "VLLM_HYBRID_DECODE_EDGES"
#: Admission's growth reserve of pooled mode in state pages of tokens (0:
#: none; :data:`vllm_hybrid.v1.core.pooled.policy.steps.ADMISSION_GROWTH_STATE_PAGES`
#: when unset); for A/B runs.
ADMISSION_GROWTH_VAR = "VLLM_HYBRID_ADMISSION_GROWTH"
#: How many prompt tokens a pooled step computes: ``state_page`` (the
#: default), ``fill`` or ``deep_page``
#: (:class:`vllm_hybrid.v1.core.pooled.policy.steps.PrefillPacing`); for A/B runs.
PREFILL_PACING_VAR = "VLLM_HYBRID_PREFILL_PACING"
#: Oldest cached state blocks among which pooled mode's state pool hands out
#: the one farthest from the arena's boundary (1: plain LRU;
#: :data:`vllm_hybrid.v1.core.pooled.policy.eviction.STATE_EVICTION_WINDOW` when
#: unset); for A/B runs.
STATE_EVICTION_WINDOW_VAR = "VLLM_HYBRID_STATE_EVICTION_WINDOW"
#: When pooled mode's arena moves its boundary: ``costed`` (the default),
#: ``misses``, ``recency`` or ``demand``
#: (:class:`vllm_hybrid.v1.core.pooled.policy.eviction.ArenaSplit`); for A/B runs.
ARENA_SPLIT_VAR = "VLLM_HYBRID_ARENA_SPLIT"
#: State blocks' worth of token ids next to pooled mode's arena boundary whose
#: clean blocks the token pool hands out after its cached ones (0: none;
#: :data:`vllm_hybrid.v1.core.pooled.policy.eviction.BOUNDARY_CLEAR_STATE_BLOCKS`
#: when unset); for A/B runs.
BOUNDARY_CLEAR_VAR = "VLLM_HYBRID_BOUNDARY_CLEAR"
TOKEN_MOVES_VAR = "VLLM_HYBRID_TOKEN_MOVES"


def token_moves_enabled(environ: dict[str, str] | None = None) -> bool:
    """Return whether ``VLLM_HYBRID_TOKEN_MOVES`` lets pooled mode move live
    token blocks off the arena's boundary so that the state pool can grow
    (unset or ``1``); ``0`` leaves them where they are until their request
    ends (for A/B runs, and a way out should a worker not apply the moves).
    """
    return _on_off(
        TOKEN_MOVES_VAR,
        "live token blocks move off the arena boundary",
        "they pin it until their request ends",
        environ,
    )


def raw(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of one of :data:`OVERLAY_ENV_VARS`, stripped; None if unset
    or empty. The modules that interpret a variable read it through here."""
    if name not in OVERLAY_ENV_VARS:
        raise KeyError(f"{name} is not declared in vllm_hybrid.envs")
    value = (os.environ if environ is None else environ).get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def whole_number(
    name: str,
    default: int,
    minimum: int,
    meaning: str,
    environ: Mapping[str, str] | None = None,
) -> int:
    """The whole number variable ``name`` holds, at least ``minimum``;
    ``default`` when unset; :class:`ValueError` naming the variable, what its
    number means and the bound otherwise."""
    value = raw(name, environ)
    if value is None:
        return default
    if not value.isdigit() or int(value) < minimum:
        raise ValueError(
            f"{name}={value!r} is not understood: {meaning}, a whole number "
            f">= {minimum}"
        )
    return int(value)


def choice(name: str, default: E, environ: Mapping[str, str] | None = None) -> E:
    """The member of ``default``'s enum that variable ``name`` names (by
    value, any case), ``default`` when unset; :class:`ValueError` naming the
    variable and the values it takes otherwise."""
    value = raw(name, environ)
    if value is None:
        return default
    kind = type(default)
    try:
        return kind(value.lower())
    except ValueError:
        known = ", ".join(str(member.value) for member in kind)
        raise ValueError(
            f"{name}={value!r} is not understood: one of {known}"
        ) from None


#: Every variable the overlay reads. vLLM warns about (or, with hard failing
#: enabled, rejects) ``VLLM_*`` variables it does not know.
OVERLAY_ENV_VARS = (
    SWITCH_VAR,
    TQ_NATIVE_VAR,
    MAX_PAGE_PADDING_PCT_VAR,
    MAX_PAGE_GROWTH_VAR,
    STATS_DIR_VAR,
    SKIP_NATIVE_VAR,
    DECODE_EDGES_VAR,
    ADMISSION_GROWTH_VAR,
    PREFILL_PACING_VAR,
    STATE_EVICTION_WINDOW_VAR,
    ARENA_SPLIT_VAR,
    BOUNDARY_CLEAR_VAR,
    TOKEN_MOVES_VAR,
)


def declare_to_vllm() -> None:
    """Add the overlay's variables to vLLM's table of known variables.

    ``vllm.envs.environment_variables`` is the table vLLM checks set
    ``VLLM_*`` names against; adding entries (never replacing vLLM's) keeps
    ``VLLM_HYBRID_KV=0`` and friends from being reported as unknown.
    """
    import vllm.envs as vllm_envs

    for name in OVERLAY_ENV_VARS:
        vllm_envs.environment_variables.setdefault(
            name, lambda name=name: os.getenv(name)
        )
