"""Pipeline parallelism on CPU in eager mode.

vLLM 0.32's CPU worker skips its warm-up run in eager mode with an explicit
KV budget, and that run is where a later pipeline stage allocates the buffer
it receives activations in: PP=2 stopped at the first step for any model
(``AssertionError`` in the second stage, ``KeyError`` in the engine core).
With the overlay's registry entry on ``CPUWorker.compile_or_warm_up_model``
the tiny hybrid runs with PP=2 and gives the PP=1 tokens (one thread per
worker in both runs), in pooled mode: its two stages hold three GDN layers
and one attention layer each, so one id space and one boundary rule fit
both, and each stage's arena holds its own layers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("pp_engine.py")
ARENA = re.compile(r"\((Worker\S*) pid=\d+\).*pooled KV arena on this worker: (.*)$")


def _run(
    model: Path, pp: int, tmp: Path, overlay: bool = True
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND="|".join(str(i) for i in range(pp)),
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_HYBRID_KV="1" if overlay else "0",
    )
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(model), str(pp), str(tmp / f"pp{pp}.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("qwen3_next")
    found = {}
    for pp in (1, 2):
        tmp = tmp_path_factory.mktemp(f"pp{pp}")
        proc = _run(model, pp, tmp)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-4000:]
        found[pp] = (json.loads((tmp / f"pp{pp}.json").read_text())["tokens"], log)
    return found


def test_pp2_gives_the_pp1_tokens(runs):
    tokens = {pp: run[0] for pp, run in runs.items()}
    assert len(tokens[2]) == 4 and all(len(t) == 16 for t in tokens[2])
    assert tokens[2] == tokens[1]


def test_each_stage_builds_an_arena_of_its_own_layers(runs):
    whole, staged = runs[1][1], runs[2][1]
    assert "token pool: 2 attention layers" in whole
    assert "state pool: 6 state layers" in whole
    assert "token pool: 1 attention layers" in staged
    assert "state pool: 3 state layers" in staged
    arenas = {
        m.group(1): m.group(2).strip()
        for line in staged.splitlines()
        if (m := ARENA.search(line))
    }
    assert sorted(arenas) == ["Worker_PP0", "Worker_PP1"], arenas
    assert arenas["Worker_PP0"] == arenas["Worker_PP1"]
    # half the layers per stage: half the bytes per block, so at the same
    # budget at least twice the ids of the one-stage plan
    (one,) = {
        m.group(2).strip() for line in whole.splitlines() if (m := ARENA.search(line))
    }
    token1, state1 = (int(n) for n in re.findall(r"(\d+) ids", one))
    token2, state2 = (int(n) for n in re.findall(r"(\d+) ids", arenas["Worker_PP0"]))
    assert token2 == 2 * token1
    assert state2 >= 2 * state1


def test_without_the_overlay_the_second_stage_fails(tiny_model_dir, tmp_path):
    proc = _run(tiny_model_dir("qwen3_next"), 2, tmp_path, overlay=False)
    assert proc.returncode != 0
    assert "assert self.intermediate_tensors is not None" in proc.stdout + proc.stderr
