"""The engines compared, each in its own process, and the sweeps' winners.

Engines (item by item what a user of each would set):

* ``upstream``: vLLM 0.32 as installed, overlay off, defaults;
* ``upstream-best``: overlay off, ``--prefix-match-unit`` at the attention
  kernel's block (hits inside upstream's large hybrid block), and the best
  ``--prefix-cache-retention-interval`` of a sweep;
* ``single-pool``: the overlay with pooled mode off (``hybrid_kv.pooled:
  false``): upstream's single shared pool with the overlay's fixes;
* ``pooled``: the overlay's default;
* ``pooled-best``: pooled mode with the best of a sweep of
  ``hybrid_kv.prefill_checkpoint_interval`` (sparse states during long
  prefills) and, if asked, of ``--mamba-block-size`` (the state block: where
  align mode may keep states at all).

"Best" is the fewest prefill tokens computed (every prompt token not served
from the cache, and every token recomputed after a preemption), then the
most tokens hit. Symbolic values are resolved in the engine's process from
its own geometry (:func:`.engine.resolve_options`): ``kernel`` (the
attention kernel's block), ``dense`` (every checkpoint kept), ``Nx`` (N
scheduler blocks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vllm_hybrid.tools.simulate.report import best_key
from vllm_hybrid.tools.simulate.spec import SimulationSpec, Variant

ENGINES: tuple[str, ...] = (
    "upstream",
    "upstream-best",
    "single-pool",
    "pooled",
    "pooled-best",
)
#: ``--prefix-cache-retention-interval`` values upstream-best tries.
DEFAULT_RETENTION_SWEEP: tuple[str, ...] = ("0", "dense", "4x")
#: ``hybrid_kv.prefill_checkpoint_interval`` values pooled-best tries, in
#: tokens (0: no prefill checkpoints); pooled mode's own default is the
#: ``pooled`` engine. The trace's prompts share prefixes in 512-token blocks.
DEFAULT_CHECKPOINT_SWEEP: tuple[str, ...] = ("0", "512", "2048", "8192")
#: ``--mamba-block-size`` values pooled-best tries on top (none by default:
#: each is one more engine run; pooled mode's own default is the attention
#: block).
DEFAULT_STATE_BLOCK_SWEEP: tuple[str, ...] = ()


def _value(text: str) -> int | str | None:
    if text == "dense":
        return None
    return int(text) if text.isdigit() else text


def engine_variants(
    engines: Sequence[str],
    retention_sweep: Sequence[str] = DEFAULT_RETENTION_SWEEP,
    checkpoint_sweep: Sequence[str] = DEFAULT_CHECKPOINT_SWEEP,
    hybrid_kv: Mapping[str, Any] | None = None,
    state_block_sweep: Sequence[str] = DEFAULT_STATE_BLOCK_SWEEP,
) -> dict[str, list[Variant]]:
    """Engine name -> the variants run for it (one, or a sweep)."""
    overlay_kv = dict(hybrid_kv or {})
    out: dict[str, list[Variant]] = {}
    for engine in engines:
        if engine == "upstream":
            out[engine] = [Variant("upstream", False)]
        elif engine == "upstream-best":
            out[engine] = [
                Variant(
                    f"upstream-best[retention={r}]",
                    False,
                    cache={
                        "prefix_match_unit": "kernel",
                        "prefix_cache_retention_interval": _value(r),
                    },
                )
                for r in retention_sweep
            ]
        elif engine == "single-pool":
            out[engine] = [
                Variant("single-pool", True, hybrid_kv={**overlay_kv, "pooled": False})
            ]
        elif engine == "pooled":
            out[engine] = [Variant("pooled", True, hybrid_kv=overlay_kv)]
        elif engine == "pooled-best":
            out[engine] = [
                Variant(
                    f"pooled-best[prefill_checkpoint_interval={c}]",
                    True,
                    hybrid_kv={**overlay_kv, "prefill_checkpoint_interval": int(c)},
                )
                for c in checkpoint_sweep
            ] + [
                Variant(
                    f"pooled-best[mamba_block_size={b}]",
                    True,
                    cache={"mamba_block_size": int(b)},
                    hybrid_kv=overlay_kv,
                )
                for b in state_block_sweep
            ]
        else:
            raise ValueError(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    return out


def worker_env(overlay: bool, log_level: str | None = "ERROR") -> dict[str, str]:
    """A worker's environment: the overlay's switch (read once per process,
    hence one process per mode), in-process engines (the worker steps its
    engine core itself), offline, and vLLM's log lines kept to ``log_level``
    unless the caller's environment says otherwise (None: vLLM's default).
    ``vllm-hybrid simulate`` and ``benchmarks/bench_pooled.py`` start their
    workers alike."""
    env = dict(os.environ)
    env["VLLM_HYBRID_KV"] = "1" if overlay else "0"
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if log_level is not None:
        env.setdefault("VLLM_LOGGING_LEVEL", log_level)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    return env


def run_logged(
    argv: Sequence[str], env: Mapping[str, str], log: Path, stderr: bool = True
) -> int:
    """Run one worker process to its end, its output (and, with ``stderr``,
    its errors) in the file ``log``; its exit status. A worker's result is
    what it writes, not its exit status: the caller reads it."""
    with log.open("w") as out:
        proc = subprocess.run(
            list(argv),
            env=dict(env),
            stdout=out,
            stderr=subprocess.STDOUT if stderr else None,
            check=False,
        )
    return proc.returncode


def run_json_worker(
    argv: Sequence[str],
    payload: Mapping[str, Any],
    overlay: bool,
    workdir: Path,
    name: str,
    log_level: str | None = "ERROR",
    stderr: bool = True,
) -> dict[str, Any]:
    """Run one worker process ``argv IN.json OUT.json`` in :func:`worker_env`
    (``payload`` in ``IN.json``, its output in ``NAME.log``): what it wrote
    to ``OUT.json``, or an ``error`` entry with its log's tail. The workers
    of ``vllm-hybrid simulate`` and ``benchmarks/bench_pooled.py`` run so."""
    in_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.json"
    in_path.write_text(json.dumps(payload))
    log = workdir / f"{name}.log"
    env = worker_env(overlay, log_level)
    returncode = run_logged([*argv, str(in_path), str(out_path)], env, log, stderr)
    if out_path.is_file():
        return json.loads(out_path.read_text())
    return {
        "error": f"worker exited with {returncode}",
        "traceback": log.read_text(errors="replace")[-4000:],
    }


def run_in_process(
    spec: SimulationSpec, variant: Variant, workdir: Path, line: int = 0
) -> dict[str, Any]:
    """Run one variant in a fresh worker process; its summary, or an
    ``error`` entry with the worker's traceback. ``line``: the terminal line
    of its progress bar."""
    name = "".join(c if c.isalnum() else "_" for c in variant.name)
    payload = {"spec": spec.to_json(), "variant": asdict(variant), "line": line}
    argv = [sys.executable, "-m", "vllm_hybrid.tools.simulate.worker"]
    stderr = not spec.progress
    result = run_json_worker(
        argv, payload, variant.overlay, workdir, name, stderr=stderr
    )
    return result if "variant" in result else {"variant": asdict(variant), **result}


def run_engines(
    spec: SimulationSpec,
    variants: Mapping[str, Sequence[Variant]],
    jobs: int = 2,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Every variant, ``jobs`` processes at a time; per engine the runs and
    the name of the best."""
    flat = [v for runs in variants.values() for v in runs]
    with tempfile.TemporaryDirectory(prefix="vllm-hybrid-simulate-") as tmp:
        where = workdir or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        lines = max(1, jobs)
        with ThreadPoolExecutor(max_workers=lines) as pool:
            results = list(
                pool.map(
                    lambda iv: run_in_process(spec, iv[1], where, iv[0] % lines),
                    enumerate(flat),
                )
            )
    by_name = {v.name: r for v, r in zip(flat, results, strict=True)}
    engines: dict[str, Any] = {}
    for engine, runs in variants.items():
        summaries = {v.name: by_name[v.name] for v in runs}
        best = min(summaries, key=lambda n: best_key(summaries[n]))
        engines[engine] = {"best": best, "runs": summaries}
    return engines
