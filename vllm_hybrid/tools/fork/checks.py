"""The structure a generated fork must have, checked from its files.

Each check returns a list of problems (empty: the point holds), so a test
or a person sees every problem of a run at once.
"""

from __future__ import annotations

import ast
import hashlib
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from vllm_hybrid.tools.fork.series import PATCHES_DIR, Series, git, ruff_command, unpack

#: A vLLM-style subject: ``[Area] What changes``.
SUBJECT = re.compile(r"^\[[A-Za-z0-9 /-]+\] \S.{0,70}$")
#: Text the fork's ``vllm/`` must not contain: the overlay's package, its
#: registry's lookup, its plugin entry point and its switch.
FORBIDDEN = ("vllm_hybrid", "upstream_of", "vllm-hybrid", "VLLM_HYBRID_")
MIN_FIX_COMMITS = 6


def first_commit_is_the_archive(series: Series, archive: Path) -> list[str]:
    """Every file of the archive, byte for byte, and nothing else."""
    listing = git(series.root, "ls-tree", "-r", "-z", series.base, raw=True)
    committed = {}
    for entry in listing.split("\0"):
        if entry:
            meta, path = entry.split("\t", 1)
            committed[path] = meta.split()[2]
    expected = {}
    with tarfile.open(archive) as tar:
        for member in tar:
            parts = member.name.split("/", 1)
            if len(parts) < 2 or not member.isfile():
                continue
            data = tar.extractfile(member).read()
            header = f"blob {len(data)}\0".encode()
            expected[parts[1]] = hashlib.sha1(header + data).hexdigest()
    problems = [
        f"{p}: not in the first commit"
        for p in sorted(expected.keys() - committed.keys())
    ]
    problems += [
        f"{p}: not in the archive" for p in sorted(committed.keys() - expected.keys())
    ]
    problems += [
        f"{p}: differs from the archive"
        for p in sorted(expected.keys() & committed.keys())
        if expected[p] != committed[p]
    ]
    return problems


def commits_are_fixes(series: Series) -> list[str]:
    problems = []
    if len(series.commits) < MIN_FIX_COMMITS:
        problems.append(
            f"{len(series.commits)} fix commits, fewer than {MIN_FIX_COMMITS}"
        )
    for sha in series.commits:
        subject = git(series.root, "log", "-1", "--format=%s", sha)
        body = git(series.root, "log", "-1", "--format=%b", sha)
        if not SUBJECT.match(subject):
            problems.append(
                f"{sha[:10]}: subject {subject!r} is not '[Area] ...' under 72"
            )
        if len(body.split()) < 20:
            problems.append(f"{sha[:10]}: the body does not say why")
        changed = git(series.root, "show", "--name-only", "--format=", sha)
        if not changed:
            problems.append(f"{sha[:10]}: changes nothing")
    return problems


def patches_apply_in_order(series: Series, archive: Path) -> list[str]:
    """``git apply --check`` of each patch, in order, on a fresh copy of the
    archive (each applied before the next is checked)."""
    patches = sorted((series.root / PATCHES_DIR).glob("*.patch"))
    problems = []
    if len(patches) != len(series.commits):
        problems.append(f"{len(patches)} patches for {len(series.commits)} commits")
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        unpack(archive, fresh)
        for patch in patches:
            for args in (["--check"], []):
                done = subprocess.run(
                    ["git", "apply", *args, str(patch)],
                    cwd=fresh,
                    capture_output=True,
                    text=True,
                )
                if done.returncode != 0:
                    problems.append(f"{patch.name}: {done.stderr.strip()[:300]}")
                    return problems
    return problems


def changed_files(series: Series) -> list[str]:
    names = git(
        series.root, "diff", "--name-only", "--diff-filter=AM", f"{series.base}..HEAD"
    )
    return [n for n in names.splitlines() if n]


def no_overlay_in_vllm(series: Series) -> list[str]:
    problems = []
    for path in sorted((series.root / "vllm").rglob("*")):
        if not path.is_file() or path.suffix in (".so", ".pyc"):
            continue
        text = path.read_text(errors="replace")
        for word in FORBIDDEN:
            if word in text:
                number = next(
                    i for i, line in enumerate(text.splitlines(), 1) if word in line
                )
                problems.append(f"{path.relative_to(series.root)}:{number}: {word}")
    return problems


def lint_and_compile(series: Series) -> list[str]:
    """vLLM's ruff configuration and ``compileall`` on every Python file the
    series adds or changes."""
    paths = [p for p in changed_files(series) if p.endswith(".py")]
    problems = []
    ruff = ruff_command()
    if ruff is None:
        problems.append("ruff is not installed here")
    else:
        done = subprocess.run(
            [*ruff, "check", "--output-format", "concise", *paths],
            cwd=series.root,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            problems += [line for line in done.stdout.splitlines() if line.strip()][:40]
    done = subprocess.run(
        [sys.executable, "-m", "compileall", "-q", *paths],
        cwd=series.root,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        problems.append(done.stdout.strip()[:1000])
    return problems


def imports_resolve_in_every_state(build, upto: int | None = None) -> list[str]:
    """After each commit, every ``vllm`` import of a file the series writes
    names a module of that state, and every name it imports from a module
    the series writes is defined there: the series builds commit by commit."""
    from vllm_hybrid.tools.fork.plan import COMMITS
    from vllm_hybrid.tools.fork.source import Source
    from vllm_hybrid.tools.fork.symbols import module_bindings

    parsed: dict[tuple[str, str], tuple[list[ast.ImportFrom], set[str]]] = {}

    def facts(path: str, text: str) -> tuple[list[ast.ImportFrom], set[str]]:
        key = (path, text)
        if key not in parsed:
            source = Source(text, path)
            imports = [
                n
                for n in ast.walk(source.tree)
                if isinstance(n, ast.ImportFrom)
                and not n.level
                and (n.module or "").startswith("vllm")
            ]
            bound = set(module_bindings(source, _module_name(path)))
            parsed[key] = (imports, bound)
        return parsed[key]

    problems = []
    for state in range(1, (upto or len(COMMITS)) + 1):
        after = COMMITS[state - 1].key
        files = {p: t for p, t in build.files(state).items() if p.endswith(".py")}
        names = {_module_name(p): p for p in files}

        def exists(module: str, names: dict[str, str] = names) -> bool:
            return module in names or build._exists_module(module)

        for path, text in files.items():
            if not path.startswith("vllm/"):
                continue
            for node in facts(path, text)[0]:
                if not exists(node.module):
                    problems.append(f"after {after}: {path} imports {node.module}")
                    continue
                if node.module not in names:
                    continue
                bound = facts(names[node.module], files[names[node.module]])[1]
                for alias in node.names:
                    if alias.name not in bound and not exists(
                        f"{node.module}.{alias.name}"
                    ):
                        problems.append(
                            f"after {after}: {path} imports {alias.name} from "
                            f"{node.module}, which has none"
                        )
    return sorted(set(problems))


def _module_name(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def all_checks(series: Series, archive: Path) -> dict[str, list[str]]:
    return {
        "first commit is the archive": first_commit_is_the_archive(series, archive),
        "fix commits": commits_are_fixes(series),
        "patches apply in order": patches_apply_in_order(series, archive),
        "no overlay in vllm/": no_overlay_in_vllm(series),
        "ruff and compileall": lint_and_compile(series),
    }
