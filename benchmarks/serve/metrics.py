"""Per-request records, run summaries, percentiles, ratios and the server's
Prometheus counters: pure functions, tested without a server."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vllm_hybrid.tools.server import parse_metrics as parse_samples

#: Counters and gauges of vLLM's ``/metrics`` the benchmark reads. The
#: prefix cache counters count tokens: queried prompt tokens, and those of
#: them found in the cache.
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREEMPTIONS = "vllm:num_preemptions_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the client saw of one request; times in seconds."""

    index: int
    prompt_tokens: int
    max_tokens: int
    #: Planned send time, after the start of the run.
    offset: float
    #: Actual send time, after the start of the run.
    sent: float = 0.0
    #: Send to the first chunk that carries a generated token.
    ttft: float | None = None
    #: Send to the end of the stream.
    latency: float | None = None
    output_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: what a reader of the
        stream waits between tokens, queueing and batch-mates included."""
        if not self.ok or self.ttft is None or self.latency is None:
            return None
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class CounterSnapshot:
    """Counters from ``/metrics`` at one moment (summed over engines)."""

    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    preemptions: float = 0.0

    @classmethod
    def from_metrics(cls, values: Mapping[str, float]) -> CounterSnapshot:
        return cls(
            prefix_queries=values.get(PREFIX_QUERIES, 0.0),
            prefix_hits=values.get(PREFIX_HITS, 0.0),
            preemptions=values.get(PREEMPTIONS, 0.0),
        )


@dataclass
class RunSummary:
    """One rate run on one server. Times in ms, throughputs per second."""

    rate: str
    requests: int
    completed: int
    errors: int
    duration_s: float
    req_per_s: float
    output_tok_per_s: float
    ttft_ms: dict[str, float | None] = field(default_factory=dict)
    tpot_ms: dict[str, float | None] = field(default_factory=dict)
    #: Prefix cache hits / queries (tokens) over the run, from ``/metrics``.
    prefix_hit_rate: float | None = None
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    preemptions: float = 0.0
    #: Most requests running / waiting at one ``/metrics`` sample.
    peak_running: float = 0.0
    peak_waiting: float = 0.0
    #: Latest send after its planned offset: the client shares the cores
    #: with the server, and a late client understates the offered rate.
    max_send_lag_ms: float = 0.0
    first_errors: list[str] = field(default_factory=list)

    def flat(self) -> dict[str, float | None]:
        """Every number under one flat name (the ratio rows' keys)."""
        out: dict[str, float | None] = {
            "req_per_s": self.req_per_s,
            "output_tok_per_s": self.output_tok_per_s,
        }
        for name, values in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms)):
            for p in PERCENTILES:
                out[f"{name}_p{p}_ms"] = values.get(f"p{p}")
        out["prefix_hit_rate"] = self.prefix_hit_rate
        out["peak_running"] = self.peak_running
        out["preemptions"] = self.preemptions
        return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear between the closest ranks.

    With few samples (a run has tens of requests) p99 is close to the
    maximum; interpolating keeps it from jumping between samples as the
    sample count changes. None for no samples.
    """
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    weight = position - low
    return ordered[low] + (ordered[high] - ordered[low]) * weight


def percentiles_ms(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 of seconds, in milliseconds."""
    out: dict[str, float | None] = {}
    for p in PERCENTILES:
        value = percentile(values, p)
        out[f"p{p}"] = None if value is None else value * 1000.0
    return out


def hit_rate(before: CounterSnapshot, after: CounterSnapshot) -> float | None:
    """Prefix cache hit rate between two snapshots, None without queries."""
    queries = after.prefix_queries - before.prefix_queries
    if queries <= 0:
        return None
    return (after.prefix_hits - before.prefix_hits) / queries


def summarize(
    rate: str,
    records: Sequence[RequestRecord],
    duration_s: float,
    before: CounterSnapshot,
    after: CounterSnapshot,
    peaks: Mapping[str, float],
) -> RunSummary:
    """Throughputs count completed requests over the whole run (first send
    to last byte), so a mode that leaves requests queued pays for it."""
    done = [r for r in records if r.ok]
    seconds = max(duration_s, 1e-9)
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    return RunSummary(
        rate=rate,
        requests=len(records),
        completed=len(done),
        errors=len(records) - len(done),
        duration_s=duration_s,
        req_per_s=len(done) / seconds,
        output_tok_per_s=sum(r.output_tokens for r in done) / seconds,
        ttft_ms=percentiles_ms(ttfts),
        tpot_ms=percentiles_ms(tpots),
        prefix_hit_rate=hit_rate(before, after),
        prefix_queries=after.prefix_queries - before.prefix_queries,
        prefix_hits=after.prefix_hits - before.prefix_hits,
        preemptions=after.preemptions - before.preemptions,
        peak_running=peaks.get(RUNNING, 0.0),
        peak_waiting=peaks.get(WAITING, 0.0),
        max_send_lag_ms=max((r.sent - r.offset for r in records), default=0.0) * 1e3,
        first_errors=[f"#{r.index}: {r.error}" for r in records if r.error][:5],
    )


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``; None when either is missing or the denominator is 0."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def ratio_values(
    num: Mapping[str, float | None], den: Mapping[str, float | None]
) -> dict[str, float | None]:
    """Metric-by-metric ratio of two flat summaries (keys of ``num``)."""
    return {key: ratio(num[key], den.get(key)) for key in num}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> ``{sample name: value}``, summed over
    label sets (one engine here, but data-parallel servers label each)."""
    samples = parse_samples(text)
    return {name: sum(by_labels.values()) for name, by_labels in samples.items()}
