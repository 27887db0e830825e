"""OpenAI-compatible server on loopback, serving the tiny Qwen3.5-shaped hybrid."""

from __future__ import annotations

import json
import re

import pytest

from testing.loopback import (
    Metrics,
    connect,
    scrape,
    send,
    serve,
    shutdown_report,
    sse_events,
    stop,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(32 * 2**20)]
    with serve(tiny_model_dir("qwen3_5"), args, log_path=log) as handle:
        yield handle


def test_models_lists_the_served_model(server):
    status, raw = server.request("/v1/models")
    assert status == 200
    ids = [m["id"] for m in json.loads(raw)["data"]]
    assert ids == [server.model]


def test_chat_completion(server):
    reply = server.chat(
        "Tell me about state space models.", max_tokens=12, ignore_eos=True
    )
    assert reply["object"] == "chat.completion"
    assert isinstance(reply["choices"][0]["message"]["content"], str)
    assert reply["usage"]["completion_tokens"] == 12
    assert reply["usage"]["prompt_tokens"] > 5


def test_chat_completion_streaming(server):
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Stream a few words."}],
        "max_tokens": 10,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }
    with connect(server.url, 120.0) as conn:
        send(conn, "/v1/chat/completions", body)
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        # every event up to [DONE] (a stream that ends without it raises)
        chunks = list(sse_events(resp))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    assert len(text) > 0
    # one content chunk per generated token, plus role/final chunks
    content_chunks = [
        c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")
    ]
    assert 1 <= len(content_chunks) <= 10


def test_metrics(server):
    status, raw = server.request("/metrics")
    assert status == 200
    names = {name for name, _, _ in Metrics.parse(raw.decode()).samples}
    assert {"vllm:kv_cache_usage_perc", "vllm:num_requests_running"} <= names


def test_plan_log_line_describes_the_pools(server):
    lines = [ln for ln in server.plan_lines() if "KV cache plan (pooled)" in ln]
    assert len(lines) == 1, server.plan_lines()
    line = lines[0]
    # natural CPU attention block, unpadded GDN state page
    assert "block 128 tokens" in line
    assert "(0 B padding)" in line
    arena_mib = float(re.search(r"arena ([0-9.]+) MiB", line).group(1))
    assert arena_mib == pytest.approx(32.0, abs=0.01)


def test_metrics_per_pool_gauges(server):
    # a request with a long prompt, so both pools were used at some point
    server.chat("state space " * 200, max_tokens=4, ignore_eos=True)
    metrics = scrape(server.url)
    owned = metrics.by("vllm_hybrid:kv_pool_owned_bytes", "pool")
    used = metrics.by("vllm_hybrid:kv_pool_used_bytes", "pool")
    usage = metrics.by("vllm_hybrid:kv_pool_usage_perc", "pool")
    arena = metrics.by("vllm_hybrid:kv_arena_usage_perc", "pool")
    assert set(owned) == set(used) == set(usage) == {"token", "state"}
    assert set(arena) == {""}
    # the boundary splits the 32 MiB arena: both pools own memory, together
    # no more than the arena (the null region and block remainders are not
    # owned by either)
    assert owned["token"] > 0 and owned["state"] > 0
    assert 0.9 * 32 * 2**20 <= owned["token"] + owned["state"] <= 32 * 2**20
    # nothing is running any more: every block is free again
    assert used == {"token": 0.0, "state": 0.0}
    assert usage == {"token": 0.0, "state": 0.0}
    assert arena[""] == 0.0


@pytest.mark.parametrize(
    "body",
    [
        {"model": "x", "messages": "not a list"},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3},
        {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
    ],
    ids=["messages-not-a-list", "negative-max-tokens", "temperature-not-a-number"],
)
def test_malformed_request_gets_4xx_and_server_keeps_serving(server, body):
    body = {"model": server.model, **body} if "model" not in body else body
    status, raw = server.request("/v1/chat/completions", body)
    assert 400 <= status < 500, (status, raw[:300])
    error = json.loads(raw)
    message = json.dumps(error)
    assert len(message) > 20
    # still serving
    reply = server.chat("Are you still there?", max_tokens=4, ignore_eos=True)
    assert reply["usage"]["completion_tokens"] == 4


def test_invalid_json_gets_400(server):
    status, _ = server.request("/v1/chat/completions", b"{not json", timeout=60)
    assert 400 <= status < 500


def test_overlay_active_in_server_processes(server):
    lines = [ln for ln in server.log_text().splitlines() if "active on vLLM" in ln]
    pids = {re.search(r"pid=(\d+)", ln).group(1) for ln in lines}
    assert len(lines) == len(pids) >= 2, lines
    assert any("EngineCore" in ln for ln in lines), lines


def test_shutdown_is_clean_and_its_exit_noise_is_known(server):
    """Last in this module: SIGINT stops the server with exit code 0 and no
    failure in its log; what else it prints at exit is upstream's known
    noise (see ``testing.loopback.HARMLESS_SHUTDOWN_MARKERS``)."""
    report = shutdown_report(server, stop(server))
    assert report.exit_code == 0
    assert report.problems == ()
    assert report.clean
