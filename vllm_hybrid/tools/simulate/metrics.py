"""Latency figures of a run, as ``vllm bench serve`` defines and names them.

A vLLM user compares a simulation with a ``vllm bench serve`` result, so
the figures both have carry bench's key names and units (``median_ttft_ms``,
``p99_tpot_ms``, ``request_throughput``, ...), computed as bench computes
them: numpy's mean, median, standard deviation and linearly interpolated
percentiles over the completed requests; TPOT excludes the first token.
Here every time is modeled (:mod:`.clock`), so these keys hold the cost
model's figures. The run's own summary percentiles (``ttft_s`` and
``tpot_s``, seconds) use the same definition, so the table and the JSON
agree.

:func:`per_request` gives one row per request (``--per-request``): its
arrival, TTFT, TPOT, prefix-hit and prefill tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

#: Percentiles reported besides the median (``--metric-percentiles`` of
#: bench; its default is 99).
PERCENTILES = (50, 90, 99)
#: Fewer values than this and a high percentile is little more than the
#: largest value; the report says so.
SMALL_SAMPLE = 100


def percentiles(
    values: Sequence[float], points: Iterable[int] = PERCENTILES
) -> dict[str, float]:
    """Mean, linearly interpolated percentiles (numpy's, as bench's) and the
    number of values (empty: no keys)."""
    if not values:
        return {}
    import numpy as np

    data = np.asarray(values, dtype=float)
    out = {"mean": float(data.mean()), "n": len(values)}
    for p in points:
        out[f"p{p}"] = float(np.percentile(data, p))
    return out


def _stats(name: str, seconds: Sequence[float]) -> dict[str, float]:
    """bench's keys of one metric, in milliseconds."""
    if not seconds:
        return {}
    import numpy as np

    ms = np.asarray(seconds, dtype=float) * 1e3
    out = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def latencies(timings: Iterable[Any]) -> dict[str, list[float]]:
    """TTFT, TPOT and end-to-end seconds of the completed requests."""
    done = [t for t in timings if t.finished is not None and t.first_token is not None]
    return {
        "ttft": [t.first_token - t.arrival for t in done],
        "tpot": [
            (t.finished - t.first_token) / (t.output_tokens - 1)
            for t in done
            if t.output_tokens > 1
        ],
        "e2el": [t.finished - t.arrival for t in done],
    }


def bench_serve_metrics(
    timings: Mapping[str, Any], makespan_s: float
) -> dict[str, Any]:
    """The figures a run shares with ``vllm bench serve``, under its keys."""
    values = list(timings.values())
    done = [t for t in values if t.finished is not None]
    prompt = sum(t.prompt_tokens for t in done)
    output = sum(t.output_tokens for t in done)
    rate = (lambda n: n / makespan_s) if makespan_s else (lambda n: None)
    out: dict[str, Any] = {
        "duration": makespan_s,
        "completed": len(done),
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": rate(len(done)),
        "output_throughput": rate(output),
        "total_token_throughput": rate(prompt + output),
    }
    for name, seconds in latencies(values).items():
        out.update(_stats(name, seconds))
    return out


def per_request(
    timings: Mapping[str, Any], prefill: Mapping[str, int]
) -> list[dict[str, Any]]:
    """One row per request, in arrival order (modeled times in ms)."""

    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1e3

    rows = []
    for request_id, t in sorted(timings.items(), key=lambda kv: kv[1].arrival):
        ttft = None if t.first_token is None else t.first_token - t.arrival
        tpot = None
        if t.finished is not None and ttft is not None and t.output_tokens > 1:
            tpot = (t.finished - t.first_token) / (t.output_tokens - 1)
        rows.append(
            {
                "request_id": request_id,
                "arrival_s": t.arrival,
                "ttft_ms": ms(ttft),
                "tpot_ms": ms(tpot),
                "e2el_ms": ms(None if t.finished is None else t.finished - t.arrival),
                "prompt_tokens": t.prompt_tokens,
                "hit_tokens": t.cached_tokens,
                "prefill_tokens": prefill.get(request_id, 0),
                "output_tokens": t.output_tokens,
            }
        )
    return rows
