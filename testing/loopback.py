"""A loopback ``vllm-hybrid serve`` for the serving benchmark, the soak, the
demo, the GPU serve check and the server tests: a child process (the overlay
activated as for a user) logging to a file, stopped with SIGINT (vLLM's
clean shutdown); HTTP and server-sent events, ``/metrics``, what its log
says. Like :mod:`.inproc` for in-process engines, it is the one copy every
caller of a served engine shares.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, closing, contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

#: Modes and the value of ``VLLM_HYBRID_KV`` their server process gets.
MODES = {"pooled": "1", "upstream": "0"}
LOOPBACK = "127.0.0.1"
#: What every served vLLM process runs with unless told otherwise: no
#: download (the tiny models are local), no usage report.
OFFLINE = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# -- HTTP -------------------------------------------------------------------


def connect(url: str, timeout: float) -> closing[http.client.HTTPConnection]:
    """A connection to ``url``'s host, closed on exit (closing it mid-answer
    is how a client disconnects)."""
    parts = urlsplit(url)
    return closing(
        http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    )


def send(
    conn: http.client.HTTPConnection, path: str, body: dict | bytes | None = None
) -> None:
    """GET ``path``, or POST ``body`` as JSON (bytes as they are); the
    answer is left unread."""
    if body is None:
        conn.request("GET", path)
    else:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, data, {"Content-Type": "application/json"})


def request(
    url: str, body: dict | bytes | None = None, timeout: float = 120.0
) -> tuple[int, bytes]:
    """``(status, body)`` of a GET (or a JSON POST) of the full ``url``, for
    2xx and HTTP errors alike (connection errors raise)."""
    parts = urlsplit(url)
    with connect(url, timeout) as conn:
        send(conn, parts.path or "/", body)
        resp = conn.getresponse()
        return resp.status, resp.read()


def sse_events(resp: http.client.HTTPResponse) -> Iterator[dict]:
    """The JSON events of a server-sent event stream, up to ``[DONE]``; a
    stream that ends without it raises ``ValueError``."""
    for raw in resp:
        line = raw.strip()
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield json.loads(data)
    raise ValueError("stream ended without [DONE]")


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


# -- /metrics ---------------------------------------------------------------

#: vLLM's counters count tokens: prompt tokens looked up in the prefix
#: cache, and those of them found there.
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREEMPTIONS = "vllm:num_preemptions_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
#: The overlay's per-pool gauge (pooled mode only), labelled ``pool``.
POOL_USED = "vllm_hybrid:kv_pool_used_bytes"


@dataclass(frozen=True)
class Metrics:
    """One read of ``/metrics``: every sample's name, labels and value."""

    samples: tuple[tuple[str, dict[str, str], float], ...]

    @classmethod
    def parse(cls, text: str) -> Metrics:
        return cls(
            tuple(
                (s.name, dict(s.labels), float(s.value))
                for family in text_string_to_metric_families(text)
                for s in family.samples
            )
        )

    def total(self, name: str) -> float:
        """Sum over label sets (one per engine)."""
        return sum(value for n, _, value in self.samples if n == name)

    def by(self, name: str, label: str) -> dict[str, float]:
        """``{label value: summed value}`` of one sample name."""
        out: Counter[str] = Counter()
        for n, labels, value in self.samples:
            if n == name:
                out[labels.get(label, "")] += value
        return dict(out)

    def kv_in_use(self) -> dict[str, float]:
        """Requests and KV memory in use: running, waiting, vLLM's usage
        gauge and, in pooled mode, each pool's used bytes (all 0 when idle)."""
        pools = self.by(POOL_USED, "pool").items()
        return {
            "running": self.total(RUNNING),
            "waiting": self.total(WAITING),
            "kv_cache_usage_perc": self.total(KV_USAGE),
            **{f"{pool}_used_bytes": value for pool, value in pools},
        }


def scrape(url: str, timeout: float = 30.0) -> Metrics:
    status, raw = request(url + "/metrics", timeout=timeout)
    if status != 200:
        raise OSError(f"/metrics answered {status}")
    return Metrics.parse(raw.decode())


def wait_idle(url: str, tries: int = 120, pause: float = 0.5) -> dict[str, float]:
    """:meth:`Metrics.kv_in_use` once all read 0, else after ``tries``."""
    for _ in range(tries):
        values = scrape(url).kv_in_use()
        if not any(values.values()):
            break
        time.sleep(pause)
    return values


