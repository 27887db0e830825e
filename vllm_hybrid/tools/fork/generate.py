"""``vllm-hybrid fork`` end to end: archive in, repository, patches and
(optionally) wheel out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm_hybrid.tools.fork.sdist import find_sdist
from vllm_hybrid.tools.fork.series import Series, git, write_series
from vllm_hybrid.tools.fork.wheel import splice_wheel

#: This repository (the overlay's package, tests and kernel sources).
REPO_ROOT = Path(__file__).resolve().parents[3]
WHEEL_DIR = "dist"


@dataclass(frozen=True)
class Materialized:
    series: Series
    wheel: Path | None


def materialize(
    out_dir: Path, sdist: Path | None = None, *, wheel: bool = False
) -> Materialized:
    if not (REPO_ROOT / "csrc").is_dir():
        raise FileNotFoundError(
            f"{REPO_ROOT} has no csrc/: vllm-hybrid fork runs from a checkout of "
            "this repository (it reads its tests and kernel sources too)"
        )
    archive = find_sdist(sdist)
    series = write_series(archive, out_dir, REPO_ROOT)
    built = None
    if wheel:
        built = splice_wheel(out_dir, changed_files(series), out_dir / WHEEL_DIR)
    return Materialized(series, built)


def changed_files(series: Series) -> list[str]:
    """Paths the series adds or changes (relative to the tree's root)."""
    names = git(
        series.root, "diff", "--name-only", "--diff-filter=AM", f"{series.base}..HEAD"
    )
    return [line for line in names.splitlines() if line]
