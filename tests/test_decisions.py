"""Pooled mode's policy defaults are decisions with records, not figures.

docs/decisions.md lists every module-level constant of
``vllm_hybrid/v1/core/pooled/policy/`` with its value, its reason and the
record under ``benchmarks/results/`` that measured it; the modules' comments
and docstrings say why in a sentence and link the record, and carry no
figure of a run (those go stale with the next run). The checks here read
the sources and the page, and each is shown to fail on a planted case.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from enum import Enum
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
POLICY = ROOT / "vllm_hybrid" / "v1" / "core" / "pooled" / "policy"
DECISIONS = ROOT / "docs" / "decisions.md"
RESULTS = ROOT / "benchmarks" / "results"

#: What a figure of a run looks like in prose: a ratio (0.98x, 12x), a
#: number with thousands separators (2,095 admissions, 1,056-token blocks), a
#: decimal (a hit rate of 0.135, 17.4), a time (71.6 ms, 17 s), a share
#: (85%), a memory size of a run (at 80 GB, 48 MiB) and a date. Definitions
#: (a block of 16 tokens, 1: plain LRU, 256 B alignment, at most 4 waiting)
#: match none of them.
FIGURES = {
    "ratio": re.compile(r"\b\d+(?:\.\d+)?x\b"),
    "thousands": re.compile(r"\b\d{1,3}(?:,\d{3})+\b"),
    "decimal": re.compile(r"\b\d+\.\d+\b"),
    "milliseconds": re.compile(r"\b\d+(?:\.\d+)?\s?ms\b"),
    "seconds": re.compile(r"\b\d+(?:\.\d+)?\s?s\b"),
    "percent": re.compile(r"\b\d+(?:\.\d+)?\s?%"),
    "memory size": re.compile(r"\b\d+(?:\.\d+)?\s?(?:[KMGT]i?B)\b"),
    "date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
}
#: A record link names a dated file; its digits are no figure.
RECORD = re.compile(r"benchmarks/results/([\w.-]+\.md)")


def policy_modules() -> list[Path]:
    return sorted(POLICY.glob("*.py"))


def constants(source: str) -> list[str]:
    """Upper-case names assigned at a module's top level."""
    names = []
    for node in ast.parse(source).body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        names += [t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()]
    return names


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and docstring of a module."""
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(
            node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
        ):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    return found


def figures(source: str) -> list[str]:
    """``line: kind 'text'`` for every figure of a run in a module's prose."""
    hits = []
    for line, text in prose(source):
        text = RECORD.sub("", text)
        for kind, pattern in FIGURES.items():
            hits += [f"{line}: {kind} {m.group(0)!r}" for m in pattern.finditer(text)]
    return hits


def rows(page: str) -> dict[str, list[str]]:
    """Table rows of the page by the name in their first cell."""
    found = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`([A-Z][A-Z0-9_]*)`", cells[0]) if cells else None
        if match and len(cells) == 4:
            found[match.group(1)] = cells
    return found


def shown(value: object) -> str | None:
    """How the page writes a scalar default (None: a collection)."""
    if isinstance(value, Enum):
        return f"`{type(value).__name__}.{value.name}`"
    if isinstance(value, bool | int | float):
        return f"`{value!r}`"
    return None


def members(value: object) -> set[str]:
    """Names of the enum members a collection default holds, at any depth."""
    if isinstance(value, Enum):
        return {value.name}
    if isinstance(value, dict):
        return {n for k, v in value.items() for n in members(k) | members(v)}
    if isinstance(value, tuple | list | set | frozenset):
        return {n for item in value for n in members(item)}
    fields = getattr(value, "__dataclass_fields__", None)
    if fields:
        return {n for f in fields for n in members(getattr(value, f))}
    return set()


def missing(page: str, names: list[str]) -> list[str]:
    return [name for name in names if name not in rows(page)]


@pytest.mark.parametrize("module", policy_modules(), ids=lambda p: p.name)
def test_every_policy_constant_is_a_decision(module):
    assert missing(DECISIONS.read_text(), constants(module.read_text())) == []


def test_a_constant_missing_from_the_page_is_reported():
    source = "lower = 1\nPLANTED_DEFAULT = 3\n_private = 2\n"
    assert constants(source) == ["PLANTED_DEFAULT"]
    page = "| `OTHER` | `1` | why | record |\n"
    assert missing(page, constants(source)) == ["PLANTED_DEFAULT"]


@pytest.mark.parametrize("module", policy_modules(), ids=lambda p: p.name)
def test_the_page_shows_each_default_as_the_code_has_it(module):
    name = f"vllm_hybrid.v1.core.pooled.policy.{module.stem}"
    code = importlib.import_module(name)
    page = rows(DECISIONS.read_text())
    wrong = []
    for constant in constants(module.read_text()):
        if constant not in page:
            continue  # reported by test_every_policy_constant_is_a_decision
        value, cell = getattr(code, constant), page[constant][1]
        expected = shown(value)
        if expected is not None and cell != expected:
            wrong.append(f"{constant}: page {cell}, code {expected}")
        if expected is None and any(m not in cell for m in members(value)):
            wrong.append(f"{constant}: page {cell} lacks {sorted(members(value))}")
    assert wrong == []


def test_every_record_the_page_links_exists():
    page = DECISIONS.read_text()
    links = re.findall(r"\]\(\.\./benchmarks/results/([^)]+)\)", page)
    assert links, "the page links no record"
    assert [link for link in links if not (RESULTS / link).is_file()] == []
    # every row names a record, or says why there is none
    bare = [
        n for n, cells in rows(page).items() if not cells[3].startswith(("[", "none"))
    ]
    assert bare == []


@pytest.mark.parametrize("module", policy_modules(), ids=lambda p: p.name)
def test_records_named_in_the_code_exist(module):
    named = RECORD.findall(module.read_text())
    assert [record for record in named if not (RESULTS / record).is_file()] == []


@pytest.mark.parametrize("module", policy_modules(), ids=lambda p: p.name)
def test_no_figure_of_a_run_in_policy_comments(module):
    assert figures(module.read_text()) == []


@pytest.mark.parametrize(
    "figure",
    [
        "(the simulator at 80 GB turboquant_k8v4: Mooncake 0.98x upstream's)",
        "TTFT p99 17 s with a share of what the token pool owns, 0.30 s with this",
        "2,095 admissions were refused for want of a state block",
        "its step p99 was 71.6 ms against upstream's",
        "85% of pooled mode's copies came before prefill chunks",
        "measured on 2026-11-28",
        "at 48 MiB the hit rate rose",
        "the hit rate rose from 0.100 to 0.135",
    ],
)
def test_a_figure_of_a_run_is_caught(figure):
    source = f'"""Module."""\n\n#: {figure}\nX = 1\n'
    assert figures(source) != []
    assert figures(f'def f():\n    """{figure}"""\n') != []


@pytest.mark.parametrize(
    "definition",
    [
        "(1: plain LRU)",
        "16 state blocks' worth of token ids next to the boundary",
        "every pool base starts on a 256 B boundary",
        "while at most 4 requests wait",
        "(benchmarks/results/sim-20261129-boundary-clear.md)",
        "the interval, rounded up to the state block",
    ],
)
def test_a_definition_is_no_figure(definition):
    assert figures(f"#: {definition}\nX = 1\n") == []
