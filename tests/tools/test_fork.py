"""``vllm-hybrid fork``: the fork regenerated from the cached vLLM sdist and
its structure checked (default tier).

To stay cheap the series is written from a copy of the archive that keeps
what the fork reads and writes (``vllm/``, the tests' Python files,
``cmake/``, ``pyproject.toml``, ``PKG-INFO``): every check below holds
against that copy exactly as against the whole archive, which the extended
tier (tests/tools/test_fork_wheel.py) uses.
"""

from __future__ import annotations

import ast
import fnmatch
import tarfile
from pathlib import Path

import pytest

from vllm_hybrid.tools.fork import checks, options, plan
from vllm_hybrid.tools.fork.build import ForkBuild
from vllm_hybrid.tools.fork.generate import REPO_ROOT
from vllm_hybrid.tools.fork.sdist import find_sdist
from vllm_hybrid.tools.fork.series import git, write_series
from vllm_hybrid.tools.fork.shapes import implied_placement

pytestmark = pytest.mark.slow

#: What the default tier keeps of vLLM's archive.
KEEP = ("vllm/*", "tests/*.py", "cmake/*", "pyproject.toml", "PKG-INFO")


def trim(archive: Path, dest: Path) -> Path:
    with (
        tarfile.open(archive) as src,
        tarfile.open(dest, "w:gz", compresslevel=1) as out,
    ):
        for member in src:
            rel = member.name.split("/", 1)[1] if "/" in member.name else ""
            if rel and any(fnmatch.fnmatchcase(rel, k) for k in KEEP):
                out.addfile(
                    member, src.extractfile(member) if member.isfile() else None
                )
    return dest


@pytest.fixture(scope="module")
def archive(tmp_path_factory) -> Path:
    full = find_sdist(None)
    return trim(full, tmp_path_factory.mktemp("sdist") / full.name)


@pytest.fixture(scope="module")
def series(archive, tmp_path_factory):
    return write_series(archive, tmp_path_factory.mktemp("fork") / "f", REPO_ROOT)


def test_first_commit_is_vllms_tree_unchanged(series, archive):
    assert checks.first_commit_is_the_archive(series, archive) == []
    subject = git(series.root, "log", "-1", "--format=%s", series.base)
    assert subject == "vLLM 0.32.0 as published"


def test_one_commit_per_fix_in_the_plans_order(series):
    assert checks.commits_are_fixes(series) == []
    subjects = [git(series.root, "log", "-1", "--format=%s", c) for c in series.commits]
    assert subjects == [c.subject for c in plan.COMMITS]
    assert len(subjects) >= checks.MIN_FIX_COMMITS


def test_the_patches_apply_in_order_to_a_fresh_copy(series, archive):
    assert len(series.patches) == len(series.commits)
    assert checks.patches_apply_in_order(series, archive) == []


def test_the_forks_vllm_has_nothing_of_the_overlay(series):
    assert checks.no_overlay_in_vllm(series) == []


def test_every_file_the_series_writes_passes_ruff_and_compiles(series):
    assert checks.lint_and_compile(series) == []


def test_every_state_of_the_series_has_what_it_imports(series):
    assert checks.imports_resolve_in_every_state(series.build) == []


def test_the_order_check_sees_a_fix_before_its_options(series, monkeypatch):
    """With the LCM fix first, its module imports the options module that
    only the next commit adds: the check must say so."""
    swapped = (plan.COMMITS[1], plan.COMMITS[0], *plan.COMMITS[2:])
    monkeypatch.setattr(plan, "COMMITS", swapped)
    for module in ("build", "checks"):
        monkeypatch.setattr(
            f"vllm_hybrid.tools.fork.{module}.COMMITS", swapped, raising=False
        )
    base = series.base
    build = ForkBuild(
        REPO_ROOT,
        series.root,
        read_upstream=lambda path: git(series.root, "show", f"{base}:{path}", raw=True),
        with_tests=False,
    )
    problems = checks.imports_resolve_in_every_state(build, upto=1)
    assert any(
        p.startswith("after lcm:") and "vllm.config.hybrid_kv" in p for p in problems
    ), problems


