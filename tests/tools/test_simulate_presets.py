"""Every preset ``plan --list-presets`` names runs in ``simulate``: upstream,
upstream-best and pooled mode, at a GPU size where upstream vLLM starts.

The default tier starts the upstream engine of every preset on the
simulator's stand-in executor, in one process with the overlay off: the
engine that could not start for dense presets while the planned CUDA
platform answered a device question meant for this host's build. The
extended tier runs ``simulate --requests 200`` with all three engines for
every preset. Where upstream would refuse to start (Qwen3.5-9B on 24 GiB),
the command stops with vLLM's reason instead (``test_simulate_cli.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hybrid.tools.plan.presets import PRESETS
from vllm_hybrid.tools.simulate.runner import worker_env

#: Each preset at a GPU size its weights leave room on and upstream starts
#: at: vllm serve's defaults for that size, the model's max_model_len.
PRESET_RUNS: dict[str, list[str]] = {
    "qwen3.6-35b-a3b-fp8": ["--gpu-memory", "80"],
    "qwen3.5-35b-a3b": ["--gpu-memory", "141"],
    "qwen3.5-27b": ["--gpu-memory", "141"],
    "qwen3.5-9b": ["--gpu-memory", "48"],
    "qwen3-next-80b-a3b": ["--gpu-memory", "141", "-tp", "2"],
    "nemotron-3-nano-30b-a3b": ["--gpu-memory", "80"],
    "granite-4.0-h-small": ["--gpu-memory", "80"],
    "jamba-v0.1": ["--gpu-memory", "141"],
    "llama-2-7b": ["--gpu-memory", "24"],
}

#: Starts each case's engine in this process's mode and prints what it
#: planned, one JSON object.
_START = """
import json, sys
from vllm_hybrid.tools.plan.geometry import EngineOptions
from vllm_hybrid.tools.plan.request import model_dir
from vllm_hybrid.tools.simulate import cli
from vllm_hybrid.tools.simulate.engine import open_engine, overlay_active

started = {"overlay": overlay_active()}
for name, sizes in json.loads(sys.argv[1]).items():
    args, extra = cli.build_parser().parse_known_args([name, *sizes])
    request = cli.spec_from_args(args, extra).request
    with model_dir(request.model) as (directory, _):
        options = EngineOptions()
        with open_engine(request, directory, options, async_scheduling=True) as e:
            started[name] = {
                "num_blocks": e.scheduler.kv_cache_config.num_blocks,
                "max_num_seqs": e.vllm_config.scheduler_config.max_num_seqs,
                "device": e.vllm_config.device_config.device_type,
            }
print(json.dumps(started))
"""


def test_every_listed_preset_has_a_size() -> None:
    assert set(PRESET_RUNS) == set(PRESETS)


@pytest.mark.slow
def test_upstream_starts_for_every_preset_on_the_stand_in() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _START, json.dumps(PRESET_RUNS)],
        env=worker_env(overlay=False),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    started = json.loads(result.stdout.strip().splitlines()[-1])
    assert started.pop("overlay") is False
    assert set(started) == set(PRESET_RUNS)
    for name, engine in started.items():
        assert engine["device"] == "cuda", name
        # vLLM 0.32 starts full CUDA graphs only for at most num_blocks seqs
        assert engine["num_blocks"] >= engine["max_num_seqs"], name


@pytest.mark.extended
@pytest.mark.parametrize("name", sorted(PRESET_RUNS))
def test_every_preset_runs_three_engines_on_200_requests(name, tmp_path: Path) -> None:
    from vllm_hybrid.tools.simulate.cli import main

    out = tmp_path / "run.json"
    argv = [name, *PRESET_RUNS[name], "--requests", "200", "--retention-sweep", "0"]
    argv += ["--engines", "upstream,upstream-best,pooled", "--json", str(out)]
    assert main([*argv, "--jobs", "2", "--no-progress"]) == 0
    engines = json.loads(out.read_text())["engines"]
    assert list(engines) == ["upstream", "upstream-best", "pooled"]
    for engine in engines.values():
        run = engine["runs"][engine["best"]]
        counted = run["counted"]
        assert counted["outcome"] == "finished"
        # prompts at least max_model_len long are not sent (Llama-2's 2,048)
        assert counted["requests"] + counted["rejected"] == 200
        assert counted["finished"] == counted["requests"] > 0
        assert run["bench_serve"]["completed"] == counted["finished"]
