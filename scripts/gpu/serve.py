"""Parts ``serve`` and ``flagship`` of the device run: engines behind vLLM's
OpenAI server, one at a time, with where each engine's start-up went.

* ``serve``: the tiny ``qwen3_5`` with ``--kv-cache-dtype turboquant_k8v4``
  in pooled mode, the overlay's single pool and upstream, each in its own
  ``vllm-hybrid serve``. Greedy chat completions: a shared system prompt and
  a question, then a follow-up turn carrying the first answer. The three
  must give the same tokens (a difference may only start at one of
  upstream's near-ties, as in ``vllm-hybrid verify``); ``/metrics`` gives
  the prefix-cache hit of the follow-up.
* ``flagship``: a model with Qwen3.6-35B-A3B's per-layer shapes
  (:mod:`testing.shaped_models`, depth cut to :data:`FLAGSHIP_LAYERS`,
  random weights by ``--load-format dummy``), bf16, pooled mode and upstream
  one after the other, each driven by ``vllm bench serve`` on a shared-prefix
  load (the serving benchmark's harness, ``benchmarks/serve``): TTFT and
  TPOT p50/p99, output tokens/s, prefix hit rate, preemptions.

Each engine's start-up is split into stages by the first log line that marks
each (:data:`STAGES`); an engine that did not start says the stage it was in
and the log's likeliest cause. The engines run with what the device run's
tree has: vLLM's Python code, Triton kernels and the stand-ins' PyTorch ops
(``standin_ops``). On CUDA they take upstream's defaults otherwise, the model
runner included. Run directly with this checkout's venv they serve on CPU (a
rehearsal of this script with vLLM's CPU wheel); in the device run's CPU
rehearsal (stand-in tree) they stop where the CPU backend needs a compiled op.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from tier_env import ROOT, write_json

sys.path.insert(0, str(ROOT))

from testing.loopback import (
    PREFIX_HITS,
    PREFIX_QUERIES,
    read_log,
    scrape,
    serve,
)  # noqa: E402
from vllm_hybrid.tools.verify import MODES  # noqa: E402

#: Start-up stages, each reached at the first log line holding its marker.
STAGES = (
    ("arguments parsed", "non-default args"),
    ("engine configured", "Initializing a V1 LLM engine"),
    ("model loaded", "Model loading took"),
    ("memory profiled", "Available KV cache memory"),
    ("KV cache allocated", "KV cache size"),
    ("CUDA graphs captured", "Graph capturing finished"),
    ("engine ready", "init engine (profile"),
    ("serving", "Application startup complete"),
)
#: vLLM's log time stamp: ``INFO 11-27 12:18:31 [file.py:12] ...``.
STAMP = re.compile(r"(?:INFO|WARNING|ERROR|DEBUG) (\d\d-\d\d \d\d:\d\d:\d\d)")
NATIVE_IR_OPS = '{"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}'
#: Tiny chat: the system prompt the two turns share, and the turns.
SYSTEM = " ".join(["You answer questions about memory pools in short sentences."] * 24)
QUESTIONS = ("What does an arena hold?", "And what moves its boundary?")
CHAT_TOKENS = 16
#: Seconds below which an engine is not started (it could not get ready).
MIN_SHARE = 30
FLAGSHIP_PRESET = "qwen3.5-35b-a3b"
FLAGSHIP_LAYERS = 8
#: The flagship's load: 4 shared 1,536-token prefixes (a system prompt and
#: earlier turns), 256 tokens of each request's own, 96 tokens out.
FLAGSHIP_LOAD = (
    "--dataset-name=prefix_repetition",
    "--prefix-repetition-prefix-len=1536",
    "--prefix-repetition-suffix-len=256",
    "--prefix-repetition-num-prefixes=4",
    "--prefix-repetition-output-len=96",
)


def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# -- start-up stages -------------------------------------------------------


def stage_times(log_text: str, started: datetime) -> dict[str, float]:
    """Seconds from the server's start to the first line of each stage."""
    found: dict[str, float] = {}
    for line in log_text.splitlines():
        stamp = STAMP.search(line)
        for name, marker in STAGES:
            if name not in found and marker in line and stamp:
                when = datetime.strptime(
                    f"{started.year}-{stamp[1]}", "%Y-%m-%d %H:%M:%S"
                )
                found[name] = round(max(0.0, (when - started).total_seconds()), 1)
    return found


