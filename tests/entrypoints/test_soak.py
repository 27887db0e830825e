"""A bounded soak of a live server in pooled mode and with VLLM_HYBRID_KV=0.

Runs the phases of ``benchmarks/soak`` (warm-up, then mixed and burst
rounds: streaming and non-streaming chat and completions, a shared system
prompt and token prefix, conversations, prompts from 1 token to beyond
--max-model-len, n > 1, stop strings, max_tokens 1 and large, clients that
disconnect, bursts far above --max-num-seqs) once per mode on the tiny
``qwen3_5``, and asserts the soak's checks with their numbers. One server
per mode, shared by every test of that mode (module-scoped fixture).
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
from engine_utils import BENCHMARKS

if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from soak.checks import idle_values, same_tokens  # noqa: E402
from soak.client import FAILURES  # noqa: E402
from soak.config import SoakConfig, middle_phase, phase_plan  # noqa: E402
from soak.runner import rss_by_role, rss_growth_by_role, run_mode  # noqa: E402
from soak.workload import MIX, WorkloadContext, make_jobs  # noqa: E402

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 4
REQUESTS = 100  # per mode
BURST = 5 * MAX_NUM_SEQS
HANG_BOUND = 120.0
#: RSS growth from the middle of the run to its end. The engine worker's
#: private memory grows for its first ~450 requests in both modes (new batch
#: shapes; docs/benchmarks.md, "Soak"), so this short run compares the
#: pooled worker with upstream's worker on the same requests. The API server
#: and the engine core keep no memory per request: they stay flat
#: (measured: under 2 MiB).
FLAT_PROCESS_MIB = 16.0
WORKER_EXCESS_MIB = 64.0


def soak_config(model_dir, log_dir) -> SoakConfig:
    return SoakConfig(
        model="qwen3_5",
        requests=REQUESTS,
        rounds=2,
        burst=BURST,
        max_num_seqs=MAX_NUM_SEQS,
        concurrency=MAX_NUM_SEQS + 2,
        max_model_len=1024,
        kv_cache_mib=16,
        large_max_tokens=128,
        request_timeout=HANG_BOUND,
        seconds=900,
        model_dir=model_dir,
        log_dir=log_dir,
    )


# -- the mix and the checks, without a server


def test_phase_plan_spends_the_request_budget():
    cfg = SoakConfig(requests=REQUESTS, rounds=2, burst=BURST)
    plan = phase_plan(cfg)
    assert [p.name for p in plan] == [
        "warmup",
        "mixed-1",
        "burst-1",
        "mixed-2",
        "burst-2",
    ]
    assert sum(p.requests for p in plan) == REQUESTS
    assert [p.requests for p in plan if p.kind == "burst"] == [BURST, BURST]
    assert middle_phase(plan) == "burst-1"


def test_mix_is_seeded_and_holds_the_requested_count():
    ctx = WorkloadContext(vocab_size=960, max_model_len=1024, seed=3)
    a, b = make_jobs(ctx, "mixed-1", 200), make_jobs(ctx, "mixed-1", 200)
    assert [[s.body for s in j.specs] for j in a] == [
        [s.body for s in j.specs] for j in b
    ]
    assert sum(len(j.specs) for j in a) == 200
    specs = [s for j in a for s in j.specs]
    too_long = [s for s in specs if s.expect == 400]
    assert too_long and all(
        (s.prompt_len or 0) >= 1024 or len(s.body["messages"][-1]["content"]) > 4096
        for s in too_long
    )
    assert all(s.body["temperature"] > 0 for s in specs if s.n > 1)
    assert all("seed" not in s.body for s in specs)
    assert {s.disconnect_after for s in specs} >= {0, 1}
    assert len({s.prompt_len for s in specs if s.prompt_len}) > 20


def test_checks_fail_on_a_busy_pool_and_on_other_tokens():
    busy = (
        'vllm:num_requests_running{engine="0"} 0.0\n'
        'vllm:num_requests_waiting{engine="0"} 0.0\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.0\n'
        'vllm_hybrid:kv_pool_used_bytes{engine="0",pool="token"} 0.0\n'
        'vllm_hybrid:kv_pool_used_bytes{engine="0",pool="state"} 1609728.0\n'
    )
    values = idle_values(busy, pooled=True)
    assert values["state_used_bytes"] == 1609728.0 and values["token_used_bytes"] == 0
    assert same_tokens([[1, 2, 3]], [[1, 2, 3]]).ok
    check = same_tokens([[1, 2, 3], [4]], [[1, 2, 4], [4]])
    assert not check.ok and "1/2" in check.detail and "at token 2" in check.detail


# -- live soak, one server per mode (one at a time)

MODES = ("pooled", "upstream")


@pytest.fixture(scope="module")
def soaks(tiny_model_dir, tmp_path_factory):
    """The soak report of each mode; the pooled one first."""
    model_dir = tiny_model_dir("qwen3_5").parent
    reports = {}
    for mode in MODES:
        cfg = soak_config(model_dir, tmp_path_factory.mktemp(f"soak-{mode}"))
        reports[mode] = (cfg, run_mode(cfg, mode, log=lambda line: None))
        assert reports[mode][1].error == "", reports[mode][1].error
    return reports


@pytest.fixture(params=MODES)
def soak(request, soaks):
    return soaks[request.param]


def test_every_phase_ran_to_its_request_count(soak):
    cfg, report = soak
    assert [(p.name, p.sent, p.skipped) for p in report.phases] == [
        (p.name, p.requests, 0) for p in phase_plan(cfg)
    ]


def test_every_request_answered_without_5xx_or_hang(soak):
    _, report = soak
    total = report.totals()
    assert sum(total.values()) == REQUESTS
    assert total["5xx"] == 0
    assert total["hang"] == 0
    assert [p.unresolved for p in report.phases] == [0] * len(report.phases)
    slowest = max(p.latency["max"] for p in report.phases)
    assert slowest < HANG_BOUND


def test_answers_are_the_expected_ones(soak):
    _, report = soak
    total = report.totals()
    failures = {k: total[k] for k in FAILURES if total[k]}
    details = [f for p in report.phases for f in p.failures]
    assert failures == {}, details
    # prompts beyond max_model_len got their 400; clients did disconnect
    assert total["expected_4xx"] >= 3
    assert total["disconnected"] >= 3
    assert total["ok"] >= 0.75 * REQUESTS


def test_the_mix_covered_every_kind(soak):
    _, report = soak
    kinds: Counter = Counter()
    for phase in report.phases:
        kinds.update(phase.kinds)
    assert set(kinds) == set(MIX)


def test_bursts_queue_far_beyond_max_num_seqs(soak):
    _, report = soak
    bursts = [p for p in report.phases if p.kind == "burst"]
    assert len(bursts) == 2
    for phase in bursts:
        assert phase.threads == phase.sent == BURST
        assert phase.peaks["waiting"] >= MAX_NUM_SEQS, phase.peaks
    for phase in report.phases:
        assert 1 <= phase.peaks["running"] <= MAX_NUM_SEQS, (phase.name, phase.peaks)


def test_health_after_every_phase(soak):
    _, report = soak
    health = [
        (where, check.detail)
        for where, check in report.all_checks
        if check.name == "health"
    ]
    assert health == [(p.name, "/health 200") for p in report.phases] + [
        ("end", "/health 200")
    ]


def test_no_kv_block_held_when_idle(soak):
    _, report = soak
    for phase in report.phases:
        idle = phase.idle
        assert idle.ok, (phase.name, idle.detail)
        assert idle.values["running"] == idle.values["waiting"] == 0
        assert idle.values["kv_cache_usage_perc"] == 0
        if report.mode == "pooled":
            assert idle.values["token_used_bytes"] == 0, phase.name
            assert idle.values["state_used_bytes"] == 0, phase.name
            # both pools were busy during the phase
            assert phase.peaks["token_used_bytes"] > 0
            assert phase.peaks["state_used_bytes"] > 0
        else:
            # upstream's single pool publishes no per-pool gauges
            assert "token_used_bytes" not in idle.values
            assert phase.peaks["kv_cache_usage_perc"] > 0
    end = {c.name: c for where, c in report.all_checks if where == "end"}
    assert end["idle KV = 0"].ok, end["idle KV = 0"].detail


def test_greedy_tokens_same_at_start_and_end(soak):
    cfg, report = soak
    assert len(report.probes_start) == cfg.probes
    assert all(isinstance(t, list) for t in report.probes_start), report.probes_start
    assert [len(t) for t in report.probes_start] == [cfg.probe_tokens] * cfg.probes
    assert report.probes_end == report.probes_start


def _growth_mib(report) -> dict[str, float]:
    growth = rss_growth_by_role(report, report.rss_middle_phase, "end")
    return {role: value / 2**20 for role, value in growth.items()}


def test_api_server_and_engine_core_rss_flat(soak):
    _, report = soak
    roles = rss_by_role(report, "end")
    assert roles["api_server"] > 0 and roles["engine_core"] > 0 and roles["workers"] > 0
    growth = _growth_mib(report)
    assert growth["api_server"] < FLAT_PROCESS_MIB, growth
    assert growth["engine_core"] < FLAT_PROCESS_MIB, growth


def test_pooled_worker_rss_grows_no_more_than_upstreams(soaks):
    pooled = _growth_mib(soaks["pooled"][1])
    upstream = _growth_mib(soaks["upstream"][1])
    assert pooled["workers"] < upstream["workers"] + WORKER_EXCESS_MIB, (
        pooled,
        upstream,
    )


def test_clean_shutdown_and_quiet_log(soak):
    _, report = soak
    end = {c.name: c for where, c in report.all_checks if where == "end"}
    assert end["clean shutdown"].ok, end["clean shutdown"].detail
    assert end["no error in server log"].ok, end["no error in server log"].detail
    assert report.ok, [(w, c.name, c.detail) for w, c in report.all_checks if not c.ok]
