"""The overlay's options checked where an engine's configuration is made.

``EngineArgs.create_engine_config`` runs in the process that asks for an
engine (``LLM(...)``, ``AsyncLLM``, the API server of ``vllm serve``) before
any engine core or worker process exists. The engine itself reads the
``hybrid_kv`` options only in the engine core and the workers, where a bad
value ends in one traceback per process around the message. Checking here
turns it into one ValueError in the caller's process, raised before vLLM
spends time on model inspection, profiling or process start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_hybrid.config.hybrid_kv import options_error
from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.platforms.hybrid_block_size import early_interval_error

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs


class OverlayConfigError(ValueError):
    """A bad overlay option, found before any engine process starts; its
    message is the whole story (``vllm-hybrid`` prints it as one line)."""


def create_engine_config(self: EngineArgs, *args: Any, **kwargs: Any) -> VllmConfig:
    """Upstream's ``create_engine_config`` between the overlay's checks: the
    ``hybrid_kv`` options before it, the state checkpoint interval after it
    (where the block size is known)."""
    problem = options_error(getattr(self, "additional_config", None))
    if problem is not None:
        raise OverlayConfigError(f"vllm-hybrid: {problem}")
    config = upstream_of(__name__, "create_engine_config")(self, *args, **kwargs)
    problem = early_interval_error(config)
    if problem is not None:
        raise OverlayConfigError(f"vllm-hybrid: {problem}")
    return config