def stopped_in(found: dict[str, float]) -> str:
    """The stage an engine was in: the one after the last stage reached
    (stages an engine skips, such as CUDA graphs when eager, do not count)."""
    reached = [i for i, (name, _) in enumerate(STAGES) if name in found]
    if not reached:
        return "start-up before argument parsing (imports)"
    last = max(reached)
    if last + 1 >= len(STAGES):
        return "serving"
    return f"after '{STAGES[last][0]}', before '{STAGES[last + 1][0]}'"


# -- one engine -------------------------------------------------------------


def run_engine(
    name: str,
    model: Path,
    args: list[str],
    env: dict,
    budget: float,
    log_dir: Path,
    work,
) -> dict:
    """Start one server, run ``work(handle)`` on it, stop it; never raises
    for a server problem: the report says what happened."""
    log_path = log_dir / f"{name}.log"
    report: dict = {"engine": name, "arguments": args, "budget_s": round(budget)}
    started, start = datetime.now().replace(microsecond=0), time.monotonic()
    try:
        with serve(
            model, args, log_path=log_path, env=env, ready_timeout=budget
        ) as handle:
            report["ready_s"] = round(time.monotonic() - start, 1)
            report["runner"] = runner(handle.log_text())
            report["plan"] = [x.split("] ", 1)[-1] for x in handle.plan_lines()][:8]
            report["result"] = work(handle)
            report["ok"] = True
    except Exception as err:  # noqa: BLE001 - a report, not a handler
        report["ok"] = False
        report["error"] = (str(err) or type(err).__name__).splitlines()[0][:300]
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    report["stages_s"] = stage_times(text, started)
    if "ready_s" in report:  # uvicorn's own line carries no time stamp
        report["stages_s"]["serving"] = report["ready_s"]
    if not report["ok"]:
        report["stopped_in"] = stopped_in(report["stages_s"])
        report["cause"] = read_log(text).cause[:400]
        report["tail"] = text.splitlines()[-25:]
    report["seconds"] = round(time.monotonic() - start, 1)
    # each engine's report beside its log as soon as it ends: a part stopped
    # at its budget still leaves the engines it finished (the device call
    # brings the log folder back)
    write_json(log_dir / f"{name}.json", report)
    print(
        json.dumps(
            {
                k: report.get(k)
                for k in ("engine", "ok", "seconds", "stopped_in", "cause")
            }
        ),
        flush=True,
    )
    return report


def runner(log_text: str) -> str:
    """The model runner an engine chose, as its log says."""
    for line in log_text.splitlines():
        if "using the V1 model runner" in line:
            return "V1: " + line.split("] ", 1)[-1][:200]
    return "V2 (vLLM's CUDA default)" if on_cuda() else "V1 (CPU)"


def mode_args(mode: str) -> list[str]:
    """The server options of ``mode``: ``vllm-hybrid verify``'s engine
    arguments for it (the single pool's ``additional_config``), as flags."""
    return [
        f"--{key.replace('_', '-')}={json.dumps(value)}"
        for key, value in MODES[mode][1].items()
    ]


def mode_env(mode: str) -> dict[str, str]:
    """The server's environment: the mode's switch; the V1 runner for every
    mode when ``GPU_RUN_V1=1`` (a rerun where Model Runner V2, which vLLM
    and pooled mode use on CUDA by default, could not run in the stand-in
    tree)."""
    env = dict(os.environ, VLLM_HYBRID_KV=MODES[mode][0])
    if os.environ.get("GPU_RUN_V1") == "1":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    return env


def common_args(cuda: bool, graphs: bool = False) -> list[str]:
    """What every engine of the run adds. On CUDA: vLLM's custom ops and IR
    ops in their PyTorch form (the run's tree has no compiled kernels for
    them), no ``torch.compile`` (the device's torch is older than the one
    vLLM 0.32 was built against), and either eager execution or full CUDA
    graphs for decode batches up to 32. On CPU: eager."""
    if not cuda:
        return ["--enforce-eager", "--disable-uvicorn-access-log"]
    # the lent card showed torch 8.21 GiB in all, about 6 GiB of it free
    # (2026-11-27); vLLM refuses to start when this share exceeds what is free
    args = ["--gpu-memory-utilization=0.5"]
    compilation = {"mode": 0, "custom_ops": ["none"]}
    if graphs:
        compilation |= {
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "max_cudagraph_capture_size": 32,
        }
    args += [
        f"--ir-op-priority={NATIVE_IR_OPS}",
        f"--compilation-config={json.dumps(compilation)}",
        "--disable-uvicorn-access-log",
    ]
    return args if graphs else [*args, "--enforce-eager"]


