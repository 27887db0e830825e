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
FILL = Path(__file__).with_name("pp_fill.py")
ARENA = re.compile(r"\((Worker\S*) pid=\d+\).*pooled KV arena on this worker: (.*)$")


def _env(pp: int, overlay: bool = True, partition: str | None = None) -> dict:
    env = dict(os.environ)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND="|".join(str(i) for i in range(pp)),
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_HYBRID_KV="1" if overlay else "0",
    )
    env.pop("VLLM_PP_LAYER_PARTITION", None)
    if partition is not None:
        # vLLM's own split of the decoder layers over the stages
        env["VLLM_PP_LAYER_PARTITION"] = partition
    return env


def _run(
    model: Path,
    pp: int,
    tmp: Path,
    overlay: bool = True,
    partition: str | None = None,
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(model), str(pp), str(tmp / f"pp{pp}.json")],
        env=_env(pp, overlay, partition),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("qwen3_next")
    found = {}
    # "6,2": layers 0-5 (5 GDN + 1 attention) and 6-7 (1 GDN + 1 attention)
    for key, pp, partition in ((1, 1, None), (2, 2, None), ("6,2", 2, "6,2")):
        tmp = tmp_path_factory.mktemp(f"pp{pp}")
        proc = _run(model, pp, tmp, partition=partition)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-4000:]
        found[key] = (json.loads((tmp / f"pp{pp}.json").read_text())["tokens"], log)
    return found


def test_pp2_gives_the_pp1_tokens(runs):
    tokens = {pp: run[0] for pp, run in runs.items()}
    assert len(tokens[2]) == 4 and all(len(t) == 16 for t in tokens[2])
    assert tokens[2] == tokens[1]
    assert tokens["6,2"] == tokens[1]


def _arenas(log: str) -> dict[str, str]:
    return {
        m.group(1): m.group(2).strip()
        for line in log.splitlines()
        if (m := ARENA.search(line))
    }


def test_stages_of_other_block_bytes_share_blocks_padded_to_the_largest(runs):
    log = runs["6,2"][1]
    # stage 1 holds one GDN layer, stage 0 five: its state block is padded
    # to five pages (268,288 B each, float32 SSM state)
    assert (
        "stage 0: token 131,072 of 131,072 B, state 1,341,440 of 1,341,440 B; "
        "stage 1: token 131,072 of 131,072 B, state 268,288 of 1,341,440 B"
    ) in log
    arenas = _arenas(log)
    assert sorted(arenas) == ["Worker_PP0", "Worker_PP1"], arenas
    assert arenas["Worker_PP0"] == arenas["Worker_PP1"]
    assert "state pool 37 ids x 1341440 B" in arenas["Worker_PP0"]


def test_each_stage_builds_an_arena_of_its_own_layers(runs):
    whole, staged = runs[1][1], runs[2][1]
    assert "token pool: 2 attention layers" in whole
    assert "state pool: 6 state layers" in whole
    assert "token pool: 1 attention layers" in staged
    assert "state pool: 3 state layers" in staged
    arenas = _arenas(staged)
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


def test_one_request_fills_the_logged_token_capacity(tiny_model_dir, tmp_path):
    """The capacity the engine logs under PP is what the arena holds on every
    stage: one request of exactly that many tokens runs without preemption,
    uses every token block the plan has at the state pool's floor, and its
    greedy tokens equal a PP=1 engine's with room to spare."""
    model = tiny_model_dir("qwen3_next")
    out = tmp_path / "fill.json"
    proc = subprocess.run(
        [sys.executable, str(FILL), str(model), "2", "8", "-1", str(out)],
        env=_env(2, partition="6,2"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    fill = json.loads(out.read_text())
    block = fill["block_size"]
    assert fill["max_model_len"] == fill["capacity"] == 6_656 == 52 * block
    assert fill["token_capacity_at_floor"] == 52
    assert fill["peak_token_blocks"] == 52
    assert fill["peak_state_blocks"] == 1
    assert fill["preemptions"] == 0
    assert fill["token_used_after"] == fill["state_used_after"] == 0
    reference = tmp_path / "reference.json"
    proc = subprocess.run(
        [sys.executable, str(FILL), str(model), "1", "32", "6656", str(reference)],
        env=_env(1),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    expected = json.loads(reference.read_text())
    assert len(fill["tokens"]) == 8
    assert fill["tokens"] == expected["tokens"]