def test_options_are_a_vllm_config_and_an_engine_argument(series):
    text = (series.root / "vllm/config/hybrid_kv.py").read_text()
    cls = next(
        n
        for n in ast.parse(text).body
        if isinstance(n, ast.ClassDef) and n.name == options.CONFIG_CLASS
    )
    fields = {
        s.target.id: ast.unparse(s.value)
        for s in cls.body
        if isinstance(s, ast.AnnAssign)
    }
    assert fields == {r.field: r.default for r in options.option_rows()}
    args = (series.root / "vllm/engine/arg_utils.py").read_text()
    assert f'"{options.ENGINE_ARG}", **vllm_kwargs["{options.CONFIG_FIELD}"]' in args
    # the fork's words never touch vLLM's own text: its --additional-config stays
    assert args.count(f'"{options.ENGINE_ARG}"') == 1
    assert '"--additional-config", **vllm_kwargs["additional_config"]' in args
    assert f"{options.CONFIG_FIELD}=self.{options.CONFIG_FIELD}," in args
    envs = (series.root / "vllm/envs.py").read_text()
    for row in options.variable_rows():
        if row.env is not None:
            assert f'"{row.env}": lambda: os.getenv("{row.env}")' in envs


def test_tests_go_along_into_vllms_tests_tree(series):
    build = series.build
    assert len(build.tests) >= 15
    for test in build.tests:
        assert test.fork_path.startswith("tests/")
        assert (series.root / test.fork_path).is_file()
        assert "vllm_hybrid" not in test.text
    # a test of the registry's mechanism stays here, with its reason
    assert build.tests_left["patches/test_registry.py"].startswith("imports ")
    assert "patches/test_registry.py" not in {t.path for t in build.tests}
    assert build.tests_left["entrypoints/test_faults.py"] == (
        "imports testing, this repository's own (not vLLM's)"
    )


# -- the rules the generator follows --------------------------------------


def test_every_overlay_module_has_a_commit_or_a_reason(series):
    modules = series.build.modules
    assert {m.path for m in modules if m.commit is None} >= {"plugin.py", "cli.py"}
    placed = [m for m in modules if m.commit is not None]
    assert len(placed) >= 50
    assert all(m.fork_path is not None for m in placed)


def test_a_module_no_rule_covers_is_an_error():
    with pytest.raises(LookupError, match="tools/fork/plan.py"):
        plan.commit_of_module("v1/attention/some_new_module.py")


def test_registry_entries_land_with_their_fix_and_their_placement_matches_the_code(
    series,
):
    commits = {
        rep.entry.replacement: plan.COMMITS[i].key
        for i, rep in series.build.replacements
    }
    # the dispatch module's entries go with the fix whose modules they read
    utils = "vllm_hybrid.v1.core.kv_cache_utils"
    assert commits[f"{utils}:unify_kv_cache_spec_page_size"] == "lcm"
    assert commits[f"{utils}:get_kv_cache_configs"] == "scheduling"
    assert commits[f"{utils}:get_kv_cache_capacity"] == "capacity"
    assert (
        commits["vllm_hybrid.v1.worker.routed_experts:initialize_from_config"]
        == "capacity"
    )
    for _, rep in series.build.replacements:
        assert implied_placement(rep) == rep.entry.placement, rep.entry.target


def test_the_option_table_has_a_row_per_option_and_variable(monkeypatch):
    assert options.missing_rows() == []
    from vllm_hybrid.config import hybrid_kv

    monkeypatch.setattr(hybrid_kv, "KNOWN_OPTIONS", hybrid_kv.KNOWN_OPTIONS | {"x"})
    assert options.missing_rows() == ["hybrid_kv.x: no row in FORK_OPTIONS"]


def test_the_fork_loses_only_what_reads_the_switch(series):
    """Code the fork drops because it reads a dropped name: only the
    switch's reader, which has no use without the overlay."""
    assert series.build.cascaded() == {"vllm_hybrid.envs": ["overlay_enabled"]}
