"""The prepared device run, and its CPU rehearsal: one command, bounded parts.

``--mode device`` (on the GPU machine, through ``scripts/gpu/run.sh device``)
builds the run's site directory from ``.gpu-bundle/device`` (see
``sitedir``), then runs each part in its own process with a time budget,
killing the part's whole process group when it runs over:

* ``imports``: every module the parts use (``imports.py``);
* ``tier``: the kernel conformance tier, compiled, on CUDA tensors (``tier.py``);
* ``timings``: pooled views against upstream's contiguous layout (``timings.py``);
* ``copies``: align mode's state copies at Qwen3.6-35B-A3B's state page
  (``copies.py``);
* ``serve``: the tiny ``qwen3_5`` with TurboQuant through vLLM's OpenAI
  server, pooled, single pool and upstream, one engine at a time: equal
  tokens, the follow-up's prefix hit, where each start-up went
  (``serve.py``);
* ``flagship``: Qwen3.6-35B-A3B's per-layer shapes, depth cut, dummy
  weights, pooled and upstream under ``vllm bench serve`` (``serve.py``);
* ``engines``: ``vllm-hybrid verify``'s tiny engines through the offline
  API (``engines.py``; the first run's stretch, superseded by ``serve``).

By default a device call runs ``serve`` and ``flagship`` (the engines come
first: they are what no run has measured yet); ``--parts`` picks others.
Each part writes ``<part>.json`` under the output folder; ``summary.json``
holds the environment and every part's exit code, time and whether it ran
over; ``log.txt`` every part's output. That is 7 files, inside what a device
call brings back (8 files, 2 folders deep).

``--mode rehearse`` runs the same parts here, on CPU: the same vLLM tree and
stand-ins and the same wheels (their CPython 3.11 twins where compiled), in a
fresh interpreter that sees only a twin of the device image
(``device_image.txt`` linked from this checkout's venv), kernels in Triton's
interpreter at the parts' small CPU sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from datetime import datetime, timezone
from pathlib import Path

import sitedir
from bundle import BUNDLE, DEVICE, REHEARSAL, TREE_NAME, commit, is_pure

#: part -> (script, budget on the device in s, budget in the rehearsal in
#: s, extra arguments). The engine parts' device budgets come from the first
#: device run (about 43 s of imports per engine when three started at once)
#: and this checkout's CPU rehearsal of serve.py: the first engine gets at
#: least 150 s; with a 1-2 minute machine start the default parts fit a 540 s
#: call and leave a rerun within the 15 minutes of device time.
PARTS = {
    "imports": ("imports.py", 40, 300, []),
    "serve": ("serve.py", 280, 400, ["--what", "serve"]),
    "flagship": ("serve.py", 230, 300, ["--what", "flagship"]),
    "tier": ("tier.py", 160, 1500, []),
    "timings": ("timings.py", 110, 900, []),
    "copies": ("copies.py", 50, 600, []),
    "engines": ("engines.py", 90, 400, []),
}
DEFAULT_PARTS = ("serve", "flagship")
#: Seconds a part may run past its budget to write its JSON before its
#: process group is killed (the parts bound their own work by the budget).
GRACE = 15


def build_site(mode: str, work: Path) -> tuple[Path, str, dict]:
    """The run's site directory; returns it, the interpreter the parts run
    under, and facts for the summary."""
    site = sitedir.fresh(work / "site")
    package = sitedir.unpack_vllm(DEVICE / TREE_NAME, site)
    wheels = sorted((DEVICE / "wheels").glob("*.whl"))
    python, facts = sys.executable, {}
    if mode == "rehearse":
        wheels = [w for w in wheels if is_pure(w)]
        wheels += sorted((REHEARSAL / "wheels").glob("*.whl"))
        purelib = Path(sysconfig.get_path("purelib"))
        twin, facts["image_not_here"] = sitedir.image_twin(work, purelib)
        python = str(twin)
    facts["installer"] = sitedir.install_wheels(wheels, site)
    facts["wheels"] = [w.name for w in wheels]
    facts["stand_ins"] = sitedir.write_standins(package)
    facts["tree_edits"] = sitedir.apply_edits(package)
    sitedir.write_metadata(site)
    facts["byte_compile_s"] = byte_compile(python, site)
    return site, python, facts


def byte_compile(python: str, site: Path) -> float:
    """Compile the run's vLLM tree once, in parallel, before any part: each
    engine's processes would otherwise compile the modules they import, the
    first engine's server and engine core at the same time."""
    start = time.monotonic()
    done = subprocess.run(
        [python, "-m", "compileall", "-q", "-j", "0", str(site / "vllm")],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        print(f"byte-compiling the tree: exit {done.returncode}: {done.stderr[-300:]}")
    return round(time.monotonic() - start, 1)


def part_env(mode: str, site: Path, work: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(site), str(sitedir.ROOT), str(sitedir.HERE)]),
        GPU_RUN_SITE=str(site),
        GPU_RUN_WORK=str(work),
        GPU_RUN_MODE=mode,
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CACHE_ROOT=str(work / "vllm-cache"),
        # compiled kernels and autotuning results are shared by the parts:
        # the timings reuse what the tier compiled and tuned
        TRITON_CACHE_DIR=str(work / "triton-cache"),
        TRITON_CACHE_AUTOTUNING="1",
        # vLLM's samplers (V1 and V2) import FlashInfer to ask whether its
        # top-k/top-p sampler suits the card unless this is off; the GPU
        # machine has no FlashInfer (every engine of the second device run
        # stopped there)
        VLLM_USE_FLASHINFER_SAMPLER="0",
    )
    env.pop("PYTHONHOME", None)
    if mode == "rehearse":
        env["VLLM_TARGET_DEVICE"] = "cpu"
    return env


