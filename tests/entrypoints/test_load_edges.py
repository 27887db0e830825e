"""Load a live pooled-mode server must absorb without failing a request:
clients that arrive while it is still starting, and a burst of
``--max-num-seqs 128`` requests on an arena that holds far fewer request
states than that (the scheduler must queue what does not fit, not fail it)."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from testing.loopback import (
    LOOPBACK,
    free_port,
    held_requests,
    read_log,
    request,
    serve,
    wait_idle,
)

pytestmark = pytest.mark.slow

#: Scheduling under load does not depend on compiled graphs, and compiling
#: them would double each server's start (tests/entrypoints/test_openai_server.py
#: serves the compiled default).
EAGER = ["--enforce-eager"]

WORDS = ("state", "space", "model", "delta", "gated", "token", "cache", "page")


def _complete(url: str, model: str, prompt: str, max_tokens: int, timeout: float):
    """``(status, completion tokens or error text)`` of one completion."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    status, raw = request(url + "/v1/completions", body, timeout)
    if status != 200:
        return status, raw.decode(errors="replace")[:300]
    return status, json.loads(raw)["usage"]["completion_tokens"]


# -- clients arriving during start-up -------------------------------------

#: Clients sending a completion while the server starts, each retrying a
#: refused connection every 0.25 s (up to about 5 minutes).
FLOOD = 24
FLOOD_TOKENS = 8
FLOOD_ATTEMPTS = 1200


def test_clients_arriving_during_start_up_are_served(tiny_model_dir, tmp_path):
    model = str(tiny_model_dir("qwen3_5"))
    port = free_port()
    url = f"http://{LOOPBACK}:{port}"
    results: list[object] = [None] * FLOOD
    refused = [0] * FLOOD
    probes: Counter[object] = Counter()
    done = threading.Event()

    def client(i: int) -> None:
        prompt = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(20 + i))
        for _ in range(FLOOD_ATTEMPTS):
            try:
                results[i] = _complete(url, model, prompt, FLOOD_TOKENS, 300.0)
                return
            except ConnectionRefusedError:
                refused[i] += 1
                time.sleep(0.25)
            except OSError as err:
                results[i] = type(err).__name__
                return
        results[i] = "gave up"

    def readiness_probe() -> None:
        # /health polled as an orchestrator's readiness probe would
        while not done.is_set():
            try:
                probes[request(url + "/health", timeout=5)[0]] += 1
            except OSError:
                probes["no answer"] += 1
            time.sleep(0.1)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(FLOOD)]
    threads.append(threading.Thread(target=readiness_probe))
    for thread in threads:
        thread.start()
    try:
        with serve(
            model,
            [
                *EAGER,
                "--max-model-len",
                "1024",
                "--kv-cache-memory-bytes",
                str(16 * 2**20),
            ],
            log_path=tmp_path / "server.log",
            port=port,
        ) as server:
            for thread in threads[:-1]:
                thread.join(timeout=300)
            status, _ = server.request("/health")
            problems = read_log(server.log_text()).while_serving
            # stop probing before the server shuts down: its engine core
            # exits first, and /health then rightly answers 503 until the
            # HTTP server closes
            done.set()
            threads[-1].join(timeout=30)
    finally:
        done.set()
        threads[-1].join(timeout=30)
    # every client was there before the server listened, and every one of
    # them got its whole completion
    assert all(n > 0 for n in refused), refused
    assert results == [(200, FLOOD_TOKENS)] * FLOOD, results
    assert status == 200
    assert problems == ()
    # the probe saw the server come up; while it served, no probe got a 5xx
    assert not threads[-1].is_alive()
    assert probes[200] > 0, probes
    assert not [code for code in probes if isinstance(code, int) and code >= 500]


# -- a burst of max_num_seqs requests on a small arena ---------------------

BURST = 128
BURST_BUDGET = 8 * 2**20


#: Long requests held open beyond what the arena can run at once.
HELD_EXTRA = 4


def _state_ids(plan_line: str) -> int:
    """State blocks the whole arena could hold (the plan line's state ids)."""
    match = re.search(r"state pool: .*?, (\d+) ids, (\d+) per request", plan_line)
    assert match, plan_line
    return int(match.group(1))


def test_burst_of_max_num_seqs_on_an_arena_of_few_states(tiny_model_dir, tmp_path):
    rng = random.Random(0)
    jobs = [
        (
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 200))),
            rng.randint(1, 16),
        )
        for _ in range(BURST)
    ]
    args = [*EAGER, "--max-model-len=1024", f"--kv-cache-memory-bytes={BURST_BUDGET}"]
    with serve(
        str(tiny_model_dir("qwen3_5")),
        [*args, f"--max-num-seqs={BURST}"],
        log_path=tmp_path / "server.log",
    ) as server:
        plan = [ln for ln in server.plan_lines() if "KV cache plan (pooled)" in ln]
        assert len(plan) == 1, server.plan_lines()
        states = _state_ids(plan[0])
        with ThreadPoolExecutor(BURST) as pool:
            results = list(
                pool.map(
                    lambda job: _complete(server.url, server.model, *job, 600.0),
                    jobs,
                )
            )
        idle = wait_idle(server.url)
        # more long requests than the arena has states, held open at once
        held = states + HELD_EXTRA
        with held_requests(server.url, server.model, held) as metrics:
            in_use = metrics.kv_in_use()
        idle_after_held = wait_idle(server.url)
        problems = read_log(server.log_text()).while_serving
    # the arena could never hold a state for each of the burst at once, and
    # every request got all its tokens; afterwards nothing is held
    assert states * 4 <= BURST, states
    assert results == [(200, max_tokens) for _, max_tokens in jobs]
    assert (
        idle
        == idle_after_held
        == {
            "running": 0.0,
            "waiting": 0.0,
            "kv_cache_usage_perc": 0.0,
            "token_used_bytes": 0.0,
            "state_used_bytes": 0.0,
        }
    )
    # while the long requests were held the scheduler ran no more than the
    # arena holds and queued the rest, both pools in use
    assert 1 < in_use["running"] <= states, (in_use, states)
    assert in_use["running"] + in_use["waiting"] == held, in_use
    assert in_use["token_used_bytes"] > 0 and in_use["state_used_bytes"] > 0
    assert problems == ()
