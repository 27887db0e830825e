"""Output files of the tools, checked before any work starts.

``plan``, ``simulate`` and ``make-trace`` write files a user names; a path
that cannot be written would otherwise fail after the work, and lose it. So
each command checks its output paths first and answers a bad one with one
line naming the option.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from vllm_hybrid.tools.plan.errors import PlanError


def check_output(path: Path | None, option: str) -> None:
    """An output file can be written: its directory exists and is writable,
    and the path is not a directory."""
    if path is None:
        return
    parent = path.parent
    if not parent.is_dir():
        raise PlanError(f"{option} {path}: directory {parent} does not exist")
    if path.is_dir():
        raise PlanError(f"{option} {path}: a directory; give a file name")
    if not os.access(parent, os.W_OK):
        raise PlanError(f"{option} {path}: directory {parent} is not writable")


def check_plot(path: Path | None, option: str = "--plot") -> None:
    """A PNG can be written there: matplotlib is installed, the file can be
    written."""
    if path is None:
        return
    if importlib.util.find_spec("matplotlib") is None:
        raise PlanError(f"{option} needs matplotlib: pip install vllm-hybrid[plot]")
    check_output(path, option)
