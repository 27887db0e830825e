"""Settings of a soak run and how its request budget splits into phases."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness import TINY_MODELS
from testing.loopback import MODES


@dataclass(frozen=True)
class SoakConfig:
    """One soak run; every mode of it uses the same settings and seed."""

    model: str = "qwen3_5"
    modes: tuple[str, ...] = tuple(MODES)
    kv_cache_dtype: str = "auto"
    #: Requests per mode (conversation turns count one each; greedy probes
    #: and check requests do not count).
    requests: int = 1000
    seed: int = 0
    max_model_len: int = 1024
    kv_cache_mib: float = 16.0
    max_num_seqs: int = 4
    #: Client threads of the mixed phases (a little above max_num_seqs, so
    #: some requests queue all the time).
    concurrency: int = 6
    #: Requests fired at once in a burst phase.
    burst: int = 32
    #: Mixed + burst rounds after the warm-up phase.
    rounds: int = 4
    #: Socket timeout of every request: no request hangs beyond it.
    request_timeout: float = 120.0
    #: RSS bounds (why these: docs/benchmarks.md, "Soak"): growth of all the
    #: server's processes from the middle of the run to its end, of the API
    #: server and the engine core each, and the run length below which the
    #: growth is reported but not judged (the worker grows for ~450 requests).
    rss_growth_mib: float = 128.0
    flat_process_mib: float = 16.0
    rss_min_requests: int = 800
    #: Greedy probes sent at the start and again at the end.
    probes: int = 3
    probe_tokens: int = 16
    #: Requests beyond ``max_num_seqs`` held open in the queue check.
    held_extra: int = 2
    #: Per-request ``seed`` on sampled requests (see WorkloadContext).
    request_seeds: bool = False
    #: Upper end of max_tokens of the "large" requests (None: max_model_len).
    large_max_tokens: int | None = None
    model_dir: Path = field(default=TINY_MODELS)
    log_dir: Path | None = None
    compile: bool = False
    ready_timeout: float = 300.0


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
    rest, rounds = total - warmup, max(1, cfg.rounds)
    per_round = rest // rounds
    plan = [PhasePlan("warmup", "mixed", warmup)]
    for i in range(1, rounds + 1):
        budget = per_round + (rest - per_round * rounds if i == rounds else 0)
        burst = min(cfg.burst, budget // 2)
        plan += [PhasePlan(f"mixed-{i}", "mixed", budget - burst)] * (budget > burst)
        plan += [PhasePlan(f"burst-{i}", "burst", burst)] * (burst > 0)
    return plan


def middle_phase(plan: list[PhasePlan]) -> str:
    """The phase after which the "middle" RSS sample is taken: the end of the
    round in the middle of the run (or the warm-up, with one round)."""
    rounds = sorted({p.name.split("-")[1] for p in plan if "-" in p.name}, key=int)
    if len(rounds) < 2:
        return "warmup"
    mid = rounds[len(rounds) // 2 - 1]
    return [p.name for p in plan if p.name.endswith(f"-{mid}")][-1]
