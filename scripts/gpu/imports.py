"""Part ``imports`` of the device run: every module the other parts import,
from the run's site directory, with the compiled extensions' stand-ins.

It runs first and alone so that a missing wheel or an import-time
incompatibility (vLLM 0.32's Python against the device's torch and Triton)
shows up in seconds, named, before anything compiles. It also records where
vLLM and the stand-ins were imported from, so a run that silently picked up
another vLLM is caught. CI runs it on CPU (tests/scripts/test_gpu_rehearsal.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import traceback
from pathlib import Path

from tier_env import prepare, write_json

#: Modules each part needs, in the order they are tried.
MODULES = (
    # the platform and the compiled extensions' stand-ins
    "vllm",
    "vllm.platforms.cuda",
    "vllm._C_stable_libtorch",
    "vllm._custom_ops",
    # imported on CUDA by fa_utils (TurboQuant, the model config)
    "vllm.vllm_flash_attn",
    "vllm.v1.attention.backends.fa_utils",
    # kernels the tier, the timings and the copies call
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.backends.turboquant_attn",
    "vllm.third_party.flash_linear_attention.ops",
    "vllm.model_executor.layers.mamba.ops.causal_conv1d",
    "vllm.model_executor.layers.mamba.ops.mamba_ssm",
    "vllm.model_executor.layers.mamba.ops.ssd_combined",
    "vllm.v1.worker.mamba_utils",
    "vllm.v1.worker.utils",
    # the tier's helpers
    "arena_views",
    "attention_check",
    "gdn_ops",
    "mamba2_ops",
    "align_copy_ops",
    # the overlay and the engines
    "vllm_hybrid.plugin",
    "vllm_hybrid.v1.core.pooled.planner",
    "vllm_hybrid.tools.tiny_models",
    "vllm_hybrid.tools.verify",
    "vllm.entrypoints.llm",
    "vllm.v1.engine.core",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.model_executor.models.qwen3_next",
    # the served engines (part serve and flagship)
    "vllm.entrypoints.openai.api_server",
    "vllm.benchmarks.serve",
    "vllm.v1.worker.gpu.model_runner",
    "vllm.model_executor.layers.fused_moe.fused_moe",
    "testing.shaped_models",
    "vllm_hybrid.cli",
    "testing.loopback",
    "benchmarks.serve.run",
    "serve",
)


def try_import(name: str) -> dict:
    try:
        module = importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001 - a report, not a handler
        lines = traceback.format_exception_only(type(exc), exc)
        return {"module": name, "ok": False, "error": "".join(lines).strip()}
    return {"module": name, "ok": True, "file": getattr(module, "__file__", None)}


def cuda_import_kernels() -> bool:
    """The CUDA platform's kernel imports (it only logs what fails) leave
    the extension modules loaded."""
    try:
        from vllm.platforms.cuda import CudaPlatform

        CudaPlatform.import_kernels()
    except Exception:  # noqa: BLE001 - reported as a failed check
        traceback.print_exc()
        return False
    loaded = ("vllm._C_stable_libtorch", "vllm._moe_C_stable_libtorch")
    return all(name in sys.modules for name in loaded)


def package_root(init_file: str) -> str:
    """The folder a package was imported from (``<root>/vllm/__init__.py``),
    resolved without following links inside the package."""
    return os.path.realpath(os.path.dirname(os.path.dirname(init_file)))


#: The tier's own helpers: imported by the first pass only.
HELPERS = ("arena_views", "attention_check", "gdn_ops", "mamba2_ops", "align_copy_ops")
#: What module-level CUDA calls raise in a CPU-only torch: such a module can
#: only be checked on the device.
NEEDS_GPU = "Torch not compiled with CUDA enabled"
#: The card the import pass pretends to be: compute capability 8.9 (Ada).
#: Any capability makes ``w8a8_utils`` ask the compiled ``_C`` ops whether
#: CUTLASS supports block FP8 while it is imported. Hopper's 9.0 would also
#: make ``ssd_chunk_scan`` filter its Triton autotune configs by fields that
#: vLLM's Triton placeholder (a CPU build's ``triton``) does not have, which
#: only the device can check.
PRETENDED_CAPABILITY = (8, 9)


def pretend_card(platform_cls: type) -> None:
    """Answer the device queries vLLM makes while modules are imported as a
    card would, so imports run on to what they do with the answer instead of
    stopping at "Torch not compiled with CUDA enabled" (that is how the
    CUTLASS support query above slipped through to a device run)."""
    import torch
    from vllm.platforms.interface import DeviceCapability

    capability = DeviceCapability(*PRETENDED_CAPABILITY)
    answer = classmethod(lambda cls, device_id=0: capability)
    platform_cls.get_device_capability = answer
    torch.cuda.get_device_capability = lambda device=None: PRETENDED_CAPABILITY


def as_cuda() -> list[dict]:
    """Without a GPU: the modules again, with vLLM's current platform set to
    the CUDA platform before any of them is imported, so every branch taken
    on ``current_platform.is_cuda()`` at import time runs here (that is how
    the flash-attention import of ``fa_utils`` shows up before a device
    run). A module whose import calls into CUDA is marked ``needs_gpu``."""
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatform

    pretend_card(CudaPlatform)
    platforms._current_platform = CudaPlatform()
    results = [try_import(name) for name in MODULES if name not in HELPERS]
    for result in results:
        result["needs_gpu"] = NEEDS_GPU in result.get("error", "")
    return results


def as_cuda_pass(out: str) -> dict:
    """:func:`as_cuda` in a fresh interpreter (the platform is chosen once
    per process); its failures other than ``needs_gpu`` ones."""
    import subprocess

    path = f"{out}.as_cuda.json"
    subprocess.run([sys.executable, __file__, "--as-cuda", "--out", path], check=False)
    results = json.loads(Path(path).read_text())
    Path(path).unlink()
    failed = [r for r in results if not r["ok"] and not r["needs_gpu"]]
    return {
        "failed": failed,
        "needs_gpu": [r["module"] for r in results if r["needs_gpu"]],
    }


def environment(kernels: str) -> dict:
    import torch
    import triton
    from vllm.platforms import current_platform

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "kernels": kernels,
        "platform": type(current_platform).__name__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["sm_count"] = props.multi_processor_count
        env["memory_gib"] = round(props.total_memory / 2**30, 1)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--site", default=os.environ.get("GPU_RUN_SITE"))
    parser.add_argument("--budget", type=float, help="unused: imports are quick")
    parser.add_argument("--as-cuda", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.as_cuda:
        Path(args.out).write_text(json.dumps(as_cuda()))
        return 0
    kernels = prepare()
    results = [try_import(name) for name in MODULES]
    failed = [r for r in results if not r["ok"]]
    vllm = next(r for r in results if r["module"] == "vllm")
    standin = next(r for r in results if r["module"] == "vllm._C_stable_libtorch")
    checks = {
        # what the CUDA platform imports when vLLM's ops module loads: on the
        # device the stand-ins answer; here it proves they are in place
        "cuda_import_kernels": cuda_import_kernels(),
        "vllm_from_site": bool(args.site and vllm["ok"])
        and package_root(vllm["file"]) == os.path.realpath(args.site),
        "stand_in_used": bool(
            standin["ok"] and getattr(sys.modules[standin["module"]], "STAND_IN", False)
        ),
    }
    cuda_pass = None if kernels == "cuda" else as_cuda_pass(args.out)
    if cuda_pass is not None:
        checks["imports_as_cuda"] = not cuda_pass["failed"]
        failed += cuda_pass["failed"]
    report = {
        "ok": not failed and all(checks.values()),
        "as_cuda": cuda_pass,
        "checks": checks,
        "failed": failed,
        "modules": results,
    }
    if not failed:
        report["environment"] = environment(kernels)
    write_json(args.out, report)
    for r in failed:
        print(f"import failed: {r['module']}: {r['error']}", file=sys.stderr)
    print(f"imports: {len(results) - len(failed)}/{len(results)} ok, checks {checks}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
