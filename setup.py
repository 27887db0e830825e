"""Build step for the optional native TurboQuant CPU kernel.

Everything else about the package lives in pyproject.toml. ``pip install``
(editable or not) runs CMake on CMakeLists.txt and puts ``_tq_cpu*.so`` plus
``_tq_cpu.json`` (the torch version it was built for) into
``vllm_hybrid/ops/turboquant``. torch must be importable while building:
scripts/setup.sh installs torch first and passes ``--no-build-isolation``
(see docs/turboquant.md). Any failure (no torch, no cmake, compiler error)
only prints a warning: the package then runs the torch reference path.
``VLLM_HYBRID_SKIP_NATIVE=1`` skips the build.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
EXT_NAME = "vllm_hybrid.ops.turboquant._tq_cpu"


def _warn(msg: str) -> None:
    print(
        f"WARNING: vllm-hybrid native TurboQuant kernel not built: {msg}",
        file=sys.stderr,
    )


class CMakeBuild(build_ext):
    """Builds the kernel with CMake; never fails the install."""

    def build_extension(self, ext: Extension) -> None:
        if os.environ.get("VLLM_HYBRID_SKIP_NATIVE", "") in ("1", "true", "yes"):
            _warn("VLLM_HYBRID_SKIP_NATIVE is set")
            return
        try:
            self._cmake_build(ext)
        except Exception as exc:  # noqa: BLE001 - a failed build must not fail pip
            _warn(str(exc))

    def _cmake_build(self, ext: Extension) -> None:
        import torch

        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError("cmake not found on PATH")
        build_dir = ROOT / "build" / "tq_cpu"
        cache = build_dir / "CMakeCache.txt"
        if cache.exists() and f"CMAKE_HOME_DIRECTORY:INTERNAL={ROOT}\n" not in (
            cache.read_text()
        ):
            shutil.rmtree(build_dir)  # configured for another checkout
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
        ]
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
        subprocess.run([cmake, "--build", str(build_dir)], check=True)
        built = build_dir / "_tq_cpu.so"
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        for old in target.parent.glob("_tq_cpu*.so"):
            old.unlink()
        shutil.copyfile(built, target)
        # The loader refuses a library built for another torch (native.py).
        info = json.dumps({"torch": torch.__version__}) + "\n"
        (target.parent / "_tq_cpu.json").write_text(info)
        if getattr(self, "editable_mode", False):
            # Editable installs copy only the declared outputs (the .so) from
            # a temporary dir into the source tree; put the sidecar there too.
            (ROOT / "vllm_hybrid" / "ops" / "turboquant" / "_tq_cpu.json").write_text(
                info
            )


setup(
    ext_modules=[Extension(EXT_NAME, sources=[], optional=True)],
    cmdclass={"build_ext": CMakeBuild},
)
