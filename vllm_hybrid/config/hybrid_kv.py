"""The overlay's options: ``--additional-config '{"hybrid_kv": {...}}'``.

One parser for every option, so that each process and each module reads the
same values with the same error messages. No option has an environment
variable: a setting an engine runs with is in its configuration.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Key of the overlay's options inside ``--additional-config``.
ADDITIONAL_CONFIG_KEY = "hybrid_kv"
MAX_PAGE_PADDING_PCT = "max_page_padding_pct"
MAX_PAGE_GROWTH = "max_page_growth"
PREFILL_CHECKPOINT_INTERVAL = "prefill_checkpoint_interval"
#: Boolean options (defaults: the fields of :class:`HybridKVOptions`).
_FLAGS = ("pooled", "retain_turn_ends", "token_moves")
#: Every option of the ``hybrid_kv`` object.
KNOWN_OPTIONS = frozenset(
    {*_FLAGS, MAX_PAGE_PADDING_PCT, MAX_PAGE_GROWTH, PREFILL_CHECKPOINT_INTERVAL}
)

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
    """What the single pool's page unification may spend on a common page.

    ``max_page_padding_pct`` bounds the bytes added to each state page, as a
    percentage of the common page. ``max_page_growth`` bounds the common page
    as a multiple of the largest page the model asked for.
    """

    max_page_padding_pct: float = DEFAULT_MAX_PAGE_PADDING_PCT
    max_page_growth: float = DEFAULT_MAX_PAGE_GROWTH
    #: No group's block may grow past this many tokens (the engine's
    #: ``max_model_len``; None when unknown). Not an option: a block longer
    #: than any request only wastes memory and coarsens prefix hits.
    max_block_tokens: int | None = None


@dataclass(frozen=True)
class HybridKVOptions:
    """Every ``hybrid_kv`` option, validated."""

    #: Use pooled mode for hybrid models (default on).
    pooled: bool = True
    #: Prefix caching in align mode: keep the state checkpoint at the last
    #: state block edge each request reached while decoding, the state a
    #: follow-up turn resumes from (:mod:`vllm_hybrid.v1.core.pooled.retention`).
    #: Such a checkpoint is the first cached block its pool evicts, so it
    #: never pushes another entry out (docs/pooled-mode.md#turn-end-checkpoints).
    retain_turn_ends: bool = True
    #: Pooled mode: live attention blocks next to the arena's boundary may
    #: move to free blocks elsewhere (the workers copy them before the step)
    #: so that the state pool can grow (:mod:`vllm_hybrid.v1.core.pooled.moves`).
    #: Off, they stay until their request ends; a way out should a custom
    #: worker not apply the moves. Off anyway with a KV connector.
    token_moves: bool = True
    #: Pooled mode, align mode: tokens between the states kept during a
    #: prefill, so a shared prefix hits on its first reuse
    #: (:mod:`vllm_hybrid.v1.core.pooled.policy`); None picks
    #: the interval from the state page and the budget, 0 turns them off.
    prefill_checkpoint_interval: int | None = None
    #: Limits of the single shared pool's page unification.
    page_limits: PageUnificationLimits = PageUnificationLimits()

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> HybridKVOptions:
        """Parse ``vllm_config.additional_config``; raises ValueError naming
        the option and the fix."""
        raw = _raw_options(vllm_config)
        unknown = sorted(set(raw) - KNOWN_OPTIONS)
        if unknown:
            raise ValueError(
                f"Unknown --additional-config {ADDITIONAL_CONFIG_KEY} option(s) "
                f"{unknown}; known options: {sorted(KNOWN_OPTIONS)}"
            )
        flags = {name: raw.get(name, getattr(cls, name)) for name in _FLAGS}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise ValueError(
                    f"--additional-config {ADDITIONAL_CONFIG_KEY}.{name} must be "
                    f"true or false, got {value!r}"
                )
        limits = PageUnificationLimits(
            max_page_padding_pct=_limit(
                raw,
                MAX_PAGE_PADDING_PCT,
                DEFAULT_MAX_PAGE_PADDING_PCT,
                minimum=0.0,
                maximum=100.0,
            ),
            max_page_growth=_limit(
                raw,
                MAX_PAGE_GROWTH,
                DEFAULT_MAX_PAGE_GROWTH,
                minimum=1.0,
                maximum=None,
            ),
        )
        interval = raw.get(PREFILL_CHECKPOINT_INTERVAL)
        if interval is not None and (
            isinstance(interval, bool) or not isinstance(interval, int) or interval < 0
        ):
            raise ValueError(
                f"--additional-config {ADDITIONAL_CONFIG_KEY}."
                f"{PREFILL_CHECKPOINT_INTERVAL} must be a whole number of tokens "
                f"(0 turns prefill checkpoints off), got {interval!r}"
            )
        return cls(page_limits=limits, prefill_checkpoint_interval=interval, **flags)


def options_error(additional_config: Any) -> str | None:
    """Why the ``hybrid_kv`` object in ``additional_config`` (the parsed
    ``--additional-config``) is invalid, or None when it is valid or absent.

    Used before any engine process starts, where the caller wants the message
    rather than an exception from deep inside the engine.
    """
    try:
        HybridKVOptions.from_vllm_config(_AdditionalConfigOnly(additional_config))
    except ValueError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class _AdditionalConfigOnly:
    """A stand-in carrying only ``additional_config``, for :func:`options_error`."""

    additional_config: Any


def _raw_options(vllm_config: Any) -> Mapping[str, Any]:
    """The ``hybrid_kv`` object of ``--additional-config``, or nothing."""
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, Mapping):
        return {}
    options = additional.get(ADDITIONAL_CONFIG_KEY)
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ValueError(
            f"--additional-config {ADDITIONAL_CONFIG_KEY!r} must be a JSON "
            f'object, e.g. \'{{"{ADDITIONAL_CONFIG_KEY}": {{"pooled": false}}}}\', '
            f"got {options!r}"
        )
    return options


def _limit(
    options: Mapping[str, Any],
    key: str,
    default: float,
    minimum: float,
    maximum: float | None,
) -> float:
    """One limit of ``--additional-config``, ``default`` when unset."""
    if key not in options:
        return default
    raw: Any = options[key]
    source = f"--additional-config {ADDITIONAL_CONFIG_KEY}.{key}"
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
