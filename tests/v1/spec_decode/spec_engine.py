"""Engines of the speculative-decoding test, several in one process (see the
test module).

Usage: ``python spec_engine.py JOBS.json``: a list of engines, each
``{"model", "mode": plain|ngram|mtp|eagle, "caching": pc|no-pc,
"pool": pooled|single, "peak": bool, "out": OUT.json, "draft": DIR|null}``
(``draft``: the EAGLE draft), run one after the other. Each writes the greedy
tokens and top-2 gaps of two passes over the prompts, how often the host
copy kernels ran, and with ``peak`` the peak of running requests for 64
short random prompts submitted at once (about three quarters of an engine's
run time on a host without native bf16, so only the engines whose peaks are
compared measure it).

An n-gram engine must be the last of its process: once its proposer has
imported numba, vLLM's kernel dispatcher fails at the next engine start in
the same process (its module scan trips over llvmlite's ``ffi.lib``), with
or without the overlay.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

# tests/ (engine_utils) and the repository root (the benchmarks package)
sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (2, 3)]

from engine_utils import (  # noqa: E402
    generate_greedy,
    record_calls,
    scheduler,
    with_engine,
)
from pooled_invariants import check_invariants  # noqa: E402

MiB = 2**20
SPECULATIVE = {
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    },
    # the tiny models' one MTP layer, run twice per step
    "mtp": {"method": "mtp", "num_speculative_tokens": 2},
    # a one-layer EAGLE draft (testing.tiny_eagle), its directory
    # given on the command line
    "eagle": {"method": "eagle", "num_speculative_tokens": 2},
}
# Repeating token patterns give the n-gram proposer matches of every length.
BASE = list(range(5, 60)) * 6
PROMPTS = [{"prompt_token_ids": BASE[: 100 + 37 * i]} for i in range(4)]
MAX_TOKENS = 24


def short_prompts(n: int = 64) -> list[dict]:
    """Random prompts of 64-512 tokens (the benchmark's many_short shape)."""
    rng = random.Random("spec_decode/many_short")
    return [
        {
            "prompt_token_ids": [
                rng.randrange(5, 900) for _ in range(rng.randint(64, 512))
            ]
        }
        for _ in range(n)
    ]


def peak_running(llm) -> int:
    """Most requests running at once while 64 short prompts are served."""
    from vllm import SamplingParams

    sched = scheduler(llm)
    original = sched.schedule
    peak = 0

    def schedule(*args, **kwargs):
        nonlocal peak
        output = original(*args, **kwargs)
        peak = max(peak, len(sched.running))
        return output

    sched.schedule = schedule
    try:
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        llm.generate(short_prompts(), params, use_tqdm=False)
    finally:
        sched.schedule = original
    return peak


def run_engine(
    model: str,
    mode: str,
    caching: str,
    pool: str,
    peak: bool,
    out: str,
    draft: str | None = None,
) -> None:
    """One engine: its two greedy passes, kernel calls and (``peak``) peak
    of running requests, written to ``out`` as JSON."""
    from vllm.v1.worker import mamba_utils

    kwargs = {
        "kv_cache_memory_bytes": 48 * MiB,
        "max_model_len": 1024,
        "enable_prefix_caching": caching == "pc",
        "max_num_seqs": 64,
    }
    if pool == "single":
        kwargs["additional_config"] = {"hybrid_kv": {"pooled": False}}
    if mode in SPECULATIVE:
        kwargs["speculative_config"] = dict(SPECULATIVE[mode])
        if draft:
            kwargs["speculative_config"]["model"] = draft
    kernels = ("precopy_mamba_align_fused_kernel", "postprocess_mamba_fused_kernel")
    launches: dict[str, list] = {}

    def work(llm):
        from vllm_hybrid.v1.core.pooled.coordinator import arena_of

        # wrapped after the engine started (activation installs the hosts),
        # unwrapped after it ran: the next engine counts its own calls
        hosts = {name: getattr(mamba_utils, name).host for name in kernels}
        for name in kernels:
            launches[name] = record_calls(getattr(mamba_utils, name), "host")
        try:
            arena = arena_of(scheduler(llm).kv_cache_manager)
            passes = [generate_greedy(llm, PROMPTS, MAX_TOKENS) for _ in range(2)]
            most = peak_running(llm) if peak else None
        finally:
            for name, host in hosts.items():
                getattr(mamba_utils, name).host = host
        if arena is not None:
            # every block back in its pool, ids and boundary consistent
            check_invariants(arena)
            assert [p.used_bytes for p in arena.usage().pools] == [0, 0]
        plan = type(scheduler(llm).kv_cache_config).__name__
        return passes, plan, most

    passes, plan, most = with_engine(model, True, kwargs, work)
    result = {
        "passes": [{"tokens": p.tokens, "gaps": p.gaps} for p in passes],
        "calls": {name: len(calls) for name, calls in launches.items()},
        "kv_cache_config": plan,
        "peak_running": most,
    }
    Path(out).write_text(json.dumps(result))


def main(jobs: str) -> None:
    engines = json.loads(Path(jobs).read_text())
    ngram = [i for i, job in enumerate(engines) if job["mode"] == "ngram"]
    if ngram and ngram != [len(engines) - 1]:
        raise SystemExit("an n-gram engine must be the last of its process")
    for job in engines:
        run_engine(**job)


if __name__ == "__main__":
    main(sys.argv[1])
