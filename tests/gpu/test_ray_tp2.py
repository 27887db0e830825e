"""Pooled mode with vLLM's Ray executor on a CUDA cluster: TP=2 over Ray.

Marked ``gpu``: it needs two CUDA devices and Ray (vLLM's CPU platform refuses
the Ray executor), so it runs on the GPU runner only. Every Ray worker
imports vLLM, whose plugin loader activates the overlay there as in any
worker process; the test checks that each worker logged the activation line
and built the arena the engine core planned, and that the server answers.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from testing.loopback import serve

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

ACTIVE = re.compile(r"vllm-hybrid \S+ active on vLLM 0\.32\.0")
ARENA = re.compile(r"pooled KV arena on this worker: (.*)$")


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_ray_tp2_workers_activate_and_build_the_planned_arena(tiny_model_dir, tmp_path):
    if _cuda_devices() < 2:
        pytest.skip("needs two CUDA devices")
    if importlib.util.find_spec("ray") is None:
        pytest.skip("needs Ray (pip install ray)")
    model = str(tiny_model_dir("qwen3_next"))
    args = [
        "--tensor-parallel-size",
        "2",
        "--distributed-executor-backend",
        "ray",
        "--max-model-len",
        "1024",
        "--gpu-memory-utilization",
        "0.3",
    ]
    with serve(model, args, log_path=tmp_path / "ray.log") as server:
        status, body = server.request(
            "/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 8}
        )
        log = server.log_text()
    assert status == 200, body[:500]
    # API server, engine core and the two Ray workers
    assert len(ACTIVE.findall(log)) >= 4
    arenas = [
        m.group(1).strip() for line in log.splitlines() if (m := ARENA.search(line))
    ]
    assert len(arenas) == 2 and arenas[0] == arenas[1], arenas
    assert "KV cache plan (pooled)" in log
