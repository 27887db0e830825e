"""Settings of a serving benchmark run: the servers, and the load vLLM's
serving benchmark sends them."""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.harness import KV_CACHE_DTYPES, MODELS, TINY_MODELS
from testing.loopback import MODES

#: The load of one rate, in ``vllm bench serve`` options: a shared 576-token
#: prefix (a partial block in every layout), then 36-252 tokens of its own;
#: 32-96 output tokens, so the batch changes shape (docs/benchmarks.md).
DATASET_ARGS = (
    "--dataset-name=random",
    "--random-prefix-len=576",
    "--random-input-len=144",
    "--random-output-len=64",
    '--random-range-ratio={"input": 0.75, "output": 0.5}',
)
#: The same with 16-32 output tokens (``--quick``).
QUICK_DATASET_ARGS = (
    *DATASET_ARGS[:3],
    "--random-output-len=24",
    '--random-range-ratio={"input": 0.75, "output": 0.34}',
)
#: KV cache dtypes upstream vLLM 0.32's CPU attention stores (a TurboQuant
#: server segfaults under load: docs/benchmarks.md, "Serving benchmark").
UPSTREAM_CPU_DTYPES = ("auto",)


@dataclass(frozen=True)
class BenchConfig:
    """One invocation: every model x dtype x mode server, every rate each."""

    models: tuple[str, ...] = MODELS
    modes: tuple[str, ...] = tuple(MODES)
    dtypes: tuple[str, ...] = KV_CACHE_DTYPES
    #: Poisson arrival rates in requests per second; ``inf`` sends every
    #: request at once (saturation). On 2 cores the tiny models saturate at
    #: 2-4 req/s with this load: a lightly loaded server to one that queues.
    rates: tuple[float, ...] = (1.0, 2.0, 3.0, math.inf)
    requests: int = 40
    dataset_args: tuple[str, ...] = DATASET_ARGS
    #: The same byte budget for every server, small enough that upstream's
    #: block layout limits how many requests run at once; ``max_num_seqs``
    #: is above what either mode admits: memory decides the concurrency.
    kv_cache_mib: float = 32.0
    max_num_seqs: int = 32
    max_model_len: int = 2048
    seed: int = 0
    #: Unmeasured requests before the first rate: a server's first requests
    #: pay one-time costs that would land in whichever rate comes first.
    warmup_requests: int = 2
    #: How often ``/metrics`` is read during a rate (peak running, pool bytes).
    metrics_interval: float = 0.5
    compile: bool = False
    model_dir: Path = TINY_MODELS
    log_dir: Path | None = None

    def bench_args(self, url: str, model: str, rate: float) -> list[str]:
        """``vllm bench serve`` options of one rate on one server: streaming
        ``/v1/completions``, greedy, every request generating its whole
        output. Each rate has its own seed, so its prompts are the same on
        every server and share no prefix with another rate's. vLLM's probe
        and warm-up requests would cache the rate's prefix before it starts:
        they are off (the warm-up is :func:`warmup`'s run)."""
        return [
            "--backend=vllm",
            f"--base-url={url}",
            f"--model={model}",
            *self.dataset_args,
            f"--num-prompts={self.requests}",
            f"--request-rate={rate}",
            f"--seed={rate_seed(self.seed, rate)}",
            "--temperature=0",
            "--ignore-eos",
            "--percentile-metrics=ttft,tpot,itl,e2el",
            "--metric-percentiles=50,90,99",
            "--ready-check-timeout-sec=0",
            "--num-warmups=0",
            "--disable-tqdm",
            "--save-detailed",
        ]


def warmup(cfg: BenchConfig) -> BenchConfig:
    """A few requests at once, seeded apart from every rate."""
    return replace(cfg, requests=cfg.warmup_requests, seed=cfg.seed + 1)


def quick(cfg: BenchConfig) -> BenchConfig:
    """Checks the harness in a few minutes (too small a sample to compare
    modes): one rate and saturation, 10 requests, shorter outputs."""
    return replace(
        cfg,
        rates=(4.0, math.inf),
        requests=10,
        dataset_args=QUICK_DATASET_ARGS,
        warmup_requests=1,
    )


def rate_key(rate: float) -> str:
    """JSON-safe name of a rate (JSON has no infinity): ``"2"``, ``"inf"``."""
    return "inf" if math.isinf(rate) else f"{rate:g}"


def rate_seed(seed: int, rate: float) -> int:
    """The dataset seed of one rate, whatever rates run before it."""
    return zlib.crc32(json.dumps([seed, rate_key(rate)]).encode()) % 2**31
