"""Part ``engines`` of the device run (the stretch): ``vllm-hybrid verify``'s
tiny engines on CUDA with vLLM's Python-only tree.

vLLM's compiled ops are not there (the stand-ins register none), so the
engines run what needs no compiled op: the Triton attention backend, custom
ops in their native (PyTorch) form and vLLM IR ops on their native
implementation; the GDN layers' kernels are Triton anyway. Two variants, each
running verify's three engines (pooled, single pool, upstream) at once, each
in its own process:

* ``eager``: ``enforce_eager``;
* ``cuda_graphs``: full CUDA graphs for decode batches, without
  ``torch.compile`` (the device's torch is older than the one vLLM 0.32 was
  built against, so Inductor is left out of this first try).

Each worker is verify's own (``verify.run_worker``) with these engine
arguments added; verify's checks are applied to the results. What stopped an
engine is recorded with the tail of its output. In the CPU rehearsal the
engines get verify's CPU arguments and stop where the CPU backend needs a
compiled op the stand-ins do not have: that exercises this script, not vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tier_env import ROOT, write_json

from vllm_hybrid.tools import verify

NATIVE = ["native"]
#: Engine arguments every CUDA variant adds to verify's.
CUDA_COMMON = {
    "attention_backend": "TRITON_ATTN",
    "ir_op_priority": {
        "rms_norm": NATIVE,
        "fused_add_rms_norm": NATIVE,
        "gelu_and_mul_sparse": NATIVE,
    },
    # three engines share the card; each checks free memory at start
    "gpu_memory_utilization": 0.25,
}
VARIANTS = {
    "eager": {"enforce_eager": True, "compilation_config": {"custom_ops": ["none"]}},
    "cuda_graphs": {
        "enforce_eager": False,
        "compilation_config": {
            "mode": 0,
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "custom_ops": ["none"],
        },
    },
}
#: Lines of a stopped engine's output kept in the report.
TAIL = 40


def overrides(variant: str) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    return {**CUDA_COMMON, **VARIANTS[variant]}


def run_worker(mode: str, variant: str, model_dir: Path) -> int:
    """One engine: verify's worker with the variant's arguments added."""
    extra = overrides(variant)
    base = verify.engine_kwargs
    verify.engine_kwargs = lambda *a, **k: {**base(*a, **k), **extra}
    args = argparse.Namespace(
        model_dir=model_dir, kv_cache_dtype="auto", tensor_parallel_size=1
    )
    return verify.run_worker(mode, args)


def first_error(output: str) -> str | None:
    """The last line that names an exception, the likeliest cause."""
    lines = [
        line
        for line in output.splitlines()
        if "Error" in line or "Exception" in line or "error:" in line
    ]
    return lines[-1].strip() if lines else None


def run_variant(variant: str, model_dir: Path, timeout: float) -> dict:
    """verify's three engines at once; their results and verify's checks."""
    procs = {}
    for mode, (kv_flag, _) in verify.MODES.items():
        env = dict(os.environ, VLLM_HYBRID_KV=kv_flag)
        command = [sys.executable, __file__, "--worker", mode, "--variant", variant]
        command += ["--model-dir", str(model_dir)]
        procs[mode] = subprocess.Popen(
            ["timeout", "-s", "KILL", str(int(timeout)), *command],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    results, stopped = {}, {}
    for mode, proc in procs.items():
        output, _ = proc.communicate()
        found = [
            line
            for line in output.splitlines()
            if line.startswith(verify.RESULT_PREFIX)
        ]
        if found:
            results[mode] = json.loads(found[-1][len(verify.RESULT_PREFIX) :])
        else:
            stopped[mode] = {
                "rc": proc.returncode,
                "error": first_error(output),
                "tail": output.splitlines()[-TAIL:],
            }
    report: dict = {"variant": variant, "arguments": overrides(variant)}
    report["stopped"] = stopped
    if not stopped:
        checks = verify.evaluate(results)
        report["checks"] = [check.line() for check in checks]
        report["ok"] = all(check.ok for check in checks)
        report["token_capacity"] = {m: r["token_capacity"] for m, r in results.items()}
    else:
        report["ok"] = False
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--budget", type=float, default=600)
    parser.add_argument("--worker", choices=sorted(verify.MODES))
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="eager")
    parser.add_argument("--model-dir", type=Path)
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(args.worker, args.variant, args.model_dir)
    start = time.monotonic()
    from vllm_hybrid.tools.tiny_models import build_tiny_model

    work = Path(os.environ.get("GPU_RUN_WORK", "/tmp/vllm-hybrid-gpu"))
    model_dir = Path(build_tiny_model(work / "tiny-qwen3_5", "qwen3_5"))
    reports = []
    for i, variant in enumerate(VARIANTS):
        left = args.budget - 5 - (time.monotonic() - start)
        share = left / (len(VARIANTS) - i)
        if share < 20:
            reports.append({"variant": variant, "skipped": f"{left:.0f} s left"})
            continue
        reports.append(run_variant(variant, model_dir, share))
        print(json.dumps({k: reports[-1].get(k) for k in ("variant", "ok")}))
    write_json(args.out, {"model": "tiny qwen3_5", "variants": reports})
    return 0 if all(r.get("ok") for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
