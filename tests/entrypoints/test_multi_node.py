"""Pooled mode under vLLM's multi-node executor: two "nodes" on loopback.

Node 0 runs ``vllm-hybrid serve`` with ``--nnodes 2 --node-rank 0``, node 1
the same command with ``--node-rank 1 --headless`` (vLLM's own multi-node
executor: one process per node rank, 127.0.0.1 as master), with tensor
parallel 2 and with pipeline parallel 2, so that each node holds one worker.
The overlay must be active in every process of both nodes, and both workers
must build the arena the engine core planned (with PP each stage's arena
holds its own layers; the tiny model's stages are alike, so the lines match).
With PP the greedy tokens of the pipeline test's prompts equal a one-node
PP=1 engine's (one thread per worker in both).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from testing.loopback import free_port, serve

pytestmark = pytest.mark.slow

ACTIVE = re.compile(r"\((\S+) pid=\d+\).*vllm-hybrid \S+ active on vLLM 0\.32\.0")
ARENA = re.compile(r"\((\S+) pid=\d+\).*pooled KV arena on this worker: (.*)$")
PP_ENGINE = Path(__file__).parents[1] / "v1" / "pipeline" / "pp_engine.py"
OUTPUT_TOKENS = 16


def _pipeline_prompts() -> list[list[int]]:
    """The pipeline test's prompts (token ids), from its engine script."""
    spec = importlib.util.spec_from_file_location("pp_engine", PP_ENGINE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [p["prompt_token_ids"] for p in module.PROMPTS]


def _greedy(node, model: str) -> list[list[int]]:
    """One completions request with every prompt, so that the server batches
    them as the offline engine does."""
    status, raw = node.request(
        "/v1/completions",
        {
            "model": model,
            "prompt": _pipeline_prompts(),
            "max_tokens": OUTPUT_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert status == 200, raw[:500]
    choices = sorted(json.loads(raw)["choices"], key=lambda c: c["index"])
    return [c["token_ids"] for c in choices]


def _args(parallel: str, master_port: int, rank: int) -> list[str]:
    return [
        f"--{parallel}-parallel-size",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        str(rank),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(master_port),
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(48 * 2**20),
        "--max-model-len",
        "1024",
        "--mamba-ssm-cache-dtype",
        "float32",
    ]


def _env(core: int) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_HYBRID_KV", None)
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=str(core),
        VLLM_LOGGING_COLOR="0",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture(
    scope="module",
    params=["tensor", pytest.param("pipeline", marks=pytest.mark.extended)],
)
def nodes(request, tiny_model_dir, tmp_path_factory):
    parallel = request.param
    model = str(tiny_model_dir("qwen3_next"))
    tmp = tmp_path_factory.mktemp("nodes")
    master = free_port()
    node1_log = tmp / "node1.log"
    with open(node1_log, "wb") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "vllm_hybrid.cli", "serve", model, "--headless"]
            + _args(parallel, master, 1),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(1),
        )
    try:
        with serve(
            model, _args(parallel, master, 0), log_path=tmp / "node0.log", env=_env(0)
        ) as node0:
            answer = node0.request(
                "/v1/completions",
                {"model": model, "prompt": "hello world", "max_tokens": 8},
            )
            tokens = _greedy(node0, model) if parallel == "pipeline" else None
            log0 = node0.log_text()
    finally:
        if node1.poll() is None:
            node1.terminate()
            try:
                node1.wait(timeout=30)
            except subprocess.TimeoutExpired:
                node1.kill()
                node1.wait()
    return answer, log0, node1_log.read_text(errors="replace"), parallel, tokens


def test_both_nodes_serve_one_model(nodes):
    (status, body), *_ = nodes
    assert status == 200, body[:500]


def test_pp2_across_two_nodes_gives_the_pp1_tokens(nodes, tiny_model_dir, tmp_path):
    *_, parallel, tokens = nodes
    if parallel != "pipeline":
        pytest.skip("compared for pipeline parallel (tensor parallel splits sums)")
    out = tmp_path / "pp1.json"
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0")
    env.pop("VLLM_HYBRID_KV", None)
    proc = subprocess.run(
        [sys.executable, str(PP_ENGINE), str(tiny_model_dir("qwen3_next")), "1"]
        + [str(out), "prefix"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    expected = json.loads(out.read_text())["tokens"]
    assert len(tokens) == 4 and all(len(t) == OUTPUT_TOKENS for t in tokens)
    assert tokens == expected


def test_overlay_is_active_in_every_process_of_both_nodes(nodes):
    _, node0, node1, *_ = nodes
    # node 0: the API server (logged as MainProcess), the engine core and its
    # worker; node 1: its launcher and its worker
    assert {m.group(1) for m in ACTIVE.finditer(node0)} >= {
        "MainProcess",
        "EngineCore",
        "VllmWorker-0",
    }
    assert {m.group(1) for m in ACTIVE.finditer(node1)} >= {
        "MainProcess",
        "VllmWorker-1",
    }


def test_both_workers_build_the_planned_arena(nodes):
    _, node0, node1, parallel, _ = nodes
    arenas = [
        m.group(2).strip()
        for text in (node0, node1)
        for line in text.splitlines()
        if (m := ARENA.search(line))
    ]
    assert len(arenas) == 2, arenas
    assert arenas[0] == arenas[1]
    assert "KV cache plan (pooled)" in node0
    # the worker's pools are the plan's: 48 MiB arena; a TP rank has half
    # the heads of every layer, a PP stage half the layers
    assert arenas[0].endswith("arena 50331648 B")
    layers = "1 attention layers" if parallel == "pipeline" else "2 attention layers"
    assert f"token pool: {layers}" in node0
