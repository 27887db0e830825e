"""The device run's served-engine parts (scripts/gpu/serve.py): where a start-up
went, where it stopped, and the pooled / upstream ratios, from log lines and
results as vLLM writes them (no engine needed)."""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))

import serve  # noqa: E402

LOG = """\
(APIServer pid=1) INFO 11-27 17:57:40 [utils.py:1] vllm-hybrid 0.1.0 active
(APIServer pid=1) INFO 11-27 17:57:59 [api_utils.py:286] non-default args: {}
(EC pid=2) INFO 11-27 17:58:17 [core.py:133] Initializing a V1 LLM engine (v0.32.0)
(EC pid=2) INFO 11-27 17:58:20 [gpu_model_runner.py:1] Model loading took 0.1 GiB
(EC pid=2) ERROR 11-27 17:58:20 [core.py:1510] ModuleNotFoundError: No module named 'x'
"""


def test_stages_are_seconds_from_the_start_to_their_first_line():
    started = datetime(2026, 11, 27, 17, 57, 39)
    found = serve.stage_times(LOG, started)
    assert found == {
        "arguments parsed": 20.0,
        "engine configured": 38.0,
        "model loaded": 41.0,
    }
    assert serve.stopped_in(found) == "after 'model loaded', before 'memory profiled'"


def test_a_skipped_stage_does_not_hide_the_last_one_reached():
    # eager engines capture no CUDA graphs: the stop is after the last stage seen
    found = {"arguments parsed": 1, "KV cache allocated": 9, "engine ready": 10}
    assert serve.stopped_in(found) == "after 'engine ready', before 'serving'"
    assert serve.stopped_in({}) == "start-up before argument parsing (imports)"


def test_ratios_are_pooled_over_upstream_where_both_measured():
    def engine(ttft, tpot, hit):
        values = {"p50_ttft_ms": ttft, "p99_tpot_ms": tpot, "prefix_hit_rate": hit}
        return {"result": {"values": values}}

    ratios = serve.ratios(
        {"pooled": engine(50, 12, 0.8), "upstream": engine(80, 10, 0.5)}
    )
    assert ratios["p50_ttft_ms"] == 0.625
    assert ratios["p99_tpot_ms"] == 1.2
    assert "output_throughput" not in ratios
    assert ratios["prefix_hit_rate"] == {"pooled": 0.8, "upstream": 0.5}
    # an engine that stopped gives no ratio
    assert "p50_ttft_ms" not in serve.ratios({"pooled": engine(50, 12, 0.8)})


def test_every_mode_takes_the_v1_runner_only_when_asked(monkeypatch):
    monkeypatch.delenv("GPU_RUN_V1", raising=False)
    assert serve.mode_env("upstream")["VLLM_HYBRID_KV"] == "0"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in serve.mode_env("upstream")
    assert "VLLM_USE_V2_MODEL_RUNNER" not in serve.mode_env("pooled")
    monkeypatch.setenv("GPU_RUN_V1", "1")
    for mode in ("upstream", "pooled", "single_pool"):
        assert serve.mode_env(mode)["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_modes_are_verifys_as_server_flags():
    assert serve.mode_args("pooled") == serve.mode_args("upstream") == []
    assert serve.mode_args("single_pool") == [
        '--additional-config={"hybrid_kv": {"pooled": false}}'
    ]
