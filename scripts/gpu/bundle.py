"""Pack what a device run needs and the GPU machine's image lacks.

Writes into ``.gpu-bundle/`` (ignored by git, carried to the device by the
run's ``carry``):

* ``device/vllm-<version>-py.tar.gz``: vLLM's Python tree from this
  checkout's venv, without compiled extensions (``*.so``) and caches;
* ``device/wheels/``: the distributions of ``carried.txt`` as wheels for the
  device's interpreter (CPython 3.12, manylinux x86-64), fetched with
  ``pip download --no-deps`` at the versions pinned there;
* ``rehearsal/wheels/``: the same distributions for this machine's
  interpreter where the device's wheel is compiled, so the CPU rehearsal
  installs the same set (pure-Python wheels are shared);
* ``manifest.json``: what was packed, sizes, and the checkout's commit.

Run from the repository root with the project's venv:
``python scripts/gpu/bundle.py`` (``--offline``: pack the tree only and keep
the wheels already there).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

from sitedir import HERE, ROOT, VLLM_VERSION, fresh, read_list

BUNDLE = ROOT / ".gpu-bundle"
DEVICE = BUNDLE / "device"
REHEARSAL = BUNDLE / "rehearsal"
TREE_NAME = f"vllm-{VLLM_VERSION}-py.tar.gz"
#: What travels to the device must stay under the tool's 64 MiB with the
#: working tree; the bundle keeps well below that.
MAX_DEVICE_BYTES = 40 * 2**20
DEVICE_PYTHON = "3.12"
#: manylinux tags pip may match for the device (pip matches each exactly).
DEVICE_PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def vllm_source() -> Path:
    """vLLM's package folder in the interpreter running this script."""
    return Path(sysconfig.get_paths()["purelib"]) / "vllm"


def pack_tree(source: Path, archive: Path) -> int:
    """``source`` as ``vllm/...`` in a gzip tarball, without ``*.so`` and
    ``__pycache__``; returns the number of files packed."""
    count = 0

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        nonlocal count
        name = Path(info.name)
        if "__pycache__" in name.parts or name.suffix == ".so":
            return None
        count += info.isfile()
        return info

    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz", compresslevel=9) as tar:
        tar.add(source, arcname="vllm", filter=keep)
    return count


def pip_download(specs: list[str], dest: Path, device: bool) -> None:
    """``specs`` as wheels in ``dest``, emptied first: two versions of one
    distribution would stop the whole install on the device."""
    fresh(dest)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q"]
    command += ["--only-binary=:all:", "-d", str(dest)]
    if device:
        command += ["--python-version", DEVICE_PYTHON, "--implementation", "cp"]
        for platform in DEVICE_PLATFORMS:
            command += ["--platform", platform]
    subprocess.run([*command, *specs], check=True)


def is_pure(wheel: Path) -> bool:
    """A wheel any CPython 3 can install (``py3-none-any`` and the like)."""
    return wheel.name.endswith("-none-any.whl")


def fetch_wheels(specs: list[str]) -> None:
    """Device wheels for every spec; rehearsal twins for the compiled ones."""
    pip_download(specs, DEVICE / "wheels", device=True)
    compiled = {
        w.name.split("-")[0].lower()
        for w in (DEVICE / "wheels").glob("*.whl")
        if not is_pure(w)
    }
    native = [s for s in specs if _wheel_name(s) in compiled]
    pip_download(native, REHEARSAL / "wheels", device=False)


def _wheel_name(spec: str) -> str:
    """The distribution name as wheel file names spell it."""
    return spec.split("==")[0].replace("-", "_").lower()


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def commit() -> str:
    """The checkout's commit; empty where there is no git or no .git."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--offline", action="store_true")
    args = parser.parse_args(argv)
    archive = DEVICE / TREE_NAME
    files = pack_tree(vllm_source(), archive)
    specs = read_list(HERE / "carried.txt")
    if not args.offline:
        fetch_wheels(specs)
    device_bytes = folder_bytes(DEVICE)
    manifest = {
        "vllm_version": VLLM_VERSION,
        "vllm_files": files,
        "tree_bytes": archive.stat().st_size,
        "carried": specs,
        "device_wheels": sorted(w.name for w in (DEVICE / "wheels").glob("*.whl")),
        "rehearsal_wheels": sorted(
            w.name for w in (REHEARSAL / "wheels").glob("*.whl")
        ),
        "device_bytes": device_bytes,
        "commit": commit(),
    }
    (BUNDLE / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(
        f"bundle: {files} vLLM files, {archive.stat().st_size / 2**20:.1f} MiB tree,"
        f" {len(manifest['device_wheels'])} device wheels,"
        f" {device_bytes / 2**20:.1f} MiB to carry"
    )
    if device_bytes > MAX_DEVICE_BYTES:
        print(f"bundle: over {MAX_DEVICE_BYTES / 2**20:.0f} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
