"""The fork installed from ``vllm-hybrid fork --wheel`` in an environment
without vllm-hybrid, against the overlay (extended tier, slow).

* the whole archive: the structure checks of tests/tools/test_fork.py;
* vLLM's own ``tests/v1/core`` and the registry's selection of vLLM's tests
  give the outcomes they give with the overlay on (scripts/upstream_tests.sh
  --fork; deviations are listed in docs/upstream-tests.md);
* the fork's own tests (this repository's tests that went along) pass;
* the tiny qwen3_5 gives the overlay's greedy tokens in pooled mode, in bf16
  and turboquant_k8v4, with the same TurboQuant implementation on both sides
  (the wheel has no compiled kernel, so both run the torch implementation),
  and the fork logs pooled mode's plan.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hybrid.tools.fork import checks
from vllm_hybrid.tools.fork.generate import REPO_ROOT, materialize
from vllm_hybrid.tools.fork.sdist import find_sdist
from vllm_hybrid.tools.fork.wheel import fork_environment
from vllm_hybrid.tools.workloads import same_tokens_prompts

pytestmark = [pytest.mark.slow, pytest.mark.extended]

GREEDY = Path(__file__).with_name("fork_greedy.py")
UPSTREAM_TESTS = REPO_ROOT / "scripts" / "upstream_tests.sh"


@pytest.fixture(scope="module")
def fork(tmp_path_factory):
    return materialize(tmp_path_factory.mktemp("fork") / "f", None, wheel=True)


@pytest.fixture(scope="module")
def fork_python(fork, tmp_path_factory) -> Path:
    return fork_environment(fork.wheel, tmp_path_factory.mktemp("env") / "venv")


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of a child: nothing of this repository on its path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_HYBRID")}
    env.pop("PYTHONPATH", None)
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", **extra)
    return env


def test_the_whole_archive_has_the_forks_structure(fork):
    problems = checks.all_checks(fork.series, find_sdist(None))
    assert problems == {name: [] for name in problems}


def test_the_forks_environment_is_vllm_without_the_overlay(fork_python, tmp_path):
    probe = (
        "import importlib.util, vllm.config;"
        "print(importlib.util.find_spec('vllm_hybrid') is None,"
        " hasattr(vllm.config, 'HybridKVConfig'))"
    )
    done = subprocess.run(
        [str(fork_python), "-c", probe],
        capture_output=True,
        text=True,
        env=_clean_env(),
        cwd=tmp_path,  # not this checkout, whose package the cwd would show
        check=True,
    )
    assert done.stdout.split()[-2:] == ["True", "True"]


def test_the_forks_engine_arguments_parse(fork_python, tmp_path):
    """``--hybrid-kv-config`` next to vLLM's own ``--additional-config``; a
    bad value is one error naming the option."""
    probe = """
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
for argv in (
    ["--hybrid-kv-config.pooled", "false"],
    ["--hybrid-kv-config", '{"prefill_checkpoint_interval": 512}'],
    ["--additional-config", '{"x": 1}'],
):
    config = parser.parse_args(argv).hybrid_kv_config
    print(config.pooled, config.prefill_checkpoint_interval)
parser.parse_args(["--hybrid-kv-config", '{"prefill_checkpoint_interval": -1}'])
"""
    done = subprocess.run(
        [str(fork_python), "-c", probe],
        capture_output=True,
        text=True,
        env=_clean_env(),
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout.splitlines()[-3:] == ["False None", "True 512", "True None"]
    assert (
        "--hybrid-kv-config.prefill_checkpoint_interval must be a whole number"
        in done.stderr
    )


def _greedy(python: Path, model: Path, dtype: str, out: Path, env: dict) -> str:
    prompts = same_tokens_prompts(0, range(10, 500))
    done = subprocess.run(
        [str(python), str(GREEDY), str(model), dtype, json.dumps(prompts), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.parametrize("dtype", ["auto", "turboquant_k8v4"])
def test_the_fork_gives_the_overlays_greedy_tokens(
    fork_python, tiny_model_dir, tmp_path, dtype
):
    model = tiny_model_dir("qwen3_5")
    core = str(sorted(os.sched_getaffinity(0))[0])
    one_thread = {
        "VLLM_CPU_OMP_THREADS_BIND": core,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    overlay_env = _clean_env(**one_thread, PYTHONPATH=str(REPO_ROOT))
    # the fork's wheel has no compiled TurboQuant kernel: the overlay runs the
    # same torch implementation
    overlay_env["VLLM_HYBRID_TQ_NATIVE"] = "0"
    overlay_log = _greedy(
        Path(sys.executable), model, dtype, tmp_path / "overlay.json", overlay_env
    )
    fork_log = _greedy(
        fork_python, model, dtype, tmp_path / "fork.json", _clean_env(**one_thread)
    )
    overlay = json.loads((tmp_path / "overlay.json").read_text())
    forked = json.loads((tmp_path / "fork.json").read_text())
    assert "vllm-hybrid 0.1.0 active" in overlay_log
    assert "vllm-hybrid" not in fork_log
    assert forked == overlay
    # prefix hits on the second pass, and pooled mode's plan in the fork's log
    assert sum(forked["batches"][1]["cached"]) > 0
    plan = [line for line in fork_log.splitlines() if "KV cache plan (pooled)" in line]
    assert len(plan) == 1 and "token pool" in plan[0] and "state pool" in plan[0]


def test_the_forks_tests_pass_in_the_forks_environment(fork, fork_python):
    build = fork.series.build
    paths = [
        t.fork_path for t in build.tests if Path(t.fork_path).name.startswith("test_")
    ]
    done = subprocess.run(
        [
            str(fork_python),
            "-m",
            "pytest",
            *paths,
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "upstream_overlay",
            "--overlay=fork",
            "--hub-redirect=no",
        ],
        cwd=fork.series.root,
        capture_output=True,
        text=True,
        env=_clean_env(PYTHONPATH=_upstream_test_path()),
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-4000:]


def _upstream_test_path() -> str:
    """tests_upstream (the recording plugin) and vLLM's test dependencies,
    as scripts/upstream_tests.sh fetches them."""
    subprocess.run(
        ["bash", str(UPSTREAM_TESTS), "fetch"],
        check=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    cache = Path(os.environ.get("UPSTREAM_TESTS_DIR") or REPO_ROOT / ".upstream-tests")
    deps = next(cache.glob("deps-*"))
    return f"{REPO_ROOT / 'tests_upstream'}:{deps}"


def test_vllms_tests_give_the_overlays_outcomes_in_the_fork(fork_python):
    done = subprocess.run(
        ["bash", str(UPSTREAM_TESTS), "--fork", str(fork_python)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
        timeout=3000,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "upstream tests: same outcomes on/fork" in done.stdout