# -- part serve: tiny engines, three modes ----------------------------------


def chat_turns(handle) -> dict:
    """Two greedy turns; the tokens, upstream-style top-2 gaps, and the
    prefix-cache counters around the follow-up."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTIONS[0]},
    ]
    tokens, gaps, counters, answer = [], [], {}, ""
    for turn, question in enumerate(QUESTIONS):
        if turn:
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": question},
            ]
        before = scrape(handle.url)
        reply = handle.chat(
            "",
            max_tokens=CHAT_TOKENS,
            messages=messages,
            logprobs=True,
            top_logprobs=2,
            ignore_eos=True,
        )
        after = scrape(handle.url)
        content = reply["choices"][0]["logprobs"]["content"]
        answer = reply["choices"][0]["message"]["content"]
        tokens.append([c["token"] for c in content])
        gaps.append([_gap(c["top_logprobs"]) for c in content])
        counters[f"turn{turn + 1}"] = {
            "prompt_tokens": reply["usage"]["prompt_tokens"],
            "prefix_queries": after.total(PREFIX_QUERIES)
            - before.total(PREFIX_QUERIES),
            "prefix_hits": after.total(PREFIX_HITS) - before.total(PREFIX_HITS),
        }
    return {"tokens": tokens, "gaps": gaps, "prefix": counters}


def _gap(top: list[dict]) -> float | None:
    best = sorted((t["logprob"] for t in top), reverse=True)
    return best[0] - best[1] if len(best) > 1 else None


def tiny_args(cuda: bool) -> list[str]:
    # upstream's CPU attention cannot store TurboQuant: the CPU rehearsal
    # of this script runs bf16 there
    dtype = "turboquant_k8v4" if cuda else "auto"
    return [
        f"--kv-cache-dtype={dtype}",
        "--max-model-len=2048",
        "--max-num-seqs=8",
        "--kv-cache-memory-bytes=268435456",
        "--mamba-ssm-cache-dtype=float32",
        "--enable-prefix-caching",
        "--seed=0",
        *common_args(cuda),
    ]


def part_serve(budget: float, work: Path, log_dir: Path) -> dict:
    from vllm_hybrid.tools.tiny_models import build_tiny_model
    from vllm_hybrid.tools.verify import token_differences

    start, cuda = time.monotonic(), on_cuda()
    model = Path(build_tiny_model(work / "tiny-qwen3_5", "qwen3_5"))
    engines = {}
    # upstream first: the reference; the first engine pays the imports'
    # byte-compilation and Triton's first compiles
    for i, mode in enumerate(("upstream", "pooled", "single_pool")):
        left = budget - (time.monotonic() - start) - 10
        # the first engine compiles and tunes the Triton kernels the others
        # find in the shared cache: it gets the larger share
        share = min(max(left * 0.45, left - 120), 170) if i == 0 else left / (3 - i)
        if share < MIN_SHARE:
            engines[mode] = {"engine": mode, "ok": False, "skipped": f"{left:.0f} s"}
            continue
        engines[mode] = run_engine(
            mode,
            model,
            tiny_args(cuda) + mode_args(mode),
            mode_env(mode),
            share,
            log_dir,
            chat_turns,
        )
    report = {
        "model": "tiny qwen3_5",
        "device": "cuda" if cuda else "cpu",
        "engines": engines,
    }
    upstream = engines["upstream"].get("result")
    checks = {}
    for mode in ("pooled", "single_pool"):
        result = engines[mode].get("result")
        if upstream and result:
            checks[f"{mode} tokens equal upstream's"] = (
                token_differences(upstream, result["tokens"]) or "equal"
            )
    report["checks"] = checks
    report["ok"] = all(e.get("ok") for e in engines.values()) and all(
        v == "equal" for v in checks.values()
    )
    return report


# -- part flagship: Qwen3.6-35B-A3B shapes, pooled and upstream ------------


def flagship_args(cuda: bool) -> list[str]:
    args = [
        "--load-format=dummy",
        "--dtype=bfloat16",
        "--max-model-len=8192",
        "--max-num-seqs=32",
        "--max-num-batched-tokens=4096",
        "--mamba-ssm-cache-dtype=float32",
        "--enable-prefix-caching",
        "--seed=0",
        *common_args(cuda, graphs=True),
    ]
    if cuda:
        args += ["--attention-backend=TRITON_ATTN"]
    else:
        args += ["--kv-cache-memory-bytes=1073741824"]
    return args


def flagship_bench(requests: int, rate: float):
    from benchmarks.serve.config import BenchConfig, warmup
    from benchmarks.serve.run import bench

    cfg = BenchConfig(
        requests=requests, dataset_args=FLAGSHIP_LOAD, seed=0, warmup_requests=4
    )

    def work(handle) -> dict:
        with open(os.devnull, "w") as out:
            bench(warmup(cfg), handle.url, handle.model, math.inf, out)
            run = bench(cfg, handle.url, handle.model, rate, out)
        return {"rate": run.rate, "values": run.values, "errors": run.errors}

    return work


#: Experts kept when the card's memory (as PyTorch sees it) cannot hold the
#: preset's 256 experts per layer (1.6 GB each at bf16): the lent card showed
#: 8.21 GiB (2026-11-27). Each token still goes to 8 experts of the preset's
#: width, so the per-token MoE work is the same; only weights shrink.
SMALL_CARD_EXPERTS = 32
SMALL_CARD_GIB = 40


def card_gib() -> float:
    """The card's memory as PyTorch reports it, asked in a child process so
    that this driver holds no CUDA context the servers would lose."""
    code = "import torch; print(torch.cuda.mem_get_info()[1] / 2**30)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return float(done.stdout.strip() or 0)


def part_flagship(
    budget: float,
    work: Path,
    log_dir: Path,
    requests: int,
    rate: float,
    overrides: dict,
) -> dict:
    from testing.shaped_models import build_shaped_model

    start, cuda = time.monotonic(), on_cuda()
    gib = card_gib() if cuda else None
    if gib is not None and gib < SMALL_CARD_GIB:
        overrides.setdefault("num_experts", SMALL_CARD_EXPERTS)
    model = build_shaped_model(
        work / "flagship-shaped", FLAGSHIP_PRESET, FLAGSHIP_LAYERS, **overrides
    )
    engines = {}
    for i, mode in enumerate(("pooled", "upstream")):
        left = budget - (time.monotonic() - start) - 10
        share = left * 0.6 if i == 0 else left
        if share < MIN_SHARE:
            engines[mode] = {"engine": mode, "ok": False, "skipped": f"{left:.0f} s"}
            continue
        env = mode_env(mode)
        engines[mode] = run_engine(
            f"flagship-{mode}",
            model,
            flagship_args(cuda),
            env,
            share,
            log_dir,
            flagship_bench(requests, rate),
        )
    report = {
        "model": f"{FLAGSHIP_PRESET} shapes, {FLAGSHIP_LAYERS} layers, dummy weights",
        "config": json.loads((model / "config.json").read_text()),
        "load": list(FLAGSHIP_LOAD)
        + [f"--num-prompts={requests}", f"--request-rate={rate}"],
        "device": "cuda" if cuda else "cpu",
        "card_gib": gib,
        "overrides": overrides,
        "engines": engines,
    }
    report["ratios"] = ratios(engines)
    report["ok"] = all(e.get("ok") for e in engines.values())
    return report


RATIO_KEYS = (
    "p50_ttft_ms",
    "p99_ttft_ms",
    "p50_tpot_ms",
    "p99_tpot_ms",
    "output_throughput",
)


def ratios(engines: dict) -> dict:
    """Pooled / upstream for each timing, where both engines measured it."""

    def values(mode):
        return (engines.get(mode, {}).get("result") or {}).get("values") or {}

    pooled, upstream = values("pooled"), values("upstream")
    out = {}
    for key in RATIO_KEYS:
        if pooled.get(key) and upstream.get(key):
            out[key] = round(pooled[key] / upstream[key], 3)
    for key in ("prefix_hit_rate", "preemptions", "completed"):
        out[key] = {"pooled": pooled.get(key), "upstream": upstream.get(key)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=600)
    parser.add_argument("--what", choices=("serve", "flagship"), default="serve")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        help="flagship shape KEY=INT (CPU rehearsal)",
    )
    args = parser.parse_args(argv)
    work = Path(os.environ.get("GPU_RUN_WORK", "/tmp/vllm-hybrid-gpu"))
    log_dir = work / "server-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.what == "serve":
        report = part_serve(args.budget, work, log_dir)
    else:
        overrides = {k: int(v) for k, v in (o.split("=") for o in args.override)}
        report = part_flagship(
            args.budget, work, log_dir, args.requests, args.rate, overrides
        )
    write_json(args.out, report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
