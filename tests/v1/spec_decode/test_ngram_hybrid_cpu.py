"""n-gram speculative decoding on a hybrid (gated DeltaNet) model on CPU.

vLLM 0.32 cannot run it here: with prefix caching align mode launches two
Triton kernels the CPU platform has no host version of, and with or without
prefix caching the CPU GDN conv mis-rolls its buffer after a step with fewer
drafts than configured. The overlay replaces both (registry entries); this
runs the tiny ``qwen3_next`` with n-gram drafts and compares its greedy
tokens with the same engine without speculative decoding, and pooled mode
(which takes n-gram drafts: they add no KV cache group) with the overlay's
single shared pool under the same flags.

Each engine runs in its own process: once the n-gram proposer has imported
numba, vLLM's kernel dispatcher fails at the next engine start in the same
process (its module scan trips over llvmlite's ``ffi.lib``), with or without
the overlay.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from engine_utils import Greedy, near_tie_differences

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("ngram_engine.py")


def _run(model, mode: str, caching: str, pool: str, tmp: Path) -> dict:
    out = tmp / f"{mode}-{caching}-{pool}.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(model), mode, caching, pool, str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("qwen3_next")
    tmp = tmp_path_factory.mktemp("ngram")
    engines = [
        ("plain", "pc", "pooled"),
        ("spec", "pc", "pooled"),
        ("spec", "no-pc", "pooled"),
        ("spec", "pc", "single"),
    ]
    return {key: _run(model, *key, tmp) for key in engines}


def _greedy(run: dict, i: int) -> Greedy:
    p = run["passes"][i]
    return Greedy(p["tokens"], p["gaps"])


def test_ngram_with_prefix_caching_runs_the_host_copy_kernels(runs):
    calls = runs["spec", "pc", "pooled"]["calls"]
    assert calls["precopy_mamba_align_fused_kernel"] > 0
    assert calls["postprocess_mamba_fused_kernel"] > 0
    assert set(runs["plain", "pc", "pooled"]["calls"].values()) == {0}


def test_ngram_tokens_equal_plain_decoding_up_to_near_ties(runs):
    plain = _greedy(runs["plain", "pc", "pooled"], 0)
    for key in (("spec", "pc", "pooled"), ("spec", "no-pc", "pooled")):
        for i in (0, 1):
            spec = _greedy(runs[key], i)
            assert all(len(t) == len(plain.tokens[0]) for t in spec.tokens)
            found = near_tie_differences(plain, spec.tokens, spec.gaps)
            assert found == [], (key, i)


def test_prefix_cache_hits_do_not_change_speculative_tokens(runs):
    cached = runs["spec", "pc", "pooled"]["passes"]
    assert cached[1]["tokens"] == cached[0]["tokens"]
    assert cached[0]["tokens"] == runs["spec", "no-pc", "pooled"]["passes"][0]["tokens"]


def test_pooled_mode_takes_ngram_drafts(runs):
    assert runs["spec", "pc", "pooled"]["kv_cache_config"] == "PooledKVCacheConfig"
    assert runs["spec", "pc", "single"]["kv_cache_config"] == "KVCacheConfig"


def test_pooled_tokens_equal_the_single_pool_with_the_same_flags(runs):
    single = runs["spec", "pc", "single"]["passes"]
    pooled = runs["spec", "pc", "pooled"]["passes"]
    for i in (0, 1):
        found = near_tie_differences(
            _greedy({"passes": single}, i), pooled[i]["tokens"], pooled[i]["gaps"]
        )
        assert found == [], i


def test_pooled_runs_more_requests_at_once_with_ngram_drafts(runs):
    pooled = runs["spec", "pc", "pooled"]["peak_running"]
    single = runs["spec", "pc", "single"]["peak_running"]
    assert pooled > single > 0, (pooled, single)
