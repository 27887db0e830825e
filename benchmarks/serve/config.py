"""Settings of a serving benchmark run and the servers it starts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

MIB = 2**20
REPO_ROOT = Path(__file__).resolve().parents[2]

#: Modes and the value of ``VLLM_HYBRID_KV`` the server process gets.
MODES = {"pooled": "1", "upstream": "0"}
MODELS = ("qwen3_5", "qwen3_next")
KV_CACHE_DTYPES = ("auto", "turboquant_k8v4")
SATURATION = math.inf


@dataclass(frozen=True)
class LoadShape:
    """The request mix of one rate run (the same for every server).

    Most requests start with one of a few shared prefixes, as requests of a
    chat service start with its system prompt, so prefix caching matters;
    the rest are unrelated prompts. Output lengths vary so that requests
    finish at different steps and the batch changes shape while decoding.
    """

    requests: int = 40
    #: 576 tokens is 4.5 blocks of 128 (pooled mode), 2.25 of upstream's
    #: 256-token ``qwen3_5`` block and 1.5 of its 384-token ``qwen3_next``
    #: block: every layout loses a partial block of the prefix, as it would
    #: with a system prompt of arbitrary length.
    shared_prefix_len: int = 576
    prefix_groups: int = 2
    shared_fraction: float = 0.75
    suffix_len: tuple[int, int] = (32, 256)
    unshared_len: tuple[int, int] = (128, 768)
    output_len: tuple[int, int] = (32, 96)


@dataclass(frozen=True)
class BenchConfig:
    """One invocation: every model x dtype x mode server, every rate each."""

    models: tuple[str, ...] = MODELS
    modes: tuple[str, ...] = tuple(MODES)
    dtypes: tuple[str, ...] = KV_CACHE_DTYPES
    #: Requests per second of the Poisson arrivals; ``inf`` sends every
    #: request of the run at once (saturation). On 2 cores the tiny models
    #: saturate at 2-4 req/s with the default load, so these span a lightly
    #: loaded server to one that queues.
    rates: tuple[float, ...] = (1.0, 2.0, 3.0, SATURATION)
    load: LoadShape = field(default_factory=LoadShape)
    #: The same byte budget for every server. Small enough that upstream's
    #: block layout limits how many requests run at once.
    kv_cache_mib: float = 32.0
    #: Above what either mode can admit at this budget: memory, not this
    #: cap, decides the concurrency.
    max_num_seqs: int = 32
    max_model_len: int = 2048
    seed: int = 0
    warmup_requests: int = 2
    #: Bound on one request, first byte to last.
    request_timeout: float = 600.0
    ready_timeout: float = 300.0
    #: How often ``/metrics`` is read during a run (peak running requests).
    metrics_interval: float = 0.5
    #: Start upstream with a TurboQuant dtype even where the probe says
    #: upstream's CPU attention cannot store it.
    force_upstream_turboquant: bool = False
    compile: bool = False
    model_dir: Path = REPO_ROOT / ".tiny-models"
    log_dir: Path | None = None

    def server_args(self, dtype: str) -> list[str]:
        """``vllm serve`` options; only the dtype differs between servers."""
        args = [
            "--kv-cache-memory-bytes",
            str(int(self.kv_cache_mib * MIB)),
            "--kv-cache-dtype",
            dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--max-num-seqs",
            str(self.max_num_seqs),
            # vLLM forces float32 SSM state on AVX512-BF16 hosts and keeps
            # bf16 elsewhere; fixing it keeps the budget's split the same on
            # every machine.
            "--mamba-ssm-cache-dtype",
            "float32",
            "--seed",
            str(self.seed),
            "--disable-uvicorn-access-log",
        ]
        if not self.compile:
            # torch.compile costs ~35 s per server start on CPU.
            args.append("--enforce-eager")
        return args


def quick(cfg: BenchConfig) -> BenchConfig:
    """A few minutes instead of a quarter hour: one rate plus saturation, a
    quarter of the requests, shorter outputs. Checks the harness; its
    numbers are too small a sample to compare modes."""
    load = replace(cfg.load, requests=10, output_len=(16, 32))
    return replace(cfg, rates=(4.0, SATURATION), load=load, warmup_requests=1)


def rate_label(rate: float) -> str:
    """``"2 req/s"`` or ``"saturation"``, for tables and plots."""
    return "saturation" if math.isinf(rate) else f"{rate:g} req/s"


def rate_key(rate: float) -> str:
    """JSON-safe name of a rate (JSON has no infinity)."""
    return "inf" if math.isinf(rate) else f"{rate:g}"
