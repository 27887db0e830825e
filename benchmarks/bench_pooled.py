"""A/B benchmark of the hybrid KV cache: upstream vLLM against the overlay.

One command runs the same workloads twice per model, once with the overlay
switched off (``VLLM_HYBRID_KV=0``, pure upstream vLLM) and once with it on,
under the same KV cache byte budget, then prints overlay/upstream ratios::

    python benchmarks/bench_pooled.py --models qwen3_5,qwen3_next

Each mode runs in its own worker subprocess (this same file started with
``--worker``). The code is the ``pooled`` package next to this file; see its
docstring for the layers and ``benchmarks/README.md`` for the metrics.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script: the repository root takes this folder's place on sys.path,
# so the benchmarks import as the package ``benchmarks``.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.pooled.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
