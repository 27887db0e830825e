"""Loggers of the overlay, routed through vLLM's logging configuration.

vLLM configures handlers for the ``vllm`` logger tree only, so the overlay's
loggers live under ``vllm.hybrid``: their lines then carry vLLM's format
(process name, pid, level, time, file:line) and obey ``VLLM_LOGGING_LEVEL``
and ``VLLM_LOGGING_CONFIG_PATH`` like every other vLLM line.
"""

from __future__ import annotations

from vllm.logger import init_logger as _vllm_init_logger

_PREFIX = "vllm.hybrid"


def init_logger(name: str):
    """``vllm.logger.init_logger`` for a ``vllm_hybrid`` module name."""
    suffix = name.removeprefix("vllm_hybrid").lstrip(".")
    return _vllm_init_logger(f"{_PREFIX}.{suffix}" if suffix else _PREFIX)
