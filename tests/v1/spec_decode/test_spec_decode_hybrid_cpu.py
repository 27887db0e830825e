"""n-gram, MTP and EAGLE speculative decoding on a hybrid (gated DeltaNet)
model on CPU.

vLLM 0.32 cannot run it here: with prefix caching align mode launches two
Triton kernels the CPU platform has no host version of, and with or without
prefix caching the CPU GDN conv mis-rolls its buffer after a step with fewer
drafts than configured. The overlay replaces both (registry entries); this
runs the tiny ``qwen3_next`` with n-gram drafts and with a one-layer EAGLE
draft (``testing.tiny_eagle``), and its MTP variant (one MTP
layer) with MTP drafts, and compares the greedy tokens with the same
engine without speculative decoding, and pooled mode with the overlay's
single shared pool under the same flags. The default tier runs n-gram and
MTP drafts; EAGLE drafts are in the extended tier (``--extended``).

The engines run in subprocesses, as few as the n-gram rule allows: once
an n-gram proposer has imported numba, vLLM's kernel dispatcher fails at the
next engine start in the same process (its module scan trips over llvmlite's
``ffi.lib``), with or without the overlay, so each n-gram engine is the last
of its process and every other engine runs before the first of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from engine_utils import Greedy, near_tie_differences

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("spec_engine.py")


def _run_process(jobs: list[dict], tmp: Path, name: str) -> None:
    """Run ``jobs`` (spec_engine.py's engines) one after the other in one
    process."""
    path = tmp / f"{name}.jobs.json"
    path.write_text(json.dumps(jobs))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def processes(engines: list[tuple]) -> list[list[tuple]]:
    """Engines grouped into as few processes as the n-gram rule allows: an
    n-gram engine ends its process (spec_engine.py), so every other engine
    runs in the first process, before its n-gram engine."""
    others = [e for e in engines if e[1] != "ngram"]
    ngram = [e for e in engines if e[1] == "ngram"]
    if not ngram:
        return [others]
    return [others + ngram[:1]] + [[e] for e in ngram[1:]]


@pytest.fixture(scope="module")
def runs(request, tiny_model_dir, tiny_eagle_dir, tmp_path_factory):
    model = tiny_model_dir("qwen3_next")
    mtp_model = tiny_model_dir("qwen3_next", mtp=True)
    tmp = tmp_path_factory.mktemp("spec_decode")
    engines = [
        (model, "plain", "pc", "pooled"),
        (model, "ngram", "pc", "pooled"),
        (model, "ngram", "no-pc", "pooled"),
        (model, "ngram", "pc", "single"),
        (mtp_model, "plain", "pc", "pooled"),
        (mtp_model, "mtp", "pc", "pooled"),
    ]
    if request.config.getoption("--extended"):
        # EAGLE drafts, and the single shared pool under MTP and EAGLE drafts:
        # the default run compares pooled mode with it under n-gram drafts
        engines += [
            (model, "eagle", "pc", "pooled"),
            (mtp_model, "mtp", "pc", "single"),
            (model, "eagle", "pc", "single"),
        ]

    def compared(engine_model, mode: str, caching: str, pool: str) -> bool:
        """Whether the engine's peak of running requests is compared: only
        where pooled mode and the single pool both run (the peak costs
        about three quarters of a run)."""
        other = "single" if pool == "pooled" else "pooled"
        return (engine_model, mode, caching, other) in engines

    def out(key: tuple) -> Path:
        return tmp / f"{Path(key[0]).name}-{key[1]}-{key[2]}-{key[3]}.json"

    def job(key: tuple) -> dict:
        # the EAGLE draft is built only where an EAGLE engine runs
        draft = tiny_eagle_dir("qwen3_next") if key[1] == "eagle" else None
        return dict(
            model=str(key[0]),
            mode=key[1],
            caching=key[2],
            pool=key[3],
            peak=compared(*key),
            out=str(out(key)),
            draft=None if draft is None else str(draft),
        )

    for i, group in enumerate(processes(engines)):
        _run_process([job(key) for key in group], tmp, f"process{i}")
    return {
        (key[1], key[2], key[3], key[0] == mtp_model): json.loads(out(key).read_text())
        for key in engines
    }


def _greedy(run: dict, i: int) -> Greedy:
    p = run["passes"][i]
    return Greedy(p["tokens"], p["gaps"])


#: (speculative method, whether it runs on the MTP variant of the model)
METHODS = [
    ("ngram", False),
    ("mtp", True),
    pytest.param("eagle", False, marks=pytest.mark.extended),
]
#: the methods whose engines also run with the single shared pool
AGAINST_SINGLE = [
    ("ngram", False),
    pytest.param("mtp", True, marks=pytest.mark.extended),
    pytest.param("eagle", False, marks=pytest.mark.extended),
]


@pytest.mark.parametrize("method, mtp", METHODS)
def test_prefix_caching_runs_the_host_copy_kernels(runs, method, mtp):
    calls = runs[method, "pc", "pooled", mtp]["calls"]
    assert calls["precopy_mamba_align_fused_kernel"] > 0
    assert calls["postprocess_mamba_fused_kernel"] > 0
    assert set(runs["plain", "pc", "pooled", mtp]["calls"].values()) == {0}


@pytest.mark.parametrize("method, mtp", METHODS)
def test_tokens_equal_plain_decoding_up_to_near_ties(runs, method, mtp):
    plain = _greedy(runs["plain", "pc", "pooled", mtp], 0)
    keys = [k for k in runs if k[0] == method and k[2] == "pooled" and k[3] == mtp]
    assert keys
    for key in keys:
        for i in (0, 1):
            spec = _greedy(runs[key], i)
            assert all(len(t) == len(plain.tokens[0]) for t in spec.tokens)
            found = near_tie_differences(plain, spec.tokens, spec.gaps)
            assert found == [], (key, i)


def test_prefix_cache_hits_do_not_change_speculative_tokens(runs):
    """n-gram drafts with prefix caching give the uncached run's tokens, and
    the second (cache-hitting) pass gives the first pass's, up to near-ties
    by the two-sided rule: a pass that resumes from cached states scores its
    tokens in batches of another shape, which rounds bf16 differently (on an
    AMX host one prompt's second pass differs at output 11). A difference
    where either run was confident fails, with both runs' top-2 gaps."""
    cached = runs["ngram", "pc", "pooled", False]["passes"]
    uncached = runs["ngram", "no-pc", "pooled", False]["passes"]
    pairs = {
        "cached vs uncached": (uncached[0], cached[0]),
        "second vs first pass": (cached[0], cached[1]),
    }
    for name, (reference, other) in pairs.items():
        found = near_tie_differences(
            Greedy(reference["tokens"], reference["gaps"]),
            other["tokens"],
            other["gaps"],
        )
        assert found == [], (name, _gaps_at(found, other))


def _gaps_at(found, other: dict) -> list[tuple[int, int, float | None, float | None]]:
    """(prompt, position, reference gap, other run's gap) of each fault."""
    return [
        (i, at, gap, other["gaps"][i][at] if at < len(other["gaps"][i]) else None)
        for i, at, gap in found
    ]


@pytest.mark.parametrize("method, mtp", AGAINST_SINGLE)
def test_pooled_mode_takes_the_drafts(runs, method, mtp):
    assert runs[method, "pc", "pooled", mtp]["kv_cache_config"] == "PooledKVCacheConfig"
    assert runs[method, "pc", "single", mtp]["kv_cache_config"] == "KVCacheConfig"


@pytest.mark.parametrize("method, mtp", AGAINST_SINGLE)
def test_pooled_tokens_equal_the_single_pool_with_the_same_flags(runs, method, mtp):
    single = runs[method, "pc", "single", mtp]["passes"]
    pooled = runs[method, "pc", "pooled", mtp]["passes"]
    for i in (0, 1):
        found = near_tie_differences(
            _greedy({"passes": single}, i), pooled[i]["tokens"], pooled[i]["gaps"]
        )
        assert found == [], i


@pytest.mark.parametrize("method, mtp", AGAINST_SINGLE)
def test_pooled_runs_more_requests_at_once_with_drafts(runs, method, mtp):
    pooled = runs[method, "pc", "pooled", mtp]["peak_running"]
    single = runs[method, "pc", "single", mtp]["peak_running"]
    assert pooled > single > 0, (pooled, single)
