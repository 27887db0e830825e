"""Attention backend selection on CPU for TurboQuant KV cache dtypes.

``CpuPlatform.get_attn_backend_cls`` returns ``CPU_ATTN`` for every non-MLA
layer, whatever ``--kv-cache-dtype`` asks for, and CPU_ATTN cannot store the
``turboquant_*`` presets. The overlay routes those layers to its
``CPU_TURBOQUANT`` backend (registered through vLLM's backend registry) and
leaves every other choice to upstream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.attention.backend import AttentionType

from vllm_hybrid.logger import init_logger
from vllm_hybrid.ops.tq_dtypes import is_turboquant_dtype
from vllm_hybrid.patches.registry import upstream_of
from vllm_hybrid.v1.attention.backends.cpu_turboquant_attn import BACKEND_NAME

if TYPE_CHECKING:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

logger = init_logger(__name__)

#: Class path registered under :data:`BACKEND_NAME`.
BACKEND_PATH = (
    "vllm_hybrid.v1.attention.backends.cpu_turboquant_attn."
    "CPUTurboQuantAttentionBackend"
)

#: When the CPU TurboQuant backend is chosen, for error messages.
SELECTION_RULE = (
    f"on CPU, vllm-hybrid selects {BACKEND_NAME} for turboquant_* cache dtypes "
    "on decoder attention layers (not MLA or sparse, no sliding window, no "
    "attention sinks, power-of-two head size) unless another "
    "--attention-backend is requested"
)


def register_backend() -> None:
    """Add ``CPU_TURBOQUANT`` to ``AttentionBackendEnum``; idempotent.

    Enum members cannot be removed again; an unselected member is inert, so
    it stays when the overlay is deactivated.
    """
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_PATH)


def takes_turboquant(attn_selector_config: AttentionSelectorConfig) -> bool:
    """Whether a layer with this selector config runs on CPU_TURBOQUANT."""
    cfg = attn_selector_config
    head = cfg.head_size
    return (
        is_turboquant_dtype(cfg.kv_cache_dtype)
        and not cfg.use_mla
        and not cfg.use_sparse
        and not cfg.has_sink
        and not cfg.has_sliding_window
        and cfg.attn_type == AttentionType.DECODER
        and head > 0
        and head & (head - 1) == 0
    )


def _get_attn_backend_cls(
    cls,
    selected_backend: AttentionBackendEnum | None,
    attn_selector_config: AttentionSelectorConfig,
    num_heads: int | None = None,
) -> str:
    requested = getattr(selected_backend, "name", None)
    if requested in (None, BACKEND_NAME) and takes_turboquant(attn_selector_config):
        logger.info_once(
            "Using %s backend for kv_cache_dtype=%s.",
            BACKEND_NAME,
            attn_selector_config.kv_cache_dtype,
        )
        return BACKEND_PATH
    return upstream_of(__name__, "get_attn_backend_cls").__func__(
        cls, selected_backend, attn_selector_config, num_heads
    )


get_attn_backend_cls = classmethod(_get_attn_backend_cls)
