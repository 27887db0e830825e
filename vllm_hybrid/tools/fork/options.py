"""What each of the overlay's options and environment variables becomes in
the fork.

The overlay reads its options from ``--additional-config '{"hybrid_kv":
{...}}'`` (``vllm_hybrid.config.hybrid_kv``) and a few environment variables
(``vllm_hybrid.envs``). In the fork the options are fields of a vLLM config
class, ``HybridKVConfig``, reached as ``vllm_config.hybrid_kv_config`` and
set with ``--hybrid-kv-config '{...}'`` or ``--hybrid-kv-config.NAME VALUE``
like any vLLM config; the environment variables are declared in vLLM's own
``vllm/envs.py`` under vLLM-style names, or disappear where the fork has no
use for them. One row per option and per variable; a test fails when either
module declares one that has no row here, so the table follows the code.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The ``VllmConfig`` field and engine argument of the fork's options.
CONFIG_FIELD = "hybrid_kv_config"
ENGINE_ARG = "--hybrid-kv-config"
CONFIG_CLASS = "HybridKVConfig"


@dataclass(frozen=True)
class ForkOption:
    """One ``hybrid_kv`` option or environment variable of the overlay."""

    #: ``hybrid_kv.NAME`` (an option) or ``$NAME`` (an environment variable).
    overlay: str
    #: What it does, for the config field's docstring and the docs.
    doc: str
    #: The ``HybridKVConfig`` field it becomes (options only), its type and
    #: default as written in the fork. None means unset: the overlay's
    #: default (or its environment fallback) applies, as in the overlay.
    annotation: str | None = None
    default: str | None = None
    #: The fork's environment variable (declared in ``vllm/envs.py``), or
    #: None when the fork has none.
    env: str | None = None
    #: Why a variable has no counterpart in the fork.
    dropped: str | None = None

    @property
    def is_option(self) -> bool:
        return self.overlay.startswith("hybrid_kv.")

    @property
    def name(self) -> str:
        return self.overlay.removeprefix("hybrid_kv.").removeprefix("$")

    @property
    def field(self) -> str | None:
        return self.name if self.is_option else None

    @property
    def engine_arg(self) -> str | None:
        return f"{ENGINE_ARG}.{self.name}" if self.is_option else None


FORK_OPTIONS: tuple[ForkOption, ...] = (
    ForkOption(
        "hybrid_kv.pooled",
        "Keep attention blocks and state pages at their natural sizes in two "
        "block pools that share one KV cache arena (hybrid models only).",
        annotation="bool",
        default="True",
    ),
    ForkOption(
        "hybrid_kv.couple_prefix_caches",
        "With pooled KV caches and prefix caching, evict attention blocks no "
        "cached state checkpoint needs and checkpoints whose attention prefix "
        "is gone.",
        annotation="bool",
        default="True",
    ),
    ForkOption(
        "hybrid_kv.retain_turn_ends",
        "With prefix caching in align mode, keep the state at the last state "
        "block edge each request reached while decoding (the state a "
        "follow-up turn resumes from).",
        annotation="bool",
        default="True",
    ),
    ForkOption(
        "hybrid_kv.prefill_checkpoint_interval",
        "Pooled KV caches in align mode: tokens between the states kept during "
        "a prefill; None picks it from the state page and the budget, 0 keeps "
        "none.",
        annotation="int | None",
        default="None",
    ),
    ForkOption(
        "hybrid_kv.max_page_padding_pct",
        "Single shared pool: the most padding page unification may add to a "
        "state page, in percent of the page; None: VLLM_KV_MAX_PAGE_PADDING_PCT, "
        "else 2.",
        annotation="float | None",
        default="None",
    ),
    ForkOption(
        "hybrid_kv.max_page_growth",
        "Single shared pool: the largest common page as a multiple of the "
        "model's largest page; None: VLLM_KV_MAX_PAGE_GROWTH, else 16.",
        annotation="float | None",
        default="None",
    ),
    ForkOption(
        "$VLLM_HYBRID_KV",
        "The overlay's switch.",
        dropped=(
            "the fork is vLLM itself; pooled KV caches are switched off with "
            "--hybrid-kv-config.pooled false"
        ),
    ),
    ForkOption(
        "$VLLM_HYBRID_TQ_NATIVE",
        "0 runs the TurboQuant CPU backend on its torch implementation instead "
        "of the compiled kernel.",
        env="VLLM_CPU_TQ_NATIVE",
    ),
    ForkOption(
        "$VLLM_HYBRID_MAX_PAGE_PADDING_PCT",
        "The environment's max_page_padding_pct, where the config sets none.",
        env="VLLM_KV_MAX_PAGE_PADDING_PCT",
    ),
    ForkOption(
        "$VLLM_HYBRID_MAX_PAGE_GROWTH",
        "The environment's max_page_growth, where the config sets none.",
        env="VLLM_KV_MAX_PAGE_GROWTH",
    ),
    ForkOption(
        "$VLLM_HYBRID_STATS_DIR",
        "Where the engine core leaves per-pool usage for the frontend's "
        "/metrics gauges.",
        dropped="the per-pool /metrics gauges are not part of the fork",
    ),
    ForkOption(
        "$VLLM_HYBRID_SKIP_NATIVE",
        "Skips building the TurboQuant CPU kernel at install.",
        dropped="the kernel builds with vLLM's own CMake, like every CPU kernel",
    ),
    ForkOption(
        "$VLLM_HYBRID_DECODE_EDGES",
        "Pooled KV caches: which state block edges a decoding request keeps a "
        "state at (budget_end, every, none).",
        env="VLLM_KV_DECODE_EDGES",
    ),
    ForkOption(
        "$VLLM_HYBRID_ADMISSION_GROWTH",
        "Pooled KV caches: admission's growth reserve in state pages of tokens.",
        env="VLLM_KV_ADMISSION_GROWTH",
    ),
    ForkOption(
        "$VLLM_HYBRID_PREFILL_PACING",
        "Pooled KV caches: how many prompt tokens a step computes "
        "(state_page, fill, deep_page).",
        env="VLLM_KV_PREFILL_PACING",
    ),
    ForkOption(
        "$VLLM_HYBRID_STATE_EVICTION_WINDOW",
        "Pooled KV caches: oldest cached state blocks among which the state "
        "pool evicts the one farthest from the boundary.",
        env="VLLM_KV_STATE_EVICTION_WINDOW",
    ),
    ForkOption(
        "$VLLM_HYBRID_ARENA_SPLIT",
        "Pooled KV caches: when the arena's boundary moves (costed, misses, "
        "recency, demand).",
        env="VLLM_KV_ARENA_SPLIT",
    ),
    ForkOption(
        "$VLLM_HYBRID_BOUNDARY_CLEAR",
        "Pooled KV caches: state blocks' worth of token ids next to the "
        "boundary kept clear of new token blocks.",
        env="VLLM_KV_BOUNDARY_CLEAR",
    ),
    ForkOption(
        "$VLLM_HYBRID_TOKEN_MOVES",
        "Pooled KV caches: 0 keeps live token blocks where they are instead of "
        "moving them off the boundary.",
        env="VLLM_KV_TOKEN_MOVES",
    ),
)


def option_rows() -> list[ForkOption]:
    return [row for row in FORK_OPTIONS if row.is_option]


def variable_rows() -> list[ForkOption]:
    return [row for row in FORK_OPTIONS if not row.is_option]


def fork_variable_names() -> dict[str, str | None]:
    """Overlay variable -> the fork's variable (None: dropped)."""
    return {row.name: row.env for row in variable_rows()}


def missing_rows() -> list[str]:
    """Options and variables the overlay declares that have no row (the
    test's check), and rows the overlay no longer declares."""
    from vllm_hybrid import envs
    from vllm_hybrid.config.hybrid_kv import KNOWN_OPTIONS

    declared = {f"hybrid_kv.{name}" for name in KNOWN_OPTIONS}
    declared |= {f"${name}" for name in envs.OVERLAY_ENV_VARS}
    rows = {row.overlay for row in FORK_OPTIONS}
    problems = [f"{name}: no row in FORK_OPTIONS" for name in sorted(declared - rows)]
    problems += [
        f"{name}: row for nothing declared" for name in sorted(rows - declared)
    ]
    for row in FORK_OPTIONS:
        if row.is_option and (row.annotation is None or row.default is None):
            problems.append(f"{row.overlay}: an option needs its field's type")
        if not row.is_option and (row.env is None) == (row.dropped is None):
            problems.append(f"{row.overlay}: needs exactly one of env and dropped")
    return problems
