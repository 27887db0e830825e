"""``python benchmarks/serve [options]``: see :mod:`serve.cli`."""

import sys
from pathlib import Path

# Run as a folder: its parent goes on sys.path so the package imports as ``serve``.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serve.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
