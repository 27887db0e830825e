"""Timing pooled views against contiguous twins, shared by the device run's
``timings`` and ``copies`` parts.

On a GPU a call is timed by ``triton.testing.do_bench`` (CUDA events, the L2
cache flushed before every repetition, the median of the repetitions). The
two layouts are timed in alternating rounds (contiguous, pooled, contiguous,
...), so drift of clocks or temperature falls on both; the spread of the
contiguous rounds is the noise a ratio has to be read against. Without a GPU
(the CPU rehearsal) each call runs once under a host clock: the numbers only
show that the code ran.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

#: do_bench's warm-up and measuring windows, in milliseconds.
WARMUP_MS = 25
REP_MS = 100
ROUNDS = 3


def on_gpu() -> bool:
    return torch.cuda.is_available()


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` (one host-timed call without a GPU)."""
    if on_gpu():
        import triton.testing

        return triton.testing.do_bench(
            fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"
        )
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def compare(
    pooled: Callable[[], object], contiguous: Callable[[], object], rounds: int
) -> dict:
    """Both layouts once each to compile and autotune, then ``rounds``
    alternating timings; the ratio is pooled over contiguous medians."""
    pooled()
    contiguous()
    times: dict[str, list[float]] = {"pooled": [], "contiguous": []}
    for _ in range(rounds):
        times["contiguous"].append(time_ms(contiguous))
        times["pooled"].append(time_ms(pooled))
    mid = {k: statistics.median(v) for k, v in times.items()}
    spread = (max(times["contiguous"]) - min(times["contiguous"])) / mid["contiguous"]
    return {
        "pooled_ms": mid["pooled"],
        "contiguous_ms": mid["contiguous"],
        "ratio": mid["pooled"] / mid["contiguous"],
        "contiguous_spread": spread,
        "rounds": times,
    }


@dataclass
class Results:
    """Measurements of one part, cut short when its time budget runs out."""

    budget_s: float
    entries: list[dict] = field(default_factory=list)
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def measure(self, name: str, run: Callable[[], dict], reserve: float) -> None:
        """Record ``run()``'s numbers under ``name``, its error, or that it
        was skipped because less than ``reserve`` seconds were left."""
        entry: dict = {"name": name}
        if self.left() < reserve:
            entry["skipped"] = f"budget: {self.left():.0f} s left, needs ~{reserve} s"
        else:
            begin = time.monotonic()
            try:
                entry |= run()
            except Exception as exc:  # noqa: BLE001 - one case, not the part
                entry["error"] = "".join(
                    traceback.format_exception_only(type(exc), exc)
                ).strip()
                entry["traceback"] = traceback.format_exc()[-2500:]
            entry["seconds"] = round(time.monotonic() - begin, 1)
        self.entries.append(entry)
        print(_line(entry), flush=True)

    @property
    def ok(self) -> bool:
        return not any("error" in e for e in self.entries)


def _line(entry: dict) -> str:
    if "ratio" in entry:
        return (
            f"{entry['name']}: pooled {entry['pooled_ms']:.4f} ms, contiguous "
            f"{entry['contiguous_ms']:.4f} ms, ratio {entry['ratio']:.3f} "
            f"(spread {entry['contiguous_spread']:.3f})"
        )
    if "error" in entry:
        return f"{entry['name']}: ERROR {entry['error']}"
    if "skipped" in entry:
        return f"{entry['name']}: skipped ({entry['skipped']})"
    shown = {k: v for k, v in entry.items() if k not in ("traceback", "rounds")}
    return f"{entry['name']}: {shown}"


def environment() -> dict:
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__}
    env["timer"] = "do_bench median, CUDA events" if on_gpu() else "host, one call"
    if on_gpu():
        env["device"] = torch.cuda.get_device_name()
    return env
