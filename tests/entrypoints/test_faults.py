"""Faults a live server must survive or end cleanly: SIGTERM under load, a
tensor-parallel worker killed mid-request, clients arriving before start-up
ends. Each must end (or recover) within 30 s with a clear message."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import psutil
import pytest

from testing.loopback import RUNNING, request, scrape, serve, shutdown_report
from vllm_hybrid.v1.engine.async_llm import SHUTDOWN_MESSAGE

pytestmark = pytest.mark.slow

#: The bound the fault cases must end within.
END_WITHIN_S = 30.0
#: Output tokens of the in-flight requests: far more than they reach.
LONG = 1500
# eager: shutdown does not depend on compiled graphs, and compiling them
# would double each server's start (tests/entrypoints/test_openai_server.py
# serves the compiled default)
BUDGET = [
    "--max-model-len",
    "2048",
    "--kv-cache-memory-bytes",
    str(32 * 2**20),
    "--enforce-eager",
]


def _complete(url: str, model: str, max_tokens: int, timeout: float = 120.0):
    body = {
        "model": model,
        "prompt": "state space models " * 20,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    return request(url + "/v1/completions", body, timeout)


def _load(url: str, model: str, n: int) -> tuple[list[object], list[threading.Thread]]:
    """Start ``n`` long requests in threads; their outcomes land in the list."""
    outcomes: list[object] = []

    def one() -> None:
        try:
            status, raw = _complete(url, model, max_tokens=LONG)
        except (OSError, http.client.HTTPException) as exc:  # connection gone
            outcomes.append(type(getattr(exc, "reason", exc)).__name__)
            return
        if status == 200:
            outcomes.append((status, json.loads(raw)["usage"]["completion_tokens"]))
        else:
            outcomes.append((status, raw.decode(errors="replace")))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for thread in threads:
        thread.start()
    return outcomes, threads


def _join(threads: list[threading.Thread]) -> None:
    """Wait for the request threads (a guard against a hang, not a bound)."""
    for thread in threads:
        thread.join(timeout=END_WITHIN_S)


def _ended_by_shutdown(outcome: object) -> bool:
    if outcome in ("RemoteDisconnected", "ConnectionResetError", "IncompleteRead"):
        return True
    if not isinstance(outcome, tuple):
        return False
    status, detail = outcome
    if status == 200:
        return detail < LONG
    return status == 500 and SHUTDOWN_MESSAGE in detail


def _port_is_free(url: str) -> bool:
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _exits(proc: subprocess.Popen, timeout: float) -> bool:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _still_running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes still alive after up to 10 s (polled every 0.2 s).

    The server's children outlive it by a moment: they see their parent
    go and exit on their own, then wait as zombies for a reaper.
    """
    for _ in range(50):
        alive = [p for p in procs if _alive(p)]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def _wait_running(url: str, model: str, outcomes: list[object]) -> None:
    """Until the server reports running requests (decode under way)."""
    for _ in range(240):  # polled every 0.5 s: about two minutes
        if scrape(url, timeout=10).total(RUNNING):
            return
        time.sleep(0.5)
    raise AssertionError(f"no request started running; outcomes {outcomes}")


def test_sigterm_under_load_exits_cleanly_and_frees_the_port(tiny_model_dir, tmp_path):
    with serve(
        tiny_model_dir("qwen3_5"), BUDGET, log_path=tmp_path / "server.log"
    ) as server:
        children = psutil.Process(server.process.pid).children(recursive=True)
        outcomes, threads = _load(server.url, server.model, 4)
        _wait_running(server.url, server.model, outcomes)
        server.process.send_signal(signal.SIGTERM)
        assert _exits(server.process, END_WITHIN_S), "running 30 s after SIGTERM"
        report = shutdown_report(server, server.process.returncode)
        assert report.clean, report
        assert _port_is_free(server.url)
        assert not _still_running(children)
        # Every in-flight request ended, in one of the ways a stopping server
        # can end it: the engine's abort output reached the API server first
        # (200, cut short), the error naming the shutdown (500), or the HTTP
        # server closed the connection while stopping.
        _join(threads)
        assert len(outcomes) == 4, outcomes
        assert all(_ended_by_shutdown(o) for o in outcomes), outcomes


@pytest.mark.extended
def test_killed_tensor_parallel_worker_ends_the_server_with_a_clear_message(
    tiny_model_dir, tmp_path
):
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with serve(
        tiny_model_dir("qwen3_5"),
        [*BUDGET, "--tensor-parallel-size", "2"],
        log_path=tmp_path / "server.log",
        env=env,
    ) as server:
        workers = [
            p
            for p in psutil.Process(server.process.pid).children(recursive=True)
            if "Worker" in " ".join(p.cmdline()) or "Worker" in p.name()
        ]
        if len(workers) != 2:  # name the processes for the failure message
            tree = psutil.Process(server.process.pid).children(recursive=True)
            names = [(p.pid, p.name(), p.cmdline()[:3]) for p in tree]
            raise AssertionError(f"expected two TP workers, found {names}")
        outcomes, threads = _load(server.url, server.model, 2)
        _wait_running(server.url, server.model, outcomes)
        os.kill(workers[1].pid, signal.SIGKILL)
        assert _exits(server.process, END_WITHIN_S), "running 30 s after a worker died"
        log = server.log_text()
        assert re.search(r"Worker proc VllmWorker-\d died unexpectedly", log), log[
            -3000:
        ]
        _join(threads)
        assert len(outcomes) == 2 and (200, LONG) not in outcomes, outcomes
        assert _port_is_free(server.url)