@contextmanager
def held_requests(
    url: str, model: str, count: int, max_tokens: int = 256
) -> Iterator[Metrics]:
    """Hold ``count`` streaming completions of ``max_tokens`` tokens open and
    yield ``/metrics`` once all reached the scheduler (held, not sampled);
    closing the streams on exit aborts them."""
    body = {
        "model": model,
        "prompt": [11 + i for i in range(16)],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    with ExitStack() as stack:
        for _ in range(count):
            send(stack.enter_context(connect(url, 120.0)), COMPLETIONS, body)
        for _ in range(600):
            metrics = scrape(url)
            if metrics.total(RUNNING) + metrics.total(WAITING) >= count:
                break
            time.sleep(0.1)
        yield metrics


# -- the server -------------------------------------------------------------

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
        self, path: str, body: dict | bytes | None = None, timeout: float = 120.0
    ) -> tuple[int, bytes]:
        """One HTTP request; returns ``(status, body)`` even for 4xx/5xx."""
        return request(self.url + path, body, timeout)

    def chat(self, content: str, max_tokens: int = 16, **extra) -> dict:
        messages = [{"role": "user", "content": content}]
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens}
        status, raw = self.request(CHAT, body | {"temperature": 0.0, **extra})
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
        with suppress(OSError):  # not listening yet
            if handle.request("/health", timeout=2.0)[0] == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(
        f"server not ready after {timeout:.0f}s; log tail:\n{handle.log_text()[-4000:]}"
    )


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
    free one)."""
    port = free_port() if port is None else port
    log_file = Path(log_path) if log_path else Path(f"/tmp/vllm-hybrid-{port}.log")
    # The log is read while the server runs (plan lines, tests): no buffering.
    child_env = OFFLINE | dict(os.environ if env is None else env)
    child_env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "vllm_hybrid.cli", "serve", str(model)]
    cmd += ["--host", LOOPBACK, "--port", str(port), *extra_args]
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


def mode_env(mode: str) -> dict[str, str]:
    """This process's environment with ``mode``'s ``VLLM_HYBRID_KV`` (and
    :data:`OFFLINE` where it does not say otherwise)."""
    return OFFLINE | dict(os.environ, VLLM_HYBRID_KV=MODES[mode])


# -- what the log says ------------------------------------------------------

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
#: A process that crashed: what it logged is the cause, the exceptions of
#: the processes around it are consequences.
CRASH_MARKERS = ("Segfault encountered", "Segmentation fault", "Fatal Python error")


@dataclass(frozen=True)
class LogReport:
    """What a server's log says went wrong, if anything."""

    #: Lines that are upstream's known exit-time messages.
    harmless_lines: int
    #: Lines that report a failure before the shutdown began (first few).
    while_serving: tuple[str, ...]
    #: Lines that report a failure, the shutdown's included (first few).
    problems: tuple[str, ...]
    #: The one line that best says what went wrong ("" when nothing did).
    cause: str


def _cause(lines: list[str]) -> str:
    """A crash and its first frame outside libc, else the first exception
    that is not a consequential ``EngineDeadError``, else the first problem."""
    for i, line in enumerate(lines):
        if any(marker in line for marker in CRASH_MARKERS):
            frames = lines[i + 1 : i + 6]
            frames = [x for x in frames if x.startswith("File ") and "sysdeps" not in x]
            return f"{line} {frames[0]}" if frames else line
    for line in (x for x in lines if " ERROR " in x or not x.startswith("(")):
        head = line.split("] ", 1)[-1]
        exception = head.split(":", 1)[0].rsplit(".", 1)[-1]
        if exception.endswith(("Error", "Exception")) and "EngineDeadError" not in line:
            return line
    return next((x for x in lines if any(m in x for m in PROBLEM_MARKERS)), "")


def read_log(text: str, limit: int = 5) -> LogReport:
    """Classify a server log (pure, for tests)."""
    harmless, serving, problems, race = 0, [], [], []
    in_shutdown = False
    for raw in text.splitlines():
        line = raw.strip()[:240]
        in_shutdown = in_shutdown or SHUTDOWN_MARKER in raw
        if any(marker in raw for marker in HARMLESS_SHUTDOWN_MARKERS):
            harmless += 1
        elif in_shutdown and SHUTDOWN_RACE_SOURCE in raw and " ERROR " in raw:
            race.append(line)
        elif any(marker in raw for marker in PROBLEM_MARKERS + CRASH_MARKERS):
            problems.append(line)
            serving += [] if in_shutdown else [line]
    if any("EngineDeadError" in line for line in race):
        harmless += len(race)
    else:
        problems += race
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    cause = _cause(lines)[:240] if problems else ""
    return LogReport(harmless, tuple(serving[:limit]), tuple(problems[:limit]), cause)


@dataclass(frozen=True)
class ShutdownReport(LogReport):
    """A stopped server's log and exit code."""

    exit_code: int = 0

    @property
    def clean(self) -> bool:
        return self.exit_code == 0 and not self.problems


def shutdown_report(handle: ServerHandle, exit_code: int) -> ShutdownReport:
    """Classify the log of a stopped server."""
    return ShutdownReport(**asdict(read_log(handle.log_text())), exit_code=exit_code)
