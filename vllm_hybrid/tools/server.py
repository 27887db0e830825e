"""Start and stop a loopback OpenAI-compatible vLLM server, for demo and tests.

The server runs ``vllm-hybrid serve`` in a child process (so the overlay is
activated exactly as a user's ``vllm serve`` would be), writes its log to a
file, and is shut down with SIGINT, vLLM's clean shutdown path.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

LOOPBACK = "127.0.0.1"

#: Log lines that describe the engine's KV cache plan.
PLAN_LINE_MARKERS = (
    "vllm-hybrid",
    "KV cache size",
    "Maximum concurrency",
    "attention block size",
    "Padding mamba page",
    "kv cache group sizes",
    "page unification",
    "KV cache plan",
)


#: One sample line of Prometheus' text format: name, optional labels, value.
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", re.M)


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """``{name: {labels text: value}}`` from a server's ``/metrics`` text."""
    out: dict[str, dict[str, float]] = {}
    for match in _SAMPLE.finditer(text):
        name, labels, value = match.groups()
        try:
            out.setdefault(name, {})[labels or ""] = float(value)
        except ValueError:
            continue
    return out


def post_json(url: str, body: dict, timeout: float = 120.0) -> tuple[int, bytes]:
    """POST ``body`` as JSON; ``(status, body)`` for 2xx and HTTP errors alike
    (connection errors raise)."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerHandle:
    """A running server: its base URL, child process and log file."""

    url: str
    process: subprocess.Popen
    log_path: Path
    model: str

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def plan_lines(self) -> list[str]:
        """The log lines that describe the KV cache plan."""
        return [
            line
            for line in self.log_text().splitlines()
            if any(marker in line for marker in PLAN_LINE_MARKERS)
        ]

    def request(
        self, path: str, body: dict | None = None, timeout: float = 120.0
    ) -> tuple[int, bytes]:
        """One HTTP request; returns ``(status, body)`` even for 4xx/5xx."""
        if body is not None:
            return post_json(self.url + path, body, timeout)
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def chat(self, content: str, max_tokens: int = 16, **extra) -> dict:
        status, raw = self.request(
            "/v1/chat/completions",
            {
                "model": self.model,
                "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens,
                "temperature": 0.0,
                **extra,
            },
        )
        if status != 200:
            raise RuntimeError(f"chat completion failed ({status}): {raw[:500]!r}")
        return json.loads(raw)


def _wait_ready(handle: ServerHandle, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if handle.process.poll() is not None:
            raise RuntimeError(
                f"server exited with code {handle.process.returncode} before "
                f"it was ready; log tail:\n{handle.log_text()[-4000:]}"
            )
        try:
            status, _ = handle.request("/health", timeout=2.0)
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(
        f"server not ready after {timeout:.0f}s; log tail:\n{handle.log_text()[-4000:]}"
    )


#: Messages upstream's processes print at exit that do not mean a failed
#: shutdown: Triton's nanobind reference-leak report (printed when the
#: interpreter exits with Triton loaded) and multiprocessing's resource
#: tracker warning about semaphores and shared memory it cleans up itself.
HARMLESS_SHUTDOWN_MARKERS = (
    "nanobind:",
    " - leaked ",
    " - ... skipped remainder",
    "See https://nanobind.readthedocs.io",
    "resource_tracker: There appear to be",
    "warnings.warn('resource_tracker:",
)
#: Where a shutdown begins in the log. vLLM's default shutdown
#: (``--shutdown-timeout 0``, "mode=abort") kills the engine core at once; the
#: API server's output handler may then log an ``EngineDeadError`` traceback
#: for the engine it just stopped. After this marker, that traceback (logged
#: from ``async_llm.py``) is upstream's shutdown race, not a failure.
SHUTDOWN_MARKER = "[shutdown] API server: shutdown triggered"
SHUTDOWN_RACE_SOURCE = "[async_llm.py:"
#: Messages that do mean something went wrong.
PROBLEM_MARKERS = ("Traceback (most recent call last)", "EngineDeadError", " ERROR ")


@dataclass(frozen=True)
class ShutdownReport:
    """What a stopped server's exit code and log say about its shutdown."""

    exit_code: int
    #: Log lines that are upstream's known exit-time messages.
    harmless_lines: int
    #: Log lines that report a failure (first few kept).
    problems: tuple[str, ...]

    @property
    def clean(self) -> bool:
        return self.exit_code == 0 and not self.problems


def shutdown_report(handle: ServerHandle, exit_code: int) -> ShutdownReport:
    """Classify the log of a stopped server."""
    harmless, problems, race = 0, [], []
    in_shutdown = False
    for line in handle.log_text().splitlines():
        in_shutdown = in_shutdown or SHUTDOWN_MARKER in line
        if any(marker in line for marker in HARMLESS_SHUTDOWN_MARKERS):
            harmless += 1
        elif in_shutdown and SHUTDOWN_RACE_SOURCE in line and " ERROR " in line:
            race.append(line.strip()[:200])
        elif any(marker in line for marker in PROBLEM_MARKERS):
            problems.append(line.strip()[:200])
    if any("EngineDeadError" in line for line in race):
        harmless += len(race)
    else:
        problems += race
    return ShutdownReport(exit_code, harmless, tuple(problems[:5]))


def stop(handle: ServerHandle, timeout: float = 60.0) -> int:
    """SIGINT, wait, then SIGKILL as a last resort; returns the exit code."""
    proc = handle.process
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


@contextmanager
def serve(
    model: str | os.PathLike,
    extra_args: Sequence[str] = (),
    log_path: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    ready_timeout: float = 300.0,
    port: int | None = None,
) -> Iterator[ServerHandle]:
    """Run ``vllm-hybrid serve MODEL`` on a loopback port (``port``, or a
    free one: a caller that sends requests while the server starts picks the
    port first)."""
    port = free_port() if port is None else port
    log_file = Path(log_path) if log_path else Path(f"/tmp/vllm-hybrid-{port}.log")
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("HF_HUB_OFFLINE", "1")
    child_env.setdefault("VLLM_NO_USAGE_STATS", "1")
    # The log is read while the server runs (plan lines, tests): no buffering.
    child_env["PYTHONUNBUFFERED"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "vllm_hybrid.cli",
        "serve",
        str(model),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        *extra_args,
    ]
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env
        )
    handle = ServerHandle(f"http://{LOOPBACK}:{port}", proc, log_file, str(model))
    try:
        _wait_ready(handle, ready_timeout)
        yield handle
    finally:
        stop(handle)
