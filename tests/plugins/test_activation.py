"""The overlay activates once in every vLLM process kind.

A ``tensor_parallel_size=2`` run over the multiprocessing executor has a front
end, an engine-core process and two worker processes; vLLM loads the general
plugins in each. Every process must log the activation line exactly once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("run_tp2.py")
LINE = re.compile(
    r"\((?P<proc>[^ ()]+) pid=(?P<pid>\d+)\) INFO .*"
    r"vllm-hybrid \S+ active on vLLM 0\.32\.0"
)


def _run_tp2(model_dir: str, switch: str | None) -> str:
    env = dict(os.environ)
    env.pop("VLLM_HYBRID_KV", None)
    if switch is not None:
        env["VLLM_HYBRID_KV"] = switch
    env.update(
        VLLM_CPU_OMP_THREADS_BIND="0|1",
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_LOGGING_COLOR="0",
    )
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), model_dir],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    return log


@pytest.fixture(scope="module")
def tp2_run(tiny_model_dir):
    return _run_tp2(str(tiny_model_dir("qwen3_next")), switch=None)


@pytest.fixture(scope="module")
def tp2_upstream_run(tiny_model_dir):
    return _run_tp2(str(tiny_model_dir("qwen3_next")), switch="0")


def _tokens(log: str) -> list[list[int]]:
    line = next(ln for ln in log.splitlines() if ln.startswith("TP2_RESULT "))
    return json.loads(line.removeprefix("TP2_RESULT "))


@pytest.mark.slow
def test_activation_line_once_per_process(tp2_run):
    hits = [m.groupdict() for m in map(LINE.search, tp2_run.splitlines()) if m]
    per_pid = Counter(hit["pid"] for hit in hits)
    assert per_pid and max(per_pid.values()) == 1, per_pid
    kinds = {hit["proc"] for hit in hits}
    assert any(k.startswith("EngineCore") for k in kinds), kinds
    workers = sorted(k for k in kinds if "Worker" in k)
    assert len(workers) == 2, kinds
    # Front end (process 0) logs too; model inspection subprocesses may add
    # more MainProcess lines, each with its own pid.
    assert "MainProcess" in kinds, kinds
    engine_and_workers = [h for h in hits if h["proc"] != "MainProcess"]
    assert len(engine_and_workers) == 3, engine_and_workers


@pytest.mark.slow
def test_tp2_pooled_worker_uses_the_engine_core_plan(tp2_run):
    """Rank 0's arena view equals the engine core's plan (vLLM keeps INFO
    lines of other ranks quiet; every rank gets a copy of the same config,
    see tests/v1/core/pooled/test_planner.py, and identical outputs to
    upstream below show rank 1 computed with it)."""
    plan = re.search(r"KV cache plan \(pooled\).*token pool: .*?(\d+) ids;", tp2_run)
    view = re.search(r"pooled KV arena on this worker: token pool (\d+) ids", tp2_run)
    assert plan and view, tp2_run[-3000:]
    assert plan.group(1) == view.group(1)


@pytest.mark.slow
def test_tp2_greedy_outputs_equal_upstream(tp2_run, tp2_upstream_run):
    pooled, upstream = _tokens(tp2_run), _tokens(tp2_upstream_run)
    assert [len(ids) for ids in pooled] == [8, 8]
    assert pooled == upstream
    assert "inactive: VLLM_HYBRID_KV=0" in tp2_upstream_run
