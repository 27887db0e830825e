"""The soak client: requests from threads over loopback, each bounded by a
socket timeout, each ending in an :class:`Outcome` whose ``result`` is one
of :data:`RESULTS` (a request the server never answers ends as ``hang``)."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from testing.loopback import connect, send, sse_events

from .workload import Job, RequestSpec

#: ok: 200 and a valid response; expected_4xx: the 400 a too-long prompt
#: must get; disconnected: the client closed the connection on purpose;
#: unexpected_4xx, 5xx, invalid (200 that breaks a rule, or 200 where a 400
#: was due), stream_error (an error event inside a 200 stream), hang (no
#: answer within the socket timeout), transport (connection refused or
#: reset): failures.
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


@dataclass(frozen=True)
class Target:
    """Where requests go: the server's URL, served model name and limits."""

    url: str
    model: str
    max_model_len: int
    timeout: float = 120.0


def validate(spec: RequestSpec, choices: list[dict], usage, max_model_len: int) -> str:
    """The first rule a 200 response breaks, or "". ``choices``: per index,
    ``{"text", "finish_reason"}``."""
    n = spec.n
    if sorted(c["index"] for c in choices) != list(range(n)):
        return f"choices {sorted(c['index'] for c in choices)} for n={n}"
    if any(c.get("finish_reason") not in ("stop", "length") for c in choices):
        return f"finish reasons {[c.get('finish_reason') for c in choices]}"
    for c in choices:
        for stop in spec.body.get("stop") or []:
            if stop in c["text"]:
                return f"stop string {stop!r} in the output {c['text'][:80]!r}"
    if not isinstance(usage, dict):
        return "no usage"
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if spec.prompt_len is not None and prompt != spec.prompt_len:
        return f"prompt_tokens {prompt} != {spec.prompt_len}"
    # vLLM lowers max_tokens to the room the prompt leaves
    cap = n * min(int(spec.body["max_tokens"]), max_model_len - prompt)
    if not n <= completion <= cap:
        return f"completion_tokens {completion} not in [{n}, {cap}]"
    if spec.body.get("ignore_eos") and not spec.body.get("stop") and completion != cap:
        return f"ignore_eos: completion_tokens {completion} != {cap}"
    return ""


def _text(choice: dict, key: str) -> str:
    """Generated text of a choice or chunk (``key``: ``message``/``delta``)."""
    return choice.get("text") or (choice.get(key) or {}).get("content") or ""


def _answer(spec: RequestSpec, target: Target, resp) -> tuple[str, int, str, dict]:
    """(result, status, detail, extra Outcome fields) of an answered request."""
    if resp.status != 200:
        text = resp.read().decode(errors="replace")
        if resp.status >= 500:
            return "5xx", resp.status, text[:300], {}
        too_long = any(marker in text for marker in TOO_LONG_MARKERS)
        if spec.expect == resp.status == 400 and too_long:
            return "expected_4xx", 400, "", {}
        return "unexpected_4xx", resp.status, text[:300], {}
    if spec.expect != 200:
        return "invalid", 200, f"200 where {spec.expect} was due", {}
    if not spec.body.get("stream"):
        payload = json.loads(resp.read())
        choices = [
            dict(c, text=_text(c, "message")) for c in payload.get("choices") or []
        ]
        usage, ids = payload.get("usage"), (choices or [{}])[0].get("token_ids")
    else:
        merged: dict[int, dict] = {}
        usage, ids = None, None
        for events, event in enumerate(sse_events(resp), 1):
            if "error" in event:
                return "stream_error", 200, json.dumps(event["error"])[:300], {}
            for c in event.get("choices") or []:
                into = merged.setdefault(c["index"], {"index": c["index"], "text": ""})
                into["text"] += _text(c, "delta")
                if c.get("finish_reason"):
                    into["finish_reason"] = c["finish_reason"]
            usage = event.get("usage") or usage
            if spec.disconnect_after is not None and events >= spec.disconnect_after:
                return "disconnected", 200, f"closed after {events} events", {}
        choices = list(merged.values())
    problem = validate(spec, choices, usage, target.max_model_len)
    if problem:
        return "invalid", 200, problem, {}
    text = next((c["text"] for c in choices if c["index"] == 0), "")
    return "ok", 200, "", {"token_ids": ids, "text": text}


def submit(target: Target, spec: RequestSpec, body: dict | None = None) -> Outcome:
    """Send one request and classify what came back; never raises."""
    start = time.monotonic()
    result, status, detail, extra = "transport", None, "", {}
    try:
        with connect(target.url, target.timeout) as conn:
            send(conn, spec.endpoint, {**(body or spec.body), "model": target.model})
            if spec.disconnect_after == 0:
                time.sleep(0.05)
                result, detail = "disconnected", "closed before the response"
            else:
                result, status, detail, extra = _answer(
                    spec, target, conn.getresponse()
                )
    except TimeoutError as err:
        result, detail = "hang", f"no answer within {target.timeout:.0f}s ({err})"
    except (OSError, http.client.HTTPException) as err:
        detail = repr(err)[:200]
    except (ValueError, KeyError, TypeError) as err:
        result, detail = "invalid", f"unreadable response: {err!r}"[:200]
    seconds = time.monotonic() - start
    return Outcome(spec.rid, spec.kind, result, status, seconds, detail, **extra)


def run_job(target: Target, job: Job) -> list[Outcome]:
    """One job; a conversation sends its turns in order, each with the
    history so far (the previous turns and their replies)."""
    if job.kind != "conversation":
        return [submit(target, spec) for spec in job.specs]
    outcomes: list[Outcome] = []
    history: list[dict] = []
    for spec in job.specs:
        system, user = spec.body["messages"]
        history = history or [system]
        outcome = submit(target, spec, dict(spec.body, messages=[*history, user]))
        outcomes.append(outcome)
        if outcome.result != "ok":
            break
        history += [user, {"role": "assistant", "content": outcome.text}]
    return outcomes


def run_phase(target: Target, jobs: list[Job], threads: int) -> list[Outcome]:
    """Run ``jobs`` from ``threads`` client threads (all at once when
    ``threads >= len(jobs)``: a burst); every request is bounded by the
    target's timeout, so the phase ends."""
    with ThreadPoolExecutor(max(1, min(threads, len(jobs)))) as pool:
        return [
            o
            for outcomes in pool.map(lambda j: run_job(target, j), jobs)
            for o in outcomes
        ]
