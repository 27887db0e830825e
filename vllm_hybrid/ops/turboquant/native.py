"""Loader and wrappers for the native TurboQuant CPU kernel.

``pip install`` builds ``_tq_cpu*.so`` next to this file (see setup.py) and
writes ``_tq_cpu.json`` with the torch version it was compiled against. The
library is only loaded when that version equals the running torch: a
mismatched C++ ABI could load and then crash, so it is refused with one log
line and the torch reference is used instead.

The wrappers keep the parts whose floating-point result depends on
summation order (key norms, Hadamard rotations) in torch, shared with the
reference, so store() writes the same bytes on both paths.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch

from vllm_hybrid.logger import init_logger
from vllm_hybrid.ops.turboquant import reference
from vllm_hybrid.ops.turboquant.layout import TQLayout, hadamard, key_tables

logger = init_logger(__name__)

_HERE = Path(__file__).resolve().parent
BUILD_INFO = _HERE / "_tq_cpu.json"


def library_path() -> Path | None:
    """The built library, or None when the build did not produce one."""
    found = sorted(_HERE.glob("_tq_cpu*.so"))
    return found[0] if found else None


@cache
def available() -> bool:
    """Load the library once; False (and one log line) when unusable."""
    return try_load(library_path(), BUILD_INFO)


def try_load(path: Path | None, info: Path) -> bool:
    """Load ``path`` if ``info`` says it was built for the running torch."""
    if path is None:
        logger.info("TurboQuant native kernel not built; using the torch path")
        return False
    try:
        built_for = json.loads(info.read_text())["torch"]
    except (OSError, ValueError, KeyError):
        built_for = None
    if built_for != torch.__version__:
        logger.warning(
            "TurboQuant native kernel %s was built for torch %s, running %s; "
            "using the torch path (reinstall to rebuild)",
            path.name,
            built_for,
            torch.__version__,
        )
        return False
    try:
        torch.ops.load_library(str(path))
        torch.ops.vllm_hybrid_tq.build_info()
    except (OSError, RuntimeError, AttributeError) as exc:
        logger.warning("TurboQuant native kernel failed to load (%s)", exc)
        return False
    return True


def _ops():
    if not available():
        raise RuntimeError("the native TurboQuant kernel is not available")
    return torch.ops.vllm_hybrid_tq


def store(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layout: TQLayout,
) -> None:
    """Native counterpart of :func:`reference.store` (same bytes)."""
    reference._check_cache(kv_cache, layout)
    key, value, slot_mapping = reference.select_tokens(key, value, slot_mapping)
    n, h, d = key.shape
    if n == 0:
        return
    k = key.reshape(n * h, d).float()
    v = value.reshape(n * h, d).float().contiguous()
    if layout.key_fp8:
        norms, mids = torch.empty(0), torch.empty(0)
        k = k.contiguous()
    else:
        norms, k = reference.rotate_keys(k, layout)
        _, mids = key_tables(layout)
        k = k.contiguous()
    _ops().store(
        k,
        norms.contiguous(),
        v,
        kv_cache,
        slot_mapping.to(torch.int64),
        mids,
        layout.key_bits,
        layout.value_bits,
        layout.key_fp8,
        layout.key_bytes,
    )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    layout: TQLayout,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Native counterpart of :func:`reference.paged_attention`."""
    reference._check_cache(kv_cache, layout)
    q = query.float()
    if layout.key_fp8:
        cents = torch.empty(0)
    else:
        # Scores are taken in the rotated space: (q H) . c == q . (c H).
        q = q @ hadamard(layout.head_dim)
        cents, _ = key_tables(layout)
    result = _ops().paged_attention(
        q.contiguous(),
        kv_cache,
        block_table.to(torch.int32),
        seq_lens.to(torch.int32),
        query_start_loc.to(torch.int32),
        float(scale),
        cents,
        layout.key_bits,
        layout.value_bits,
        layout.key_fp8,
        layout.norm_correction,
        layout.key_bytes,
    )
    if out is None:
        return result.to(query.dtype)
    out.view(query.shape).copy_(result)  # out may be a flat [N, Hq * D] buffer
    return out
