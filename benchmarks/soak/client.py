"""The soak client: loopback HTTP from threads, every request bounded.

Each request ends in an :class:`Outcome` whose ``result`` is one of
:data:`RESULTS`. A socket timeout bounds every read and a deadline bounds a
whole request, so a request that the server never finishes ends as
``"hang"`` instead of blocking the run.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from vllm_hybrid.tools.server import parse_metrics

from .workload import CHAT, Job, RequestSpec

#: ok: 200 and a valid response; expected_4xx: the 400 a too-long prompt
#: must get; disconnected: the client closed the connection on purpose;
#: unexpected_4xx, 5xx, invalid (200 that breaks a rule, or 200 where a 400
#: was due), stream_error (an error event inside a 200 stream), hang (no
#: answer within the bound), transport (connection refused or reset):
#: failures.
RESULTS = (
    "ok",
    "expected_4xx",
    "disconnected",
    "unexpected_4xx",
    "5xx",
    "invalid",
    "stream_error",
    "hang",
    "transport",
)
FAILURES = frozenset(RESULTS[3:])
#: What a 400 for a prompt beyond --max-model-len says. A prompt of exactly
#: max_model_len tokens leaves no room: vLLM lowers max_tokens to 0 and
#: answers with its max_tokens error.
TOO_LONG_MARKERS = (
    "maximum context length",
    "max_model_len",
    "max_tokens must be at least 1, got 0",
)


@dataclass
class Outcome:
    rid: str
    kind: str
    result: str
    status: int | None
    seconds: float
    detail: str = ""
    #: Token ids of choice 0 (only when the request asked for them).
    token_ids: list[int] | None = None
    #: Generated text of choice 0 (conversations append it to the history).
    text: str = ""

    @property
    def failed(self) -> bool:
        return self.result in FAILURES


@dataclass
class Target:
    """Where requests go: host, port and the served model name."""

    url: str
    model: str
    max_model_len: int
    timeout: float = 120.0

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", int(parts.port or 80)

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        host, port = self.host_port
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()


def _choice_text(choice: dict, endpoint: str, stream: bool) -> str:
    if endpoint == CHAT:
        part = choice.get("delta" if stream else "message") or {}
        return part.get("content") or ""
    return choice.get("text") or ""


def _validate(
    spec: RequestSpec, texts: dict[int, str], finish: dict, usage, max_model_len: int
) -> str:
    """The first rule a 200 response breaks, or ""."""
    n = spec.n
    if sorted(texts) != list(range(n)):
        return f"choices {sorted(texts)} for n={n}"
    if sorted(finish) != list(range(n)):
        return f"finish reasons for choices {sorted(finish)} for n={n}"
    if any(reason not in ("stop", "length") for reason in finish.values()):
        return f"finish reasons {sorted(set(finish.values()))}"
    for text in texts.values():
        for stop in spec.stop:
            if stop in text:
                return f"stop string {stop!r} in the output {text[:80]!r}"
    if not isinstance(usage, dict):
        return "no usage"
    prompt_tokens = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    if spec.prompt_len is not None and prompt_tokens != spec.prompt_len:
        return f"prompt_tokens {prompt_tokens} != {spec.prompt_len}"
    # vLLM lowers max_tokens to the room the prompt leaves
    cap = min(int(spec.body["max_tokens"]), max_model_len - prompt_tokens)
    if not n <= completion <= n * cap:
        return f"completion_tokens {completion} not in [{n}, {n * cap}]"
    if spec.body.get("ignore_eos") and not spec.stop and completion != n * cap:
        return f"ignore_eos: completion_tokens {completion} != {n * cap}"
    return ""


def send(target: Target, spec: RequestSpec, body: dict | None = None) -> Outcome:
    """Send one request and classify what came back."""
    body = dict(spec.body if body is None else body)
    body["model"] = target.model
    data = json.dumps(body).encode()
    host, port = target.host_port
    start = time.monotonic()
    deadline = start + target.timeout

    def done(result: str, status: int | None, detail: str = "", **kw) -> Outcome:
        seconds = time.monotonic() - start
        if seconds > target.timeout and result not in ("hang", "disconnected"):
            detail = f"took {seconds:.1f}s > {target.timeout:.0f}s; {detail}"
            result = "hang"
        return Outcome(spec.rid, spec.kind, result, status, seconds, detail, **kw)

    conn = http.client.HTTPConnection(host, port, timeout=target.timeout)
    try:
        conn.request(
            "POST",
            spec.endpoint,
            body=data,
            headers={"Content-Type": "application/json"},
        )
        if spec.disconnect_after == 0:
            time.sleep(0.05)
            return done("disconnected", None, "closed before the response")
        resp = conn.getresponse()
        status = resp.status
        if status != 200:
            raw = resp.read()
            return _classify_error(spec, status, raw, done)
        if spec.expect != 200:
            resp.read()
            return done("invalid", status, f"200 where {spec.expect} was due")
        if spec.stream:
            return _read_stream(spec, resp, deadline, target.max_model_len, done)
        payload = json.loads(resp.read())
        choices = payload.get("choices") or []
        texts = {c["index"]: _choice_text(c, spec.endpoint, False) for c in choices}
        finish = {c["index"]: c.get("finish_reason") for c in choices}
        problem = _validate(
            spec, texts, finish, payload.get("usage"), target.max_model_len
        )
        first = choices[0] if choices else {}
        ids = first.get("token_ids")
        if problem:
            return done("invalid", status, problem)
        return done("ok", status, token_ids=ids, text=texts.get(0, ""))
    except TimeoutError as err:
        return done("hang", None, f"no answer within {target.timeout:.0f}s ({err})")
    except (ConnectionError, http.client.HTTPException, OSError) as err:
        return done("transport", None, repr(err)[:200])
    except (ValueError, KeyError, TypeError) as err:
        return done("invalid", None, f"unreadable response: {err!r}"[:200])
    finally:
        conn.close()


def _classify_error(spec: RequestSpec, status: int, raw: bytes, done) -> Outcome:
    text = raw.decode(errors="replace")
    if status >= 500:
        return done("5xx", status, text[:300])
    if spec.expect == 400 and status == 400:
        if any(marker in text for marker in TOO_LONG_MARKERS):
            return done("expected_4xx", status)
        return done(
            "unexpected_4xx", status, f"400 without a length reason: {text[:200]}"
        )
    return done("unexpected_4xx", status, text[:300])


def _read_stream(
    spec: RequestSpec, resp, deadline: float, max_model_len: int, done
) -> Outcome:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    events = 0
    finished = False
    for raw_line in resp:
        if time.monotonic() > deadline:
            return done("hang", 200, f"stream still open after {events} events")
        line = raw_line.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            finished = True
            break
        event = json.loads(data)
        if "error" in event:
            return done("stream_error", 200, json.dumps(event["error"])[:300])
        events += 1
        for choice in event.get("choices") or []:
            index = choice["index"]
            texts[index] = texts.get(index, "") + _choice_text(
                choice, spec.endpoint, True
            )
            if choice.get("finish_reason"):
                finish[index] = choice["finish_reason"]
        if event.get("usage"):
            usage = event["usage"]
        if spec.disconnect_after is not None and events >= spec.disconnect_after:
            return done("disconnected", 200, f"closed after {events} events")
    if not finished:
        return done(
            "invalid", 200, f"stream ended without [DONE] after {events} events"
        )
    problem = _validate(spec, texts, finish, usage, max_model_len)
    if problem:
        return done("invalid", 200, problem)
    return done("ok", 200, text=texts.get(0, ""))


def run_job(target: Target, job: Job) -> list[Outcome]:
    """One job; a conversation sends its turns in order, each with the
    history so far (the previous turns and their replies)."""
    if not job.conversation:
        return [send(target, spec) for spec in job.specs]
    outcomes = []
    history: list[dict] = []
    for spec in job.specs:
        system, user = spec.body["messages"]
        history = history or [system]
        body = dict(spec.body, messages=[*history, user])
        outcome = send(target, spec, body)
        outcomes.append(outcome)
        if outcome.result != "ok":
            break
        history = [*history, user, {"role": "assistant", "content": outcome.text}]
    return outcomes


@dataclass
class PhaseRun:
    """What one phase of jobs produced."""

    outcomes: list[Outcome] = field(default_factory=list)
    #: Jobs still running when the phase's bound ran out (a client hang).
    unresolved: int = 0
    #: Jobs not started because the run's time limit had passed.
    skipped: int = 0
    seconds: float = 0.0


def run_phase(
    target: Target,
    jobs: list[Job],
    threads: int,
    stop_at: float,
    join_bound: float,
) -> PhaseRun:
    """Run ``jobs`` from ``threads`` client threads (all at once when
    ``threads >= len(jobs)``: a burst); no job starts after ``stop_at``
    (a ``time.monotonic()`` value)."""
    run = PhaseRun()
    lock = threading.Lock()
    queue = list(reversed(jobs))
    started = [0]
    gate = threading.Barrier(max(1, min(threads, len(jobs))))

    def worker() -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            gate.wait(timeout=30)
        while True:
            with lock:
                if not queue:
                    return
                if time.monotonic() > stop_at:
                    run.skipped += len(queue)
                    queue.clear()
                    return
                job = queue.pop()
                started[0] += 1
            outcomes = run_job(target, job)
            with lock:
                run.outcomes.extend(outcomes)
                started[0] -= 1

    begin = time.monotonic()
    pool = [
        threading.Thread(target=worker, daemon=True, name=f"soak-{i}")
        for i in range(max(1, min(threads, len(jobs))))
    ]
    for thread in pool:
        thread.start()
    bound = begin + join_bound
    for thread in pool:
        thread.join(timeout=max(0.0, bound - time.monotonic()))
    with lock:
        run.unresolved = started[0]
    run.seconds = time.monotonic() - begin
    return run


def pool_label(labels: str) -> str:
    match = re.search(r'pool="([^"]*)"', labels)
    return match.group(1) if match else ""


class MetricsMonitor:
    """Polls ``/metrics`` in the background during a phase and keeps peaks."""

    def __init__(self, target: Target, interval: float = 0.5) -> None:
        self.target = target
        self.interval = interval
        self.peaks: dict[str, float] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                status, raw = self.target.get("/metrics", timeout=5.0)
            except OSError:
                status = 0
            if status == 200:
                self.samples += 1
                for key, value in summarize_metrics(raw.decode()).items():
                    self.peaks[key] = max(self.peaks.get(key, value), value)
            self._stop.wait(self.interval)

    def __enter__(self) -> MetricsMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def summarize_metrics(text: str) -> dict[str, float]:
    """The gauges and counters the soak reads, one number each."""
    metrics = parse_metrics(text)

    def total(name: str) -> float:
        return sum(metrics.get(name, {}).values())

    out = {
        "running": total("vllm:num_requests_running"),
        "waiting": total("vllm:num_requests_waiting"),
        "kv_cache_usage_perc": total("vllm:kv_cache_usage_perc"),
        "preemptions": total("vllm:num_preemptions_total"),
    }
    for labels, value in metrics.get("vllm_hybrid:kv_pool_used_bytes", {}).items():
        out[f"{pool_label(labels)}_used_bytes"] = value
    for labels, value in metrics.get("vllm_hybrid:kv_pool_owned_bytes", {}).items():
        out[f"{pool_label(labels)}_owned_bytes"] = value
    if "vllm_hybrid:kv_arena_usage_perc" in metrics:
        out["arena_usage_perc"] = total("vllm_hybrid:kv_arena_usage_perc")
    return out
