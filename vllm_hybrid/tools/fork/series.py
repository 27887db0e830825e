"""Writing the fork: vLLM's tree as the first commit, one commit per fix,
and the series as patch files.

Commits carry fixed author, committer and dates, so the same repository
state gives the same commits and patches on every machine and run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

from vllm_hybrid.tools.fork.build import ForkBuild
from vllm_hybrid.tools.fork.plan import COMMITS, ForkCommit

#: Identity and date of every commit of the series.
AUTHOR = ("vllm-hybrid fork", "fork@vllm-hybrid.invalid")
DATE = "2026-01-01T00:00:00+00:00"
PATCHES_DIR = "patches"


@dataclass(frozen=True)
class Series:
    """What :func:`write_series` produced."""

    root: Path
    base: str
    commits: list[str]
    patches: list[Path]
    #: What the commits were computed with (their files, how entries were
    #: written, which tests went along).
    build: ForkBuild | None = None


def git(root: Path, *args: str, stdin: str | None = None, raw: bool = False) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": AUTHOR[0],
        "GIT_AUTHOR_EMAIL": AUTHOR[1],
        "GIT_COMMITTER_NAME": AUTHOR[0],
        "GIT_COMMITTER_EMAIL": AUTHOR[1],
        "GIT_AUTHOR_DATE": DATE,
        "GIT_COMMITTER_DATE": DATE,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
    }
    result = subprocess.run(
        ["git", "-C", str(root), *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
    )
    if result.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout if raw else result.stdout.strip()


def unpack(sdist: Path, out_dir: Path) -> None:
    """vLLM's sdist into ``out_dir``, without its top-level directory."""
    with tarfile.open(sdist) as archive:
        members = archive.getmembers()
        top = members[0].name.split("/")[0]
        for member in members:
            parts = member.name.split("/", 1)
            if parts[0] != top or len(parts) == 1:
                continue
            member.name = parts[1]
            archive.extract(member, out_dir, filter="data")


def write_series(sdist: Path, out_dir: Path, repo_root: Path) -> Series:
    """The fork in ``out_dir`` (created; must not exist or be empty)."""
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} is not empty; the fork needs a new directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    unpack(sdist, out_dir)
    git(out_dir, "init", "-q", "-b", "main")
    git(out_dir, "config", "core.autocrlf", "false")
    # the tree exactly as published: ignored files too
    git(out_dir, "add", "-A", "-f")
    version = _version(out_dir)
    git(out_dir, "commit", "-q", "--no-verify", "-m", f"vLLM {version} as published")
    base = git(out_dir, "rev-parse", "HEAD")
    build = ForkBuild(
        repo_root,
        out_dir,
        read_upstream=lambda path: git(out_dir, "show", f"{base}:{path}", raw=True),
    )
    commits = []
    for index, commit in enumerate(COMMITS, start=1):
        files = build.files(index)
        for path, text in files.items():
            target = out_dir / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        format_python(out_dir, [p for p in files if p.endswith(".py")])
        git(out_dir, "add", "-A")
        git(
            out_dir,
            "commit",
            "-q",
            "--no-verify",
            "-F",
            "-",
            stdin=message(commit, build, index),
        )
        commits.append(git(out_dir, "rev-parse", "HEAD"))
    patches_dir = out_dir / PATCHES_DIR
    git(out_dir, "format-patch", "-q", "-o", str(patches_dir), f"{base}..HEAD")
    patches = sorted(patches_dir.glob("*.patch"))
    return Series(out_dir, base, commits, patches, build)


def _version(root: Path) -> str:
    for line in (root / "PKG-INFO").read_text().splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return "?"


def format_python(root: Path, paths: list[str]) -> None:
    """vLLM's own lint fixes and formatting (its pyproject.toml) on the
    files the fork writes; without ruff the files stay as generated."""
    if not paths:
        return
    ruff = ruff_command()
    if ruff is None:
        print(
            "vllm-hybrid fork: ruff not found; files are left unformatted",
            file=sys.stderr,
        )
        return
    subprocess.run(
        [*ruff, "check", "--fix", "--quiet", "--exit-zero", *paths],
        cwd=root,
        check=True,
        capture_output=True,
    )
    subprocess.run([*ruff, "format", "--quiet", *paths], cwd=root, check=True)


def ruff_command() -> list[str] | None:
    """How to run ruff here: next to this Python, on the PATH, or None."""
    beside = Path(sys.executable).with_name("ruff")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("ruff")
    return [found] if found else None


def message(commit: ForkCommit, build: ForkBuild, index: int) -> str:
    """Subject, why, and each registry entry the commit writes into vLLM."""
    lines = [commit.subject, ""]
    lines += textwrap.wrap(commit.body, width=72)
    entries = build.entries_of(index - 1)
    if entries:
        lines += ["", "Changes to vLLM's definitions:"]
    for entry in entries:
        placed = build.placed.get(entry.target)
        where = entry.target.replace(":", ".")
        if placed is not None and placed.how == "default":
            how = f"its own definition is kept as {placed.default_name}"
        else:
            how = (
                f"code {entry.placement} its body"
                if entry.placement != "top"
                else ("a dispatch at the top of its body")
            )
        lines += [""] + textwrap.wrap(
            f"- {where}: {how}.", width=72, subsequent_indent="  "
        )
        lines += textwrap.wrap(
            build.text(entry.why), width=72, initial_indent="  ", subsequent_indent="  "
        )
    return "\n".join(lines) + "\n"
