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


@pytest.fixture(scope="module")
def tp2_run(tiny_model_dir):
    env = dict(os.environ)
    env.pop("VLLM_HYBRID_KV", None)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND="0|1",
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_LOGGING_COLOR="0",
    )
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tiny_model_dir("qwen3_next"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    return log


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
def test_tp2_generates(tp2_run):
    line = next(ln for ln in tp2_run.splitlines() if ln.startswith("TP2_RESULT "))
    token_ids = json.loads(line.removeprefix("TP2_RESULT "))
    assert [len(ids) for ids in token_ids] == [8, 8]
