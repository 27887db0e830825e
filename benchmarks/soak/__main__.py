"""``python benchmarks/soak [options]``: see :mod:`benchmarks.soak.cli`."""

import sys
from pathlib import Path

# Run as a folder: the repository root takes the folder's place on sys.path,
# so the benchmarks import as the package ``benchmarks``.
sys.path[0] = str(Path(__file__).resolve().parents[2])

from benchmarks.soak.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
