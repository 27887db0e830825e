"""Refuse an attention backend that cannot store the KV cache dtype.

vLLM 0.32's selector returns whatever the platform picks; the CPU platform
never checks ``--kv-cache-dtype`` against the backend, so ``CPU_ATTN`` was
handed ``turboquant_*`` pages it writes plain bf16 into (segfaults in
``reshape_and_cache``, silent corruption). Every attention layer's backend
goes through ``_cached_get_attn_backend`` with the layer's own cache dtype
(after ``kv_cache_dtype_skip_layers``), during model construction, before
any KV cache exists: the narrowest point at which the pair is known.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_hybrid.logger import init_logger
from vllm_hybrid.patches.registry import upstream_of

if TYPE_CHECKING:
    from vllm.config.cache import CacheDType
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

logger = init_logger(__name__)


class UnsupportedKVCacheDtypeError(ValueError):
    """The selected attention backend cannot store the requested dtype."""


def unsupported_dtype_message(
    backend: type[AttentionBackend], kv_cache_dtype: str
) -> str:
    """One sentence naming the backend, the dtype and what works."""
    name = backend.get_name()
    supported = [
        str(d)
        for d in getattr(backend, "supported_kv_cache_dtypes", [])
        if backend.supports_kv_cache_dtype(d)
    ]
    message = (
        f"{name} cannot store kv_cache_dtype={kv_cache_dtype!r}; it supports "
        f"{', '.join(supported) or 'no listed dtype'}."
    )
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm_hybrid.platforms.cpu import SELECTION_RULE

        message += f" Note: {SELECTION_RULE}."
    return message + " Start with one of the supported dtypes."


def check_kv_cache_dtype(
    backend: type[AttentionBackend], kv_cache_dtype: str | None
) -> None:
    """Raise :class:`UnsupportedKVCacheDtypeError` unless the backend stores
    ``kv_cache_dtype``.

    Only quantized dtypes (fp8, int8/int4, nvfp4, TurboQuant, UltraQuant) are
    checked: their pages have a format a backend must know. ``auto`` and the
    plain float names are stored as ordinary K/V by every backend, although
    some backends (CPU_ATTN) do not list them, and refusing them would break
    working set-ups.
    """
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache

    if kv_cache_dtype is None or not is_quantized_kv_cache(kv_cache_dtype):
        return
    if backend.supports_kv_cache_dtype(kv_cache_dtype):
        return
    raise UnsupportedKVCacheDtypeError(
        unsupported_dtype_message(backend, kv_cache_dtype)
    )


def _cached_get_attn_backend(
    backend: AttentionBackendEnum | None,
    attn_selector_config: AttentionSelectorConfig,
    num_heads: int | None = None,
    *,
    _run_kv_cache_dtype: CacheDType | None = None,
) -> type[AttentionBackend]:
    selected = upstream_of(__name__, "cached_get_attn_backend")(
        backend,
        attn_selector_config,
        num_heads,
        _run_kv_cache_dtype=_run_kv_cache_dtype,
    )
    check_kv_cache_dtype(selected, attn_selector_config.kv_cache_dtype)
    return selected


def _cache_clear() -> None:
    upstream_of(__name__, "cached_get_attn_backend").cache_clear()


# Upstream's function is functools.cache'd; keep its cache handle reachable.
_cached_get_attn_backend.cache_clear = _cache_clear  # type: ignore[attr-defined]
cached_get_attn_backend = _cached_get_attn_backend
