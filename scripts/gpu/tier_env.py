"""Process set-up shared by the device run's parts that call upstream kernels.

The parts reuse the kernel tier's helpers (``tests/kernels``: arenas built by
the overlay's planner and upstream's ``allocate_kv_cache``, the GDN layer's
calls, the align-mode copy paths) instead of re-deriving them. On a GPU those
run compiled on CUDA tensors; without one (the CPU rehearsal) they run in
Triton's interpreter, switched on exactly as ``tests/kernels/conftest.py``
does, before any kernel module is imported.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "tests" / "kernels"


def prepare() -> str:
    """The tier's helpers on ``sys.path``; returns ``"cuda"`` or
    ``"interpreter"`` (how kernels run in this process)."""
    if str(KERNELS) not in sys.path:
        sys.path.insert(0, str(KERNELS))
    import torch

    if torch.cuda.is_available():
        return "cuda"
    import triton_interpreter

    triton_interpreter.enable()
    import interpreter_quirks

    interpreter_quirks.apply()
    return "interpreter"


def write_json(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")


def run_bounded(command: list[str], timeout: float, **kwargs) -> tuple[int | None, str]:
    """Run ``command`` in a process group of its own, killing the whole
    group (pytest workers, engine processes) after ``timeout`` seconds.
    Returns its exit code (None when it was killed) and its output."""
    import os
    import signal
    import subprocess

    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **kwargs,
    )
    try:
        output, _ = proc.communicate(timeout=max(timeout, 1))
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output
