"""A/B benchmark of the hybrid KV cache: upstream vLLM against the overlay.

Workers are this file started with ``--worker``; the code is the ``pooled``
package next to it, the metrics are described in ``docs/benchmarks.md``.
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
