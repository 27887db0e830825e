"""vLLM's published source archive: a local file, or fetched once from the
package index and cached.

pip prepares an sdist's metadata before it saves it, and vLLM's setup.py
builds its extensions for the target device; ``VLLM_TARGET_DEVICE=empty``
skips them and ``VLLM_VERSION_OVERRIDE`` keeps pip from seeing a
``+empty`` version it would reject (the same way scripts/upstream_tests.sh
fetches vLLM's tests).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from vllm_hybrid import SUPPORTED_VLLM_VERSION


def cache_dir() -> Path:
    """Where a fetched archive is kept: the user's cache directory
    (``XDG_CACHE_HOME``, else ``~/.cache``), under ``vllm-hybrid/sdist``."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "vllm-hybrid" / "sdist"


def archive_name(version: str = SUPPORTED_VLLM_VERSION) -> str:
    return f"vllm-{version}.tar.gz"


def find_sdist(explicit: Path | None = None) -> Path:
    """``explicit`` if given (it must exist), else the cached archive,
    fetched first if needed."""
    if explicit is not None:
        if not explicit.is_file():
            raise FileNotFoundError(
                f"--sdist {explicit}: no such file; give vLLM "
                f"{SUPPORTED_VLLM_VERSION}'s source archive ({archive_name()}) or "
                "leave --sdist out to fetch it"
            )
        return explicit
    cached = cache_dir() / archive_name()
    if cached.is_file():
        return cached
    return fetch(cached)


def fetch(dest: Path) -> Path:
    """Download vLLM's sdist with pip into ``dest`` (atomically)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "empty",
        "VLLM_VERSION_OVERRIDE": SUPPORTED_VLLM_VERSION,
    }
    print(
        f"vllm-hybrid fork: fetching vllm=={SUPPORTED_VLLM_VERSION}'s source archive "
        f"into {dest.parent} (once)",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                "vllm",
                f"vllm=={SUPPORTED_VLLM_VERSION}",
                "-d",
                tmp,
            ],
            check=True,
            env=env,
        )
        Path(tmp, archive_name()).replace(dest)
    return dest
