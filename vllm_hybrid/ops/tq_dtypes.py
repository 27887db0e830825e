"""The TurboQuant KV cache dtypes, in one dependency-free place.

vLLM 0.32's four presets (``vllm.config.cache.CacheDType``). The attention
backend, the platform's selection rule and the numerics
(:mod:`vllm_hybrid.ops.turboquant`) all read this list; it lives outside that
package so that reading it does not import the kernels.
"""

from __future__ import annotations

TQ_CACHE_DTYPES: tuple[str, ...] = (
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
)


def is_turboquant_dtype(kv_cache_dtype: str | None) -> bool:
    return kv_cache_dtype in TQ_CACHE_DTYPES
