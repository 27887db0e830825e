"""One simulated engine in its own process.

``python -m vllm_hybrid.tools.simulate.worker SPEC.json OUT.json`` runs the
variant named in ``SPEC.json`` (a :class:`~.session.SimulationSpec` and a
:class:`~.session.Variant`) and writes its summary to ``OUT.json``. The
overlay's switch ``VLLM_HYBRID_KV`` is read once per process, when vLLM
loads plugins, so :mod:`.runner` starts one such process per variant with
the switch set for it.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

#: Collector thresholds of a worker. Each engine step allocates thousands of
#: short-lived containers, and with CPython's default (700, 10, 10) a full
#: collection over every request's token lists runs every few hundred steps:
#: about 15% of a pooled run's CPU on the Mooncake trace. Nothing the engine
#: decides depends on when garbage is collected.
GC_THRESHOLDS = (100_000, 20, 20)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print(
            "usage: python -m vllm_hybrid.tools.simulate.worker SPEC OUT",
            file=sys.stderr,
        )
        return 2
    spec_path, out_path = Path(args[0]), Path(args[1])
    gc.set_threshold(*GC_THRESHOLDS)
    from vllm_hybrid.tools.simulate.session import SimulationSpec, Variant, run_variant

    data = json.loads(spec_path.read_text())
    spec = SimulationSpec.from_json(data["spec"])
    variant = Variant(**data["variant"])
    try:
        summary = run_variant(spec, variant, line=int(data.get("line", 0)))
    except Exception as exc:  # reported to the parent, which shows it once
        summary = {
            "variant": data["variant"],
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
    out_path.write_text(json.dumps(summary))
    return 0 if "error" not in summary else 1


if __name__ == "__main__":
    sys.exit(main())
