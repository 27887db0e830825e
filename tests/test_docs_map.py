"""docs/architecture.md is the one package map, and it names every module of
pooled mode.

A module added to ``vllm_hybrid/v1/core/pooled/`` without a row in the map
fails here, so the map cannot fall behind the package; the modules outside
the package that pooled mode runs through (the workers' half of token moves,
the upstream-path allocation) must be named too. No other page keeps a map.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "vllm_hybrid" / "v1" / "core"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
#: Modules outside ``pooled/`` that pooled mode's path runs through, as the
#: map names them.
ALSO_NAMED = ("v1/worker/token_moves.py", "v1/core/kv_cache_manager.py")


def pooled_modules(core: Path = CORE) -> list[str]:
    """Every module file of the pooled package, as ``pooled/...py``."""
    return sorted(
        str(path.relative_to(core)) for path in (core / "pooled").rglob("*.py")
    )


def unnamed(page: str, modules: list[str]) -> list[str]:
    """The modules the page does not name as code (`` `pooled/x.py` ``)."""
    named = set(re.findall(r"`([\w/]+\.py)`", page))
    return [module for module in modules if module not in named]


def test_the_map_names_every_pooled_module():
    modules = pooled_modules()
    assert "pooled/policy/eviction.py" in modules and "pooled/__init__.py" in modules
    assert unnamed(ARCHITECTURE.read_text(), modules) == []


def test_the_map_names_the_modules_around_the_package():
    assert unnamed(ARCHITECTURE.read_text(), list(ALSO_NAMED)) == []


def test_a_module_missing_from_the_map_is_reported(tmp_path):
    core = tmp_path / "core"
    (core / "pooled" / "policy").mkdir(parents=True)
    for name in ("__init__.py", "spec.py", "planted.py", "policy/eviction.py"):
        (core / "pooled" / name).write_text("")
    page = "| `pooled/__init__.py` | x |\n| `pooled/spec.py` | x |\n"
    page += "`pooled/policy/eviction.py` and pooled/planted.py in plain text\n"
    assert unnamed(page, pooled_modules(core)) == ["pooled/planted.py"]


def maps(page: str) -> bool:
    """Whether ``page`` has a table row naming a package-relative package or
    module (`` `v1/...` ``, `` `pooled/...` ``): a package map."""
    row = r"^\| `(?:v1|pooled|tools|ops|patches|config|platforms)/[\w/.]*`"
    return re.search(row, page, re.M) is not None


def test_no_other_page_keeps_a_package_map():
    """Only the architecture page maps the package (the README's layout
    table names the repository's folders by their full paths)."""
    assert maps(ARCHITECTURE.read_text())
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    others = [p.name for p in pages if p != ARCHITECTURE and maps(p.read_text())]
    assert others == []


def test_a_second_map_is_reported():
    page = "| package | owns |\n|---|---|\n| `v1/core/pooled/` | pooled mode |\n"
    assert maps(page)
    layout = "| path | what |\n|---|---|\n| `vllm_hybrid/v1/core/` | KV |\n"
    assert not maps(layout)
