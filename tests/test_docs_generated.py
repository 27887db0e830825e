"""Documented command outputs are what the commands print now.

``scripts/gen_docs.py`` reruns the command named by each
``<!-- generated: ... -->`` marker; here it checks every document with one
in this process (the planner needs no weights and imports vLLM once; the
result tables render runs committed under ``benchmarks/results/``), and
shows that a block edited to a stale figure is reported.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Documents with generated blocks, and how many each must have (a marker
#: lost in an edit would otherwise leave its block unchecked).
DOCS = {
    "README.md": 4,
    "docs/plan.md": 2,
    "docs/simulation.md": 4,
    "docs/benchmarks.md": 1,
    "docs/pooled-mode.md": 1,
}


def _load_gen_docs():
    spec = importlib.util.spec_from_file_location(
        "gen_docs", ROOT / "scripts" / "gen_docs.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gen_docs = _load_gen_docs()


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None,
    reason="documented on the CPU set-up, which removes torchvision: with it "
    "the planner imports Qwen3.5's own class and omits the stand-in note",
)
@pytest.mark.parametrize("name", sorted(DOCS))
def test_documented_outputs_are_current(name):
    path = ROOT / name
    blocks = gen_docs.find_blocks(path.read_text().split("\n"), name)
    assert len(blocks) == DOCS[name]
    programs = {tuple(b.command.split()[:2]) for b in blocks}
    assert programs <= set(gen_docs.RUNNERS)
    assert gen_docs.differences(path) == ""


def test_the_default_files_are_the_documents_checked_here():
    found = {str(p.relative_to(ROOT)) for p in gen_docs.doc_files([])}
    assert found == set(DOCS)


def test_a_stale_figure_is_reported_and_rewritten(tmp_path):
    doc = tmp_path / "plan.md"
    shutil.copy(ROOT / "docs" / "plan.md", doc)
    current = doc.read_text()
    line = re.search(r"^token capacity \(logged\) .*$", current, re.M).group(0)
    pooled = line.split()[-1]  # e.g. 483,040
    stale_value = f"{int(pooled.replace(',', '')) + 736:,}"
    stale_line = line[: -len(pooled)] + stale_value
    doc.write_text(current.replace(line, stale_line))

    diff = gen_docs.differences(doc)
    changed = [
        d for d in diff.splitlines() if d[:1] in "+-" and d[:3] not in ("+++", "---")
    ]
    assert changed == [f"-{stale_line}", f"+{line}"]
    assert gen_docs.main(["--check", str(doc)]) == 1
    assert gen_docs.main(["--write", str(doc)]) == 0
    assert doc.read_text() == current
    assert gen_docs.main(["--check", str(doc)]) == 0


def test_marker_without_a_block_is_an_error():
    lines = ["<!-- generated: vllm-hybrid plan --list-presets -->", "text"]
    with pytest.raises(gen_docs.DocError, match="not followed by a ``` block"):
        gen_docs.find_blocks(lines, "x.md")
    with pytest.raises(gen_docs.DocError, match="only 'vllm-hybrid plan ...'"):
        gen_docs.run("vllm-hybrid serve model")


def test_a_simulation_table_is_rendered_never_simulated():
    """A marked simulation table reads committed runs: without ``--offline``
    the script would simulate (minutes) when a run is missing."""
    command = "python scripts/simulation_tables.py benchmarks/results/x --cases 80-tq"
    with pytest.raises(gen_docs.DocError, match="needs --offline"):
        gen_docs.run(command)


def test_displayed_command_wraps_before_options():
    command = (
        "vllm-hybrid plan qwen3.5-35b-a3b --gpu-memory 24 --weights-memory 18GiB "
        "--prompt-lens 2048,8192 --kv-cache-dtype turboquant_k8v4"
    )
    assert gen_docs.display(command) == (
        "$ vllm-hybrid plan qwen3.5-35b-a3b --gpu-memory 24 --weights-memory 18GiB \\\n"
        "      --prompt-lens 2048,8192 --kv-cache-dtype turboquant_k8v4"
    )


def test_readme_activation_line_is_what_the_plugin_logs():
    """The README's example log line: source line, version and patch count as
    the plugin logs them now (pid and time are the example's own)."""
    import inspect

    from vllm_hybrid import __version__, plugin
    from vllm_hybrid.patches.entries import PATCHES

    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"^\(EngineCore pid=\d+\) INFO .*$", readme, re.M).group(0)
    source, first = inspect.getsourcelines(plugin.register)
    call = next(
        i for i, text in enumerate(source) if "active on vLLM" in text
    )  # the format string sits one line below logger.info(
    assert shown.split("] ", 1)[0].endswith(f"[plugin.py:{first + call - 1}")
    assert shown.split("] ", 1)[1] == (
        f"vllm-hybrid {__version__} active on vLLM "
        f"{plugin.SUPPORTED_VLLM_VERSION} ({len(PATCHES)} upstream symbols patched)"
    )