def run_part(
    name: str,
    python: str,
    env: dict,
    out: Path,
    mode: str,
    extra: list[str],
    budget: float | None = None,
) -> dict:
    """One part in its own process group; ``budget`` replaces the part's
    own budget for ``mode`` when given (``--budgets``)."""
    script, device_budget, rehearsal_budget, fixed = PARTS[name]
    if budget is None:
        budget = device_budget if mode == "device" else rehearsal_budget
    command = [python, str(sitedir.HERE / script), "--out", str(out / f"{name}.json")]
    command += ["--budget", str(budget), *fixed, *extra]
    start = time.monotonic()
    with open(out / "log.txt", "a") as log:
        log.write(f"\n===== part {name} (budget {budget} s) =====\n")
        log.flush()
        proc = subprocess.Popen(
            command,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=sitedir.ROOT,
        )
        try:
            rc = proc.wait(timeout=budget + GRACE)
            over = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, over = proc.wait(), True
    seconds = round(time.monotonic() - start, 1)
    return {"part": name, "rc": rc, "seconds": seconds, "budget": budget, "over": over}


def gpu_facts() -> dict:
    """The card as nvidia-smi reads it (a query only)."""
    query = "name,driver_version,memory.total,clocks.sm,clocks.max.sm"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"nvidia_smi": repr(exc)}
    return {"nvidia_smi": out.stdout.strip() or out.stderr.strip()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("device", "rehearse"), required=True)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS))
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument(
        "--budgets", default="", help="PART=SECONDS,... replacing parts' budgets"
    )
    parser.add_argument(
        "--tier-select", default="", help="part tier: only tests matching this -k"
    )
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; known: {list(PARTS)}")
    default_work = "/tmp/vllm-hybrid-gpu" if args.mode == "device" else None
    work = args.work or Path(default_work or BUNDLE / "rehearsal" / "work")
    out = args.out or BUNDLE / "rehearsal" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text("")
    start = time.monotonic()
    site, python, facts = build_site(args.mode, work)
    env = part_env(args.mode, site, work)
    manifest = json.loads((BUNDLE / "manifest.json").read_text())
    summary = {
        "mode": args.mode,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        # on the device, the commit the bundle was packed at (pack right
        # before a device call): the device's copy of .git may be missing or
        # be the session's starting checkout, whatever the tree holds now
        "commit": manifest["commit"] if args.mode == "device" else commit(),
        "bundle_commit": manifest["commit"],
        "setup_seconds": round(time.monotonic() - start, 1),
        "site": facts,
        "gpu": gpu_facts() if args.mode == "device" else None,
        "parts": [],
    }
    budgets = {
        name: float(seconds)
        for name, seconds in (s.split("=") for s in args.budgets.split(",") if s)
    }
    for name in parts:
        extra = ["--select", args.tier_select] if name == "tier" else []
        summary["parts"].append(
            run_part(name, python, env, out, args.mode, extra, budgets.get(name))
        )
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(json.dumps(summary["parts"][-1]), flush=True)
    summary["seconds"] = round(time.monotonic() - start, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"device run ({args.mode}): {summary['seconds']} s, results in {out}")
    return 0 if all(p["rc"] == 0 for p in summary["parts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
