"""Turn one device run's JSON into the Markdown tables the docs carry.

    python scripts/gpu/report.py benchmarks/results/gpu-YYYYMMDD
        [--check | --timings-table]

reads ``summary.json`` and the parts' JSON files written by
``device_run.py`` and prints, in order: the run (date, card, commit,
versions, each part's outcome), the kernel tier's result, the
pooled/contiguous time ratio per kernel, the align-mode copy costs next to
the GDN decode step, and the engines' outcome (``--timings-table``: only
the kernels' time table). ``--check`` exits with 1 when
a part failed or a ratio is above :data:`MAX_RATIO` (the acceptance bound),
naming each.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: Pooled/contiguous time ratio a kernel may reach.
MAX_RATIO = 1.05


def load(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def run_commit(summary: dict) -> str:
    """The commit a device run ran: the bundle's (packed right before the
    call). Runs before 2026-11-27's second call wrote the device copy's
    ``.git`` HEAD as ``commit``, which was the session's starting checkout."""
    return summary.get("bundle_commit") or summary["commit"]


def run_section(summary: dict, imports: dict | None) -> list[str]:
    env = (imports or {}).get("environment", {})
    card = env.get("device") or (summary.get("gpu") or {}).get("nvidia_smi", "?")
    lines = [
        f"Run of {summary['date']} ({summary['mode']}),"
        f" commit {run_commit(summary)[:10]}, {card};"
        f" Python {env.get('python', '?')}, torch {env.get('torch', '?')},"
        f" Triton {env.get('triton', '?')}, platform {env.get('platform', '?')}.",
        "",
    ]
    rows = [
        [
            p["part"],
            "ok" if p["rc"] == 0 else f"exit {p['rc']}",
            p["seconds"],
            p["budget"],
            "yes" if p["over"] else "",
        ]
        for p in summary["parts"]
    ]
    return lines + table(["part", "outcome", "s", "budget s", "over"], rows)


def tier_section(tier: dict | None) -> list[str]:
    if tier is None:
        return ["Kernel tier: no result."]
    line = (
        f"Kernel tier ({'compiled, 4 workers' if tier['parallel'] else 'one process'}):"
        f" {tier['passed']} passed, {tier['failed']} failed, {tier['skipped']} skipped"
        + (", stopped at its budget" if tier["over_budget"] else "")
        + "."
    )
    lines = [line]
    for failure in tier["failures"]:
        last = failure.get("error", "").strip().splitlines()[-1:] or [""]
        lines.append(f"- `{failure['test']}`: {last[0]}")
    return lines


def timing_rows(timings: dict) -> list[list]:
    rows = []
    for entry in timings["timings"]:
        if "ratio" in entry:
            flag = "" if entry["ratio"] <= MAX_RATIO else f"> {MAX_RATIO}"
            rows.append(
                [
                    entry["name"],
                    entry["shape"],
                    f"{entry['pooled_ms']:.4f}",
                    f"{entry['contiguous_ms']:.4f}",
                    f"{entry['ratio']:.3f}",
                    f"{entry['contiguous_spread']:.3f}",
                    flag,
                ]
            )
        else:
            reason = entry.get("error") or entry.get("skipped", "")
            rows.append([entry["name"], "", "", "", "", "", reason])
    return rows


def timings_section(timings: dict | None) -> list[str]:
    if timings is None:
        return ["Timings: no result."]
    return [f"Timings ({timings['environment']['timer']}):", ""] + timings_table(
        timings
    )


def timings_table(timings: dict) -> list[str]:
    """The pooled/contiguous time of each kernel, one Markdown table."""
    header = [
        "kernel",
        "shape",
        "pooled ms",
        "contiguous ms",
        "ratio",
        "contiguous spread",
        "note",
    ]
    return table(header, timing_rows(timings))


def copies_section(copies: dict | None) -> list[str]:
    if copies is None:
        return ["Align-mode copies: no result."]
    entries = {e["name"]: e for e in copies["copies"]}
    rows, steps = [], []
    for name, entry in entries.items():
        dtype, _, what = name.partition(": ")
        if "error" in entry or "skipped" in entry:
            rows.append(
                [dtype, what, entry.get("error") or entry["skipped"], "", "", ""]
            )
        elif what.startswith(("batch_memcpy", "fused precopy")):
            rows.append(
                [
                    dtype,
                    what,
                    f"{entry['kernel_ms']:.3f}",
                    f"{entry['per_request_ms']:.4f}",
                    f"{entry['moved_gb_per_s']:.0f}",
                    f"{entry['host_collect_ms']:.2f}"
                    if "host_collect_ms" in entry
                    else "",
                ]
            )
        elif what.startswith("GDN decode step"):
            batch = entry["batch"]
            copy = entries.get(f"{dtype}: batch_memcpy x{batch}", {})
            every = copy.get("kernel_ms")
            steps.append(
                [
                    dtype,
                    batch,
                    entry["layers"],
                    f"{entry['step_ms']:.3f}",
                    f"{every:.3f}" if every else "",
                    f"{every / entry['step_ms']:.2f}" if every else "",
                ]
            )
    page = {
        n.partition(": ")[0]: e for n, e in entries.items() if n.endswith("state page")
    }
    lines = [
        "State page per request: "
        + ", ".join(
            f"{d} {e['request_mib']:.2f} MiB"
            for d, e in page.items()
            if "request_mib" in e
        )
        + ".",
        "",
    ]
    lines += table(
        ["SSM dtype", "copy", "kernel ms", "per request ms", "GB/s moved", "host ms"],
        rows,
    )
    lines += [
        "",
        "GDN decode step (conv update + packed recurrent decode, every layer):",
        "",
    ]
    lines += table(
        [
            "SSM dtype",
            "batch",
            "layers",
            "step ms",
            "all requests copied ms",
            "copy / step",
        ],
        steps,
    )
    return lines


