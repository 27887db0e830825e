"""Pooled mode, the single shared pool and upstream produce the same greedy
tokens on the tiny hybrids, with prefix caching at small attention blocks:
``vllm-hybrid verify``, the command a user runs to check an install.

On CUDA (tests marked ``gpu``, run by a GPU runner) the command runs what
CUDA users run: CUDA graphs, 16-token blocks, bf16 and ``turboquant_k8v4``
KV, both tiny hybrids, and TP=2 where two GPUs exist. Here, on CPU, the same
command runs eagerly at 32-token blocks, so the GPU suite's code is
exercised before a GPU ever runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm_hybrid.tools import verify

pytestmark = pytest.mark.slow


def run_verify(tmp_path, *args: str) -> tuple[int, dict, str]:
    report = tmp_path / "verify.json"
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_hybrid.tools.verify", "--json", str(report)]
        + list(args),
        capture_output=True,
        text=True,
        timeout=2400,
    )
    data = json.loads(report.read_text()) if report.exists() else {}
    return proc.returncode, data, proc.stdout + proc.stderr[-3000:]


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_verify_passes_on_cpu(tmp_path):
    code, report, output = run_verify(tmp_path)
    assert code == 0, output
    names = [check["name"] for check in report["checks"]]
    assert all(check["ok"] for check in report["checks"])
    # 3 overlay-state checks, the arena check, 2 modes x 2 passes of tokens
    assert len(names) == 8
    assert "pooled arena planned and aligned" in names
    assert "token capacity: pooled" in output


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "turboquant_k8v4"])
@pytest.mark.parametrize("tp", [1, 2])
def test_verify_passes_on_cuda_with_graphs(tmp_path, kind, kv_cache_dtype, tp):
    if tp > _cuda_devices():
        pytest.skip(f"TP={tp} needs {tp} CUDA devices")
    code, report, output = run_verify(
        tmp_path,
        "--kind",
        kind,
        "--kv-cache-dtype",
        kv_cache_dtype,
        "--tensor-parallel-size",
        str(tp),
    )
    assert code == 0, output
    assert "cuda (CUDA graphs, 16-token blocks)" in output


def _result(tokens, gaps, **extra):
    run = {"tokens": tokens, "gaps": gaps}
    return {
        "overlay_active": True,
        "pooled": True,
        "pools": "p",
        "misaligned": [],
        "first": run,
        "again": run,
        "token_capacity": 1,
        **extra,
    }


def test_verify_checks_fail_on_a_confident_difference_or_misalignment():
    upstream = _result([[1, 2, 3]], [[0.5, 0.01, 0.5]], overlay_active=False)
    same = _result([[1, 2, 3]], [[0.5, 0.01, 0.5]])
    near_tie = _result([[1, 9, 9]], [[0.5, 0.5, 0.5]])
    confident = _result([[9, 2, 3]], [[0.5, 0.5, 0.5]])
    misaligned = _result([[1, 2, 3]], [[0.5]], misaligned=["l0: offset 3"])

    def failed(results):
        return [c.name for c in verify.evaluate(results) if not c.ok]

    ok = {"pooled": same, "single_pool": near_tie, "upstream": upstream}
    assert failed(ok) == []
    bad = failed({**ok, "single_pool": confident})
    assert bad == [
        "single_pool tokens equal upstream's (first pass)",
        "single_pool tokens equal upstream's (again pass)",
    ]
    assert failed({**ok, "pooled": misaligned}) == ["pooled arena planned and aligned"]
    assert failed({**ok, "upstream": same}) == ["overlay off in the upstream engine"]
