"""The GPU workflow users run on their self-hosted runner
(.github/workflows/gpu.yml, docs/cuda.md): its four named checks, each
running the command the docs give for it."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "gpu.yml"

#: Step name -> a command the step must run.
STEPS = {
    "README test command": "bash scripts/test.sh",
    "Kernel tier on CUDA": "pytest tests/kernels --kernel-tier",
    "vllm-hybrid verify": "vllm-hybrid verify",
    "Fork's tests": "bash scripts/fork_tests.sh",
}


def test_the_gpu_workflow_runs_the_four_named_checks():
    steps = yaml.safe_load(WORKFLOW.read_text())["jobs"]["gpu"]["steps"]
    by_name = {step.get("name"): step.get("run", "") for step in steps}
    for name, command in STEPS.items():
        assert command in by_name.get(name, ""), name
    assert "gpu" in yaml.safe_load(WORKFLOW.read_text())["jobs"]["gpu"]["runs-on"]
