"""The load generator: streaming ``/v1/completions`` requests from one asyncio
loop, each sent at its planned offset, plus ``/metrics`` reads.

One loop and no threads: a request's send time and each chunk's arrival
time are read by the coroutine that handles it, so a slow request does not
delay the clock of another. Prompts are token ids, so their lengths are
exact and no tokenizer runs on the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from .metrics import RUNNING, WAITING, CounterSnapshot, RequestRecord, parse_metrics
from .workload import PlannedRequest

#: Gauges whose maximum over a run is reported.
PEAK_GAUGES = (RUNNING, WAITING)
#: Head start of the clock, so the first requests are not already late.
LEAD_S = 0.05


@dataclass
class LoadResult:
    records: list[RequestRecord]
    duration_s: float
    before: CounterSnapshot
    after: CounterSnapshot
    peaks: dict[str, float] = field(default_factory=dict)
    #: ``/metrics`` reads that failed during the run (the peaks miss them).
    sample_errors: int = 0


def request_body(model: str, req: PlannedRequest) -> dict:
    """Greedy, ``ignore_eos`` (every request generates exactly its
    ``max_tokens``, so both modes do the same work), streamed with the token
    count in every chunk."""
    return {
        "model": model,
        "prompt": list(req.prompt),
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def _chunk_tokens(chunk: dict) -> int | None:
    usage = chunk.get("usage") or {}
    tokens = usage.get("completion_tokens")
    return int(tokens) if tokens is not None else None


async def _read_stream(
    resp: aiohttp.ClientResponse, record: RequestRecord, start: float
) -> None:
    """Consume server-sent events; fill the record's TTFT and token count."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            record.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
            return
        tokens = _chunk_tokens(chunk)
        if tokens is not None and tokens > record.output_tokens:
            if record.ttft is None:
                record.ttft = time.perf_counter() - start
            record.output_tokens = tokens
    record.error = "stream ended without [DONE]"


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    req: PlannedRequest,
    t0: float,
) -> RequestRecord:
    """Wait for the request's offset, send it, time it; never raises."""
    record = RequestRecord(req.index, len(req.prompt), req.max_tokens, req.offset)
    await asyncio.sleep(max(0.0, t0 + req.offset - time.perf_counter()))
    start = time.perf_counter()
    record.sent = start - t0
    try:
        async with session.post(
            url + "/v1/completions", json=request_body(model, req)
        ) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                record.error = f"HTTP {resp.status}: {text}"
                return record
            await _read_stream(resp, record, start)
    except asyncio.TimeoutError:
        record.error = "timeout"
    except (aiohttp.ClientError, json.JSONDecodeError) as err:
        record.error = f"{type(err).__name__}: {err}"[:200]
    record.latency = time.perf_counter() - start
    if record.ok and record.output_tokens != req.max_tokens:
        record.error = f"{record.output_tokens} of {req.max_tokens} tokens"
    return record


async def fetch_metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(
        url + "/metrics", timeout=aiohttp.ClientTimeout(total=30)
    ) as resp:
        resp.raise_for_status()
        return parse_metrics(await resp.text())


async def _sample_peaks(
    session: aiohttp.ClientSession,
    url: str,
    interval: float,
    result: LoadResult,
    stop: asyncio.Event,
) -> None:
    while not stop.is_set():
        try:
            values = await fetch_metrics(session, url)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            result.sample_errors += 1
        else:
            for name in PEAK_GAUGES:
                result.peaks[name] = max(
                    result.peaks.get(name, 0.0), values.get(name, 0.0)
                )
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval)


async def run_load_async(
    url: str,
    model: str,
    planned: Sequence[PlannedRequest],
    request_timeout: float,
    metrics_interval: float,
) -> LoadResult:
    """Send ``planned`` on schedule; counters are read before the first
    request and after the last response."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, read_bufsize=2**20
    ) as session:
        before = CounterSnapshot.from_metrics(await fetch_metrics(session, url))
        result = LoadResult([], 0.0, before, before)
        stop = asyncio.Event()
        sampler = asyncio.create_task(
            _sample_peaks(session, url, metrics_interval, result, stop)
        )
        t0 = time.perf_counter() + LEAD_S
        records = await asyncio.gather(
            *(send_request(session, url, model, req, t0) for req in planned)
        )
        result.duration_s = time.perf_counter() - t0
        stop.set()
        await sampler
        result.records = sorted(records, key=lambda r: r.index)
        result.after = CounterSnapshot.from_metrics(await fetch_metrics(session, url))
        return result


def run_load(
    url: str,
    model: str,
    planned: Sequence[PlannedRequest],
    request_timeout: float,
    metrics_interval: float = 0.5,
) -> LoadResult:
    """Synchronous entry: one fresh event loop per run."""
    return asyncio.run(
        run_load_async(url, model, planned, request_timeout, metrics_interval)
    )
