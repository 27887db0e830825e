"""Environment variables read by the overlay.

``VLLM_HYBRID_KV`` is the run-time switch: unset or ``1`` means the overlay
is active, ``0`` gives pure upstream vLLM in the same process setup, which is
what A/B benchmarks rely on.
"""

from __future__ import annotations

import os

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


#: Directory of the per-pool usage snapshots an engine core writes and its
#: frontend's stat logger reads (:mod:`vllm_hybrid.v1.metrics.pool_snapshots`).
STATS_DIR_VAR = "VLLM_HYBRID_STATS_DIR"
#: Build time only (setup.py skips the native kernel); harmless when set later.
SKIP_NATIVE_VAR = "VLLM_HYBRID_SKIP_NATIVE"


#: Every variable the overlay reads. vLLM warns about (or, with hard failing
#: enabled, rejects) ``VLLM_*`` variables it does not know.
OVERLAY_ENV_VARS = (
    SWITCH_VAR,
    TQ_NATIVE_VAR,
    STATS_DIR_VAR,
    SKIP_NATIVE_VAR,
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
