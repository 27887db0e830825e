"""vLLM's own tests selected by what the patch registry replaces
(tests_upstream/select_tests.py, scan_tests.py, selection.json and the "Not
run" table of docs/upstream-tests.md)."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_hybrid import SUPPORTED_VLLM_VERSION
from vllm_hybrid.patches.entries import CLI_PATCHES, PATCHES

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = ROOT / "tests_upstream"
DOC = ROOT / "docs" / "upstream-tests.md"


def _load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, UPSTREAM / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and select_tests look it up
        spec.loader.exec_module(module)
    return sys.modules[name]


scan_tests = _load("scan_tests")
select_tests = _load("select_tests")


# ---------------------------------------------------------------------------
# The committed selection against the registry and the fetched tests
# ---------------------------------------------------------------------------


def test_every_plugin_entry_has_its_row_and_nothing_else():
    """A new registry entry fails here until ``select_tests.py write`` has
    scanned vLLM's tests for it; CLI entries never apply in a test process."""
    selection = select_tests.load()
    assert selection["vllm"] == SUPPORTED_VLLM_VERSION
    assert list(selection["entries"]) == [e.target for e in PATCHES]
    assert not {e.target for e in CLI_PATCHES} & set(selection["entries"])
    for nodes in selection["entries"].values():
        assert nodes == sorted(set(nodes))
        assert all(n.startswith("tests/") and "::" in n for n in nodes)


def _fetched() -> Path:
    cache = Path(os.environ.get("UPSTREAM_TESTS_DIR") or ROOT / ".upstream-tests")
    src = cache / f"vllm-{SUPPORTED_VLLM_VERSION}"
    if not (src / ".complete").exists():
        pytest.skip(
            f"vLLM's tests are not fetched to {src} "
            "(bash scripts/upstream_tests.sh fetch; scripts/test.sh does)"
        )
    return src


def test_the_selection_is_what_a_fresh_scan_finds():
    """Fails, naming entry and test, when a test touching an entry is
    missing from selection.json or one listed there no longer touches it."""
    problems = select_tests.differences(
        select_tests.load(), select_tests.fresh(_fetched())
    )
    assert problems == []


def test_the_issue_that_brought_the_selection_is_in_it():
    """vLLM's check of the Mamba block guard while profiling calls the
    replaced resolution with a stand-in KV cache config."""
    entries = select_tests.load()["entries"]
    target = (
        "vllm.config.compilation:CompilationConfig.resolve_cudagraph_mode_and_sizes"
    )
    assert (
        "tests/test_config.py::"
        "test_resolve_cudagraph_mode_skips_mamba_block_check_while_profiling"
    ) in entries[target]


def test_not_run_rows_have_reasons_and_match_selected_tests():
    not_run = select_tests.parse_not_run(DOC.read_text())
    assert len(not_run) >= 10
    assert all(row.reason for row in not_run)
    assert select_tests.stale_rows(select_tests.load(), not_run) == []


def test_the_run_list_leaves_out_core_and_not_run_rows():
    selection = {
        "entries": {
            "m:f": ["tests/v1/core/test_a.py::test_x", "tests/b.py::test_y"],
            "m:g": ["tests/b.py::test_y", "tests/c.py::test_z", "tests/d.py::t"],
        }
    }
    not_run = select_tests.parse_not_run(
        "## Not run\n\n| node id | reason |\n| --- | --- |\n"
        "| `tests/c.py::*` | needs a GPU |\n\n## Next\n\n| `tests/d.py::t` | no |\n"
    )
    assert [r.pattern for r in not_run] == ["tests/c.py::*"]
    assert select_tests.run_list(selection, not_run) == [
        "tests/b.py::test_y",
        "tests/d.py::t",
    ]
    gone = [select_tests.NotRun("tests/e.py", "gone")]
    assert select_tests.stale_rows(selection, not_run + gone) == ["tests/e.py"]


