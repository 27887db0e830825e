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


def overlay_enabled(environ: dict[str, str] | None = None) -> bool:
    """Return whether ``VLLM_HYBRID_KV`` asks for the overlay.

    Raises ``ValueError`` naming the variable and the accepted values when it
    holds anything else, so a typo never silently picks a mode.
    """
    env = os.environ if environ is None else environ
    raw = env.get(SWITCH_VAR)
    if raw is None or raw.strip() == "":
        return True
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(
        f"{SWITCH_VAR}={raw!r} is not understood: set {SWITCH_VAR}=1 (overlay on, "
        f"the default) or {SWITCH_VAR}=0 (pure upstream vLLM)."
    )
