"""The kernel conformance tier (tests/kernels), run from the default suite.

Its tests need Triton's interpreter switched on before any kernel module is
imported, for the whole process, so they run in a pytest process of their
own; this test starts it and fails with its summary when it fails. Run the
tier directly with ``python -m pytest tests/kernels --kernel-tier``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_kernel_conformance_tier_passes():
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/kernels",
            "--kernel-tier",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "--hypothesis-profile=ci",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    tail = "\n".join(proc.stdout.splitlines()[-40:])
    print(tail)
    assert proc.returncode == 0, f"kernel tier failed:\n{tail}\n{proc.stderr[-3000:]}"
    assert " passed" in tail and " failed" not in tail
