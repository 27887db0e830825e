"""Where each module of the overlay goes in the fork.

A module moves to the same path under ``vllm/`` (``vllm_hybrid/v1/core/
pooled/arena.py`` becomes ``vllm/v1/core/pooled/arena.py``). Where vLLM
already has a module at that path, :data:`AT_UPSTREAM_PATHS` decides: the
module's definitions join vLLM's module (:data:`MERGE`, for modules of
dispatch helpers), or the module takes another path. Package ``__init__``
modules at paths vLLM has are vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vllm_hybrid.tools.fork.plan import ForkCommit, commit_of_module

PACKAGE = "vllm_hybrid"
#: The definitions of such a module join vLLM's module at the same path.
MERGE = "merge"

#: Our modules at a path vLLM already has.
AT_UPSTREAM_PATHS: dict[str, str] = {
    "v1/core/kv_cache_utils.py": MERGE,
    "v1/core/kv_cache_coordinator.py": MERGE,
    "v1/core/kv_cache_manager.py": MERGE,
    "v1/worker/cpu_worker.py": MERGE,
    "v1/core/sched/scheduler.py": "v1/core/sched/pooled_scheduler.py",
    "v1/core/sched/async_scheduler.py": "v1/core/sched/pooled_async_scheduler.py",
    "platforms/cpu.py": "platforms/cpu_turboquant.py",
    "v1/attention/selector.py": "v1/attention/kv_cache_dtype_check.py",
    "v1/engine/async_llm.py": "v1/engine/shutdown.py",
    "envs.py": "config/hybrid_kv_envs.py",
}


@dataclass(frozen=True)
class OverlayModule:
    """One module of the overlay, with its place in the fork."""

    #: Path relative to the package, e.g. ``v1/core/pooled/arena.py``.
    path: str
    commit: ForkCommit | None
    #: Path under ``vllm/`` in the fork (for merged modules: vLLM's module
    #: they join); None when the module is not in the fork.
    fork_path: str | None
    merged: bool = False

    @property
    def name(self) -> str:
        return dotted(PACKAGE, self.path)

    @property
    def fork_name(self) -> str | None:
        return None if self.fork_path is None else dotted("vllm", self.fork_path)


def dotted(package: str, path: str) -> str:
    """``v1/core/x.py`` -> ``package.v1.core.x`` (``__init__`` -> the package)."""
    parts = [package, *Path(path).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def overlay_modules(
    package_root: Path, upstream_has: Callable[[str], bool]
) -> list[OverlayModule]:
    """Every module of the overlay (``package_root``), placed against vLLM's
    package (``upstream_has(path)``: whether ``vllm/path`` exists there).
    Raises LookupError for a module that no commit rule covers or that would
    overwrite one of vLLM's modules."""
    modules = []
    for file in sorted(package_root.rglob("*.py")):
        path = file.relative_to(package_root).as_posix()
        at_upstream = upstream_has(path)
        if path.endswith("__init__.py") and at_upstream:
            modules.append(OverlayModule(path, None, None))
            continue
        commit = commit_of_module(path)
        if commit is None:
            modules.append(OverlayModule(path, None, None))
            continue
        if at_upstream:
            if path not in AT_UPSTREAM_PATHS:
                raise LookupError(
                    f"vllm_hybrid/{path} is at a path vLLM already has: add it to "
                    "AT_UPSTREAM_PATHS in vllm_hybrid/tools/fork/modules.py"
                )
            target = AT_UPSTREAM_PATHS[path]
            if target == MERGE:
                modules.append(OverlayModule(path, commit, path, merged=True))
                continue
            if upstream_has(target):
                raise LookupError(f"{target} (for vllm_hybrid/{path}) exists in vLLM")
            modules.append(OverlayModule(path, commit, target))
            continue
        modules.append(OverlayModule(path, commit, path))
    return modules