def test_differences_name_missing_and_extra_tests_and_entries():
    committed = {"entries": {"m:f": ["t.py::a", "t.py::old"], "m:gone": []}}
    fresh = {"m:f": ["t.py::a", "t.py::b"], "m:new": ["u.py::c"]}
    assert select_tests.differences(committed, fresh) == [
        "m:f: missing t.py::b",
        "m:f: no longer touches it: t.py::old",
        "m:gone: in the selection but not in the registry",
        "m:new: registry entry missing from the selection",
    ]


# ---------------------------------------------------------------------------
# The scan rule, on a tree written here
# ---------------------------------------------------------------------------

FILES = {
    # direct call, by name and through the module; a string patch target
    "tests/test_direct.py": """
        from pkg.mod import f
        import pkg.mod as mod
        from unittest import mock

        def test_call():
            f(1)

        def test_module_attr():
            mod.f(2)

        def test_patched():
            with mock.patch("pkg.mod.f"):
                pass

        def test_other():
            mod.g()
    """,
    # a helper and a fixture of the file, followed to a fixed point
    "tests/test_helpers.py": """
        import pytest
        from pkg import mod

        def helper():
            return mod.f()

        def outer():
            return helper()

        @pytest.fixture
        def built():
            return outer()

        def test_through_helpers():
            outer()

        def test_through_fixture(built):
            pass

        class TestGroup:
            def test_method(self, built):
                pass

            def test_unrelated(self):
                pass
    """,
    # names f but never imports pkg.mod: some other f
    "tests/test_unrelated.py": """
        from other import f

        def test_other_f():
            f()
    """,
    # a method, reached through a subclass imported from a parent package
    "tests/test_method.py": """
        from pkg import Child

        def test_method():
            Child().meth()

        def test_no_method():
            Child()
    """,
    # a fixture of a conftest above, which imports the module
    "tests/sub/conftest.py": """
        import pytest
        from pkg.mod import f

        @pytest.fixture
        def made():
            return f()
    """,
    "tests/sub/test_uses_conftest.py": """
        def test_made(made):
            pass

        def test_plain():
            pass
    """,
    "tests/helpers_not_a_test.py": """
        from pkg.mod import f

        def test_looks_like_one():
            f()
    """,
}


@pytest.fixture
def tree(tmp_path):
    for rel, text in FILES.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "base.py").write_text("class Base:\n    def meth(self): ...\n")
    (pkg / "child.py").write_text(
        "from pkg.base import Base\n\n\nclass Child(Base, metaclass=type):\n    pass\n"
    )
    return tmp_path


def test_functions_are_selected_by_import_and_reference(tree):
    found = scan_tests.scan(tree, ["pkg.mod:f"])
    assert found == {
        "pkg.mod:f": [
            "tests/sub/test_uses_conftest.py::test_made",
            "tests/test_direct.py::test_call",
            "tests/test_direct.py::test_module_attr",
            "tests/test_direct.py::test_patched",
            "tests/test_helpers.py::TestGroup::test_method",
            "tests/test_helpers.py::test_through_fixture",
            "tests/test_helpers.py::test_through_helpers",
        ]
    }


def test_methods_are_selected_through_subclasses(tree):
    """``Child`` derives from the patched ``Base``; without the installed
    package to look subclasses up in, only ``Base`` itself counts."""
    target = "pkg.base:Base.meth"
    assert scan_tests.scan(tree, [target], vllm_root=tree / "pkg") == {
        target: ["tests/test_method.py::test_method"]
    }
    assert scan_tests.scan(tree, [target]) == {target: []}


def test_class_statements_are_read_with_their_bases():
    index = scan_tests.ClassIndex.__new__(scan_tests.ClassIndex)
    index.classes = [
        (m.group(1), set(scan_tests._bases(m.group(2))))
        for m in scan_tests._CLASS.finditer(
            "class A(x.Base, Generic[T, U], metaclass=M):\n"
            "    class B(\n        A,\n    ):\n        pass\n"
            "class C(B): ...\nclass D(Other): ...\n"
        )
    ]
    assert index.classes[0] == ("A", {"Base", "Generic"})
    assert index.subclass_names("Base") == {"Base", "A", "B", "C"}
