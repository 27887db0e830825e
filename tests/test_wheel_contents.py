"""The wheel ships the product only: test and benchmark fixtures stay out.

The fixtures live in the repository's ``testing/`` folder, beside
``tests/`` and ``benchmarks/``, outside the ``vllm_hybrid`` package that
pyproject lists. These tests build the wheel from a copy of the checkout
(the native kernel skipped, so it takes seconds) and read its file list:
no fixture module is in it, by the names of the modules that moved out of
the package or by a name that marks a fixture, and nothing but the package
and its metadata sits at its top level. No module of the package imports
``testing``: an installed package would fail on that import.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "vllm_hybrid"
FIXTURES = "testing"
#: Fixture modules that once shipped in ``vllm_hybrid/tools`` and now live
#: in ``testing/``; none of these names may appear anywhere in the wheel.
MOVED = ("loopback", "inproc", "tiny_eagle", "shaped_models")
#: A path part (folder or module name) that marks a test fixture.
FIXTURE_NAME = re.compile(
    r"(test_\w+|\w+_test|tests?|testing|conftest|fixtures?|mocks?|fakes?|stubs?)"
)
#: Folders and files of a checkout that a build never reads.
NOT_SOURCE = shutil.ignore_patterns(
    ".*", "__pycache__", "build", "dist", "*.egg-info", "*.so"
)


def fixture_files(names: list[str]) -> list[str]:
    """Entries of a wheel's file list that are test fixtures or lie outside
    the package and its metadata, in the list's order."""
    found = []
    for name in names:
        top, _, rest = name.partition("/")
        if top.endswith(".dist-info"):
            continue
        if top != PACKAGE:
            found.append(name)
            continue
        if not name.endswith(".py"):
            continue
        parts = rest.removesuffix(".py").split("/")
        if parts[-1] in MOVED or any(FIXTURE_NAME.fullmatch(p) for p in parts):
            found.append(name)
    return found


def copy_checkout(dest: Path) -> None:
    """The files of this checkout a build can see: those git tracks or
    would track (ignored ones left out), else the tree without caches,
    build outputs and dot-folders."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout.decode()
    except (OSError, subprocess.SubprocessError):
        shutil.copytree(ROOT, dest, ignore=NOT_SOURCE)
        return
    for rel in filter(None, listed.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> list[str]:
    """The file list of a wheel built from this checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    source, out = tmp / "source", tmp / "out"
    copy_checkout(source)
    env = dict(os.environ, VLLM_HYBRID_SKIP_NATIVE="1")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--quiet", "--wheel-dir", str(out), str(source)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def test_the_wheel_holds_no_test_fixture(wheel_files):
    assert fixture_files(wheel_files) == []
    # the build did run: the product's tools are there, the fixtures' home is not
    assert f"{PACKAGE}/tools/verify.py" in wheel_files
    assert f"{PACKAGE}/tools/tiny_models.py" in wheel_files
    assert not [n for n in wheel_files if n.startswith(f"{FIXTURES}/")]


def test_the_fixtures_live_outside_the_package():
    for name in MOVED:
        assert (ROOT / FIXTURES / f"{name}.py").is_file(), name
        assert not list((ROOT / PACKAGE).rglob(f"{name}.py")), name


def test_the_fixture_check_names_each_fixture():
    names = [
        "vllm_hybrid/__init__.py",
        "vllm_hybrid/tools/verify.py",
        "vllm_hybrid/tools/loopback.py",
        "vllm_hybrid/v1/inproc.py",
        "vllm_hybrid/tools/test_plan.py",
        "vllm_hybrid/testing/engines.py",
        "vllm_hybrid/ops/fake_ops.py",
        "vllm_hybrid/ops/fakes.py",
        "vllm_hybrid/tools/plan/preset_configs/qwen.json",
        "vllm_hybrid-0.1.0.dist-info/METADATA",
        "testing/__init__.py",
        "benchmarks/harness.py",
    ]
    assert fixture_files(names) == [
        "vllm_hybrid/tools/loopback.py",
        "vllm_hybrid/v1/inproc.py",
        "vllm_hybrid/tools/test_plan.py",
        "vllm_hybrid/testing/engines.py",
        "vllm_hybrid/ops/fakes.py",
        "testing/__init__.py",
        "benchmarks/harness.py",
    ]


def imports_of_fixtures(root: Path) -> list[str]:
    """``module: imported`` for every import of the fixtures' package in the
    modules under ``root`` (``TYPE_CHECKING`` blocks included)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                targets = [node.module or ""]
            else:
                continue
            rel = path.relative_to(root.parent).as_posix()
            found += [
                f"{rel}: {t}"
                for t in targets
                if t == FIXTURES or t.startswith(FIXTURES + ".")
            ]
    return found


def test_the_package_imports_no_fixture():
    assert imports_of_fixtures(ROOT / PACKAGE) == []


def test_the_import_check_names_each_import(tmp_path):
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "a.py").write_text(
        "import testing.loopback\n"
        "from testing import inproc\n"
        "from testing_extra import x\n"
        "from . import testing\n"
        "def f():\n"
        "    from testing.tiny_eagle import build_eagle_draft\n"
    )
    assert imports_of_fixtures(package) == [
        "vllm_hybrid/a.py: testing.loopback",
        "vllm_hybrid/a.py: testing",
        "vllm_hybrid/a.py: testing.tiny_eagle",
    ]
