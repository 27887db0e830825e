"""A reload of a patched module is survived: the next engine start finds the
sites that lost the overlay, binds them again and says so in one line.

Runs in its own process: a reload in the suite's process would put upstream's
functions back for every later test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).with_name("reload_probe.py")
RELOADED = "vllm.v1.core.kv_cache_utils"


def test_reload_is_found_and_repaired_at_the_next_engine_start():
    proc = subprocess.run(
        [sys.executable, str(PROBE)], capture_output=True, text=True, timeout=300
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RELOAD ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(line[len("RELOAD ") :])
    assert report["lost_before_reload"] == []
    # every entry whose home is the reloaded module lost its binding there
    lost = report["lost_after_reload"]
    assert len(lost) == 5 and all(site.startswith(RELOADED + ":") for site in lost)
    assert report["pooled_plan"] is True
    assert report["lost_after_engine_start"] == []
    assert report["home_is_overlay"] is True
    assert "5 patched upstream symbol(s) had been rebound" in proc.stdout + proc.stderr