def engines_section(engines: dict | None) -> list[str]:
    if engines is None:
        return ["Engines: no result."]
    lines = [f"Engines ({engines['model']}):"]
    for variant in engines["variants"]:
        if "skipped" in variant:
            lines.append(f"- {variant['variant']}: skipped ({variant['skipped']})")
        elif variant["ok"]:
            lines.append(f"- {variant['variant']}: all verify checks passed")
        elif variant["stopped"]:
            stops = "; ".join(
                f"{mode}: {stop['error'] or 'exit ' + str(stop['rc'])}"
                for mode, stop in variant["stopped"].items()
            )
            lines.append(f"- {variant['variant']}: stopped ({stops})")
        else:
            failed = [c for c in variant["checks"] if c.startswith("FAIL")]
            lines.append(f"- {variant['variant']}: {'; '.join(failed)}")
    return lines


def served_section(name: str, part: dict | None) -> list[str]:
    """Parts ``serve`` and ``flagship``: each engine's outcome, where its
    start-up went, and the checks or ratios."""
    if part is None:
        return [f"Served engines ({name}): no result."]
    rows = []
    for engine in part["engines"].values():
        stages = ", ".join(
            f"{k} {v:g} s" for k, v in engine.get("stages_s", {}).items()
        )
        if "skipped" in engine:
            outcome = f"skipped ({engine['skipped']})"
        elif engine["ok"]:
            outcome = f"served, ready in {engine['ready_s']:g} s"
        else:
            outcome = (
                f"stopped {engine['stopped_in']}: {engine['cause'].split('] ', 1)[-1]}"
            )
        rows.append([engine["engine"], outcome, stages or "-"])
    lines = [f"Served engines ({name}, {part['model']}):", ""]
    lines += table(["engine", "outcome", "start-up stages reached"], rows)
    for check, value in (part.get("checks") or {}).items():
        lines.append(
            f"- {check}: {value if isinstance(value, str) else '; '.join(value)}"
        )
    if part.get("ratios"):
        lines.append(f"- pooled / upstream: {json.dumps(part['ratios'])}")
    return lines


def problems(folder: Path) -> list[str]:
    summary = load(folder, "summary")
    found = [f"part {p['part']} exit {p['rc']}" for p in summary["parts"] if p["rc"]]
    timings = load(folder, "timings")
    for entry in (timings or {}).get("timings", []):
        if entry.get("ratio", 0) > MAX_RATIO:
            found.append(f"{entry['name']}: ratio {entry['ratio']:.3f} > {MAX_RATIO}")
    return found


def render(folder: Path) -> str:
    summary = load(folder, "summary")
    ran = {p["part"] for p in summary["parts"]}
    sections = [run_section(summary, load(folder, "imports"))]
    parts = {
        "tier": lambda: tier_section(load(folder, "tier")),
        "timings": lambda: timings_section(load(folder, "timings")),
        "copies": lambda: copies_section(load(folder, "copies")),
        "engines": lambda: engines_section(load(folder, "engines")),
        "serve": lambda: served_section("serve", load(folder, "serve")),
        "flagship": lambda: served_section("flagship", load(folder, "flagship")),
    }
    # only the parts this run ran (a rerun runs some of them)
    sections += [render_part() for name, render_part in parts.items() if name in ran]
    return "\n\n".join("\n".join(s) for s in sections) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--check", action="store_true")
    parser.add_argument(
        "--timings-table",
        action="store_true",
        help="print only the kernels' time table (docs/benchmarks.md shows it)",
    )
    args = parser.parse_args(argv)
    if args.timings_table:
        print("\n".join(timings_table(load(args.folder, "timings"))))
    else:
        print(render(args.folder), end="")
    if args.check:
        found = problems(args.folder)
        for line in found:
            print(f"check: {line}", file=sys.stderr)
        return 1 if found else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
