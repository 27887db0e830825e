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
    #: The ``HybridKVConfig`` field it becomes (options only): its type and
    #: its default, an expression of the options' module (the overlay's own
    #: default constant where it has one).
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
        "hybrid_kv.retain_turn_ends",
        "With prefix caching in align mode, keep the state at the last state "
        "block edge each request reached while decoding (the state a "
        "follow-up turn resumes from).",
        annotation="bool",
        default="True",
    ),
    ForkOption(
        "hybrid_kv.token_moves",
        "Pooled KV caches: live attention blocks next to the arena's boundary "
        "may move to free blocks elsewhere so that the state pool can grow "
        "(off with a KV connector).",
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
        "state page, in percent of the page.",
        annotation="float",
        default="DEFAULT_MAX_PAGE_PADDING_PCT",
    ),
    ForkOption(
        "hybrid_kv.max_page_growth",
        "Single shared pool: the largest common page as a multiple of the "
        "model's largest page.",
        annotation="float",
        default="DEFAULT_MAX_PAGE_GROWTH",
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
    from vllm_hybrid.config import hybrid_kv
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
        elif row.is_option and row.name in KNOWN_OPTIONS:
            default = eval(row.default, vars(hybrid_kv))  # noqa: S307 - table text
            if default != overlay_default(row.name):
                problems.append(
                    f"{row.overlay}: the fork's default {default!r} is not the "
                    f"overlay's {overlay_default(row.name)!r}"
                )
        if not row.is_option and (row.env is None) == (row.dropped is None):
            problems.append(f"{row.overlay}: needs exactly one of env and dropped")
    return problems


def overlay_default(name: str) -> object:
    """The overlay's default of the ``hybrid_kv`` option ``name``."""
    from vllm_hybrid.config.hybrid_kv import HybridKVOptions

    options = HybridKVOptions()
    if hasattr(options.page_limits, name):
        return getattr(options.page_limits, name)
    return getattr(options, name)
