"""Settings of a soak run and how its request budget splits into phases."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MIB = 2**20
REPO_ROOT = Path(__file__).resolve().parents[2]

#: Modes and the value of ``VLLM_HYBRID_KV`` the server process gets.
MODES = {"pooled": "1", "upstream": "0"}
MODELS = ("qwen3_5", "qwen3_next")
KV_CACHE_DTYPES = ("auto", "turboquant_k8v4")


@dataclass(frozen=True)
class SoakConfig:
    """One soak run; every mode of it uses the same settings and seed."""

    model: str = "qwen3_5"
    modes: tuple[str, ...] = ("pooled", "upstream")
    kv_cache_dtype: str = "auto"
    #: Requests per mode (conversation turns count one each; greedy probes
    #: and check requests do not count).
    requests: int = 1000
    #: Wall-time limit of the traffic of one mode: no new request starts
    #: after it; the checks still run.
    seconds: float = 1200.0
    seed: int = 0
    max_model_len: int = 1024
    kv_cache_mib: float = 16.0
    max_num_seqs: int = 4
    #: Client threads of the mixed phases (a little above max_num_seqs, so
    #: some requests queue all the time).
    concurrency: int = 6
    #: Requests fired at once in a burst phase (default 8 x max_num_seqs).
    burst: int = 32
    #: Mixed + burst rounds after the warm-up phase.
    rounds: int = 4
    #: Bound on one request, first byte to last (no hang beyond it).
    request_timeout: float = 120.0
    #: How long idle gauges may take to reach 0 after a phase.
    idle_timeout: float = 30.0
    #: Allowed growth of the server's RSS (all its processes) from the
    #: middle of the run to its end. The engine worker's memory rises in
    #: steps when a batch reaches a new size (measured at 1,200 requests:
    #: +94 MiB pooled, +59 MiB upstream from the middle, flat afterwards);
    #: a leak of 0.25 MiB per request crosses 128 MiB within 600 requests.
    rss_growth_mib: float = 128.0
    #: Allowed growth of the API server and of the engine core each (they
    #: keep the per-request state; measured: under 2 MiB).
    flat_process_mib: float = 16.0
    #: Runs shorter than this report the RSS growth without judging it: the
    #: engine worker's private memory grows for its first ~450 requests
    #: (new batch shapes; the same in upstream vLLM) before it levels off.
    rss_min_requests: int = 800
    #: Greedy probes sent at the start and again at the end.
    probes: int = 3
    #: Per-request ``seed`` on sampled requests (see WorkloadContext).
    request_seeds: bool = False
    #: Upper end of max_tokens of the "large" requests (None: max_model_len).
    large_max_tokens: int | None = None
    probe_tokens: int = 16
    model_dir: Path = field(default=REPO_ROOT / ".tiny-models")
    log_dir: Path | None = None
    compile: bool = False
    ready_timeout: float = 300.0

    def server_args(self) -> list[str]:
        args = [
            "--max-model-len",
            str(self.max_model_len),
            "--kv-cache-memory-bytes",
            str(int(self.kv_cache_mib * MIB)),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--kv-cache-dtype",
            self.kv_cache_dtype,
            "--seed",
            str(self.seed),
            "--disable-uvicorn-access-log",
        ]
        if not self.compile:
            args.append("--enforce-eager")
        return args


@dataclass(frozen=True)
class PhasePlan:
    name: str
    #: "mixed" (a fixed number of client threads) or "burst" (all at once).
    kind: str
    requests: int


def phase_plan(cfg: SoakConfig) -> list[PhasePlan]:
    """Warm-up, then ``rounds`` x (mixed, burst), summing to ``cfg.requests``.

    The warm-up takes a tenth (at least 10 requests); each burst takes
    ``cfg.burst`` requests, or half of its round when the budget is small.
    """
    total = max(1, cfg.requests)
    warmup = min(total, max(10, total // 10))
    rest = total - warmup
    rounds = max(1, cfg.rounds)
    per_round = rest // rounds
    plan = [PhasePlan("warmup", "mixed", warmup)]
    for i in range(1, rounds + 1):
        budget = per_round + (rest - per_round * rounds if i == rounds else 0)
        burst = min(cfg.burst, budget // 2)
        mixed = budget - burst
        if mixed:
            plan.append(PhasePlan(f"mixed-{i}", "mixed", mixed))
        if burst:
            plan.append(PhasePlan(f"burst-{i}", "burst", burst))
    return plan


def middle_phase(plan: list[PhasePlan]) -> str:
    """The phase after which the "middle" RSS sample is taken: the end of the
    round in the middle of the run (or the warm-up, with one round)."""
    rounds = sorted({p.name.split("-")[1] for p in plan if "-" in p.name}, key=int)
    if len(rounds) < 2:
        return "warmup"
    mid = rounds[len(rounds) // 2 - 1]
    return [p.name for p in plan if p.name.endswith(f"-{mid}")][-1]
