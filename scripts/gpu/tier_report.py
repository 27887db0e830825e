"""A pytest plugin that appends each test's outcome to a JSON-lines file as
soon as it is known (``TIER_REPORT``), so a tier run killed at its budget
still leaves every finished test's result. Loaded with ``-p tier_report``."""

from __future__ import annotations

import json
import os


def pytest_runtest_logreport(report):
    path = os.environ.get("TIER_REPORT")
    # with pytest-xdist the controller receives every worker's reports;
    # the workers, which load this plugin too, leave the file to it
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.when != "call" and not (report.failed or report.skipped):
        return
    entry = {
        "test": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "seconds": round(report.duration, 3),
    }
    if report.failed:
        entry["error"] = str(report.longrepr)[-1500:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        entry["reason"] = report.longrepr[2]
    with open(path, "a") as out:
        out.write(json.dumps(entry) + "\n")
