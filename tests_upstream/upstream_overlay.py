"""pytest plugin for running vLLM's own tests with the overlay on or off.

Loaded with ``-p upstream_overlay`` (``scripts/upstream_tests.sh`` puts this
directory on ``PYTHONPATH``), so it is imported before any conftest and any
upstream test module. It

* activates the overlay at import time, as vLLM does in every process:
  ``vllm.plugins.load_general_plugins()``. Upstream test modules bind vLLM
  symbols by name at import, so activating later would leave them calling
  upstream's objects;
* checks the activation against ``--overlay=on|off`` (the runner sets
  ``VLLM_HYBRID_KV=0`` for ``off``) and stops the run with a usage error when
  they disagree: an "on" run with nothing applied compares upstream with
  itself;
* after every test, checks that the patched symbols are still the overlay's.
  A test that reloads a patched module (``importlib.reload``) puts upstream's
  functions back for every later test; the plugin re-applies the overlay and
  records the test, so later outcomes do not depend on test order;
* marks every test ``skip_global_cleanup`` (``--global-cleanup=skip``, the
  default): vLLM's conftest otherwise runs ``gc.collect()`` and a distributed
  teardown after each test, nine tenths of the run time on 2 cores;
* redirects the text models the tests name to local config directories
  (``hub_models``) with vLLM's ``VLLM_MODEL_REDIRECT_PATH``;
* writes one JSON record per run (``--outcomes-json``): per test its outcome,
  whether it failed for want of a hub model, and a one-line message.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

_activation_error: BaseException | None = None
try:
    import vllm.plugins

    vllm.plugins.load_general_plugins()
except Exception as exc:  # reported with context in pytest_configure
    _activation_error = exc

#: Text in a failure that means the test needed a model from the hub.
HUB_SIGNATURES = (
    "Invalid repository ID or local directory specified",
    "LocalEntryNotFoundError",
    "OfflineModeIsEnabled",
    "outgoing traffic has been disabled",
    "couldn't connect to 'https://huggingface.co'",
)

#: Outcomes worst first: a test's final outcome is the worst of its phases.
_RANK = ("error", "failed", "xpassed", "xfailed", "skipped", "passed")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vllm-hybrid upstream tests")
    group.addoption(
        "--overlay",
        choices=("on", "off", "fork"),
        default=None,
        help="Expected overlay state (fork: vLLM's tree with the fixes, no "
        "vllm-hybrid installed); the run stops if activation disagrees.",
    )
    group.addoption(
        "--outcomes-json",
        default=None,
        help="Write per-test outcomes of this run to this JSON file.",
    )
    group.addoption(
        "--global-cleanup",
        choices=("skip", "each-test"),
        default="skip",
        help=(
            "skip (default): mark every test skip_global_cleanup, vLLM's own "
            "opt-out of the per-test gc.collect() and distributed teardown of "
            "tests/conftest.py (10x faster, same outcomes); each-test: keep it."
        ),
    )
    group.addoption(
        "--hub-redirect",
        choices=("yes", "no"),
        default="yes",
        help="Redirect hub model ids to local config directories (default yes).",
    )


def _registry():
    from vllm_hybrid.patches import registry

    return registry


def _overlay_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm_hybrid") is not None


def _activation() -> dict[str, Any]:
    if not _overlay_installed():
        # the fork's environment (vllm-hybrid fork --wheel): vLLM itself
        import vllm
        import vllm.config

        return {
            "active": False,
            "reason": "vllm-hybrid not installed",
            "vllm": vllm.__version__,
            "applied": [],
            "fork": hasattr(vllm.config, "HybridKVConfig"),
        }
    from vllm_hybrid import plugin

    state = plugin.state()
    return {
        "active": bool(state and state.active),
        "reason": state.reason if state else "not activated",
        "vllm": plugin.installed_vllm_version(),
        "applied": [entry.target for entry in _registry().applied()],
    }


class _Recorder:
    def __init__(self, config: pytest.Config, expect: str | None) -> None:
        self.config = config
        self.expect = expect
        self.tests: dict[str, dict[str, Any]] = {}
        self.collection_errors: dict[str, str] = {}
        self.overlay_restored_after: dict[str, list[str]] = {}
        self.start = time.monotonic()
        self.at_start = _activation()
        self.keep_overlay = bool(self.at_start["active"])

    # -- outcomes ---------------------------------------------------------
    @staticmethod
    def _phase_outcome(report: pytest.TestReport) -> str:
        if hasattr(report, "wasxfail"):
            return "xfailed" if report.skipped else "xpassed"
        if report.when != "call" and report.failed:
            return "error"
        return report.outcome

    @staticmethod
    def _message(report: pytest.TestReport | pytest.CollectReport) -> str:
        longrepr = report.longrepr
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            return str(longrepr[2])
        crash = getattr(longrepr, "reprcrash", None)
        if crash is not None:
            return str(crash.message).splitlines()[0][:300]
        text = report.longreprtext.strip().splitlines()
        return text[-1][:300] if text else ""

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        outcome = self._phase_outcome(report)
        rec = self.tests.setdefault(
            report.nodeid,
            {"outcome": "passed", "needs_hub": False, "message": "", "duration_s": 0.0},
        )
        rec["duration_s"] = round(rec["duration_s"] + report.duration, 3)
        if _RANK.index(outcome) < _RANK.index(rec["outcome"]):
            rec["outcome"] = outcome
            rec["message"] = self._message(report)
        if report.failed and any(s in report.longreprtext for s in HUB_SIGNATURES):
            rec["needs_hub"] = True

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collection_errors[report.nodeid] = self._message(report)

    # -- overlay kept across tests ----------------------------------------
    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        if not self.keep_overlay:
            return
        lost = _registry().repair()
        if lost:
            self.overlay_restored_after[item.nodeid] = lost

    # -- the record ---------------------------------------------------------
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        at_end = _activation()
        ok = at_end["active"] == (self.expect == "on") and bool(at_end["applied"]) == (
            self.expect == "on"
        )
        if self.expect is not None and not ok:
            tr = self.config.pluginmanager.get_plugin("terminalreporter")
            line = f"overlay expected {self.expect} at session end, found {at_end}"
            if tr is not None:
                tr.write_line(line, red=True, bold=True)
            session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
        path = self.config.getoption("outcomes_json")
        if not path:
            return
        record = {
            "overlay": self.expect,
            "activation_at_start": self.at_start,
            "activation_at_end": at_end,
            "overlay_ok_at_end": ok,
            "overlay_restored_after": self.overlay_restored_after,
            "hub_redirect": self.config.getoption("hub_redirect"),
            "global_cleanup": self.config.getoption("global_cleanup"),
            "duration_s": round(time.monotonic() - self.start, 1),
            "exitstatus": int(session.exitstatus),
            "collection_errors": self.collection_errors,
            "tests": dict(sorted(self.tests.items())),
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(record, indent=1) + "\n")


def _check_activation(expect: str) -> None:
    if _activation_error is not None:
        raise pytest.UsageError(
            f"vllm-hybrid: loading vLLM's general plugins failed: "
            f"{type(_activation_error).__name__}: {_activation_error}"
        )
    act = _activation()
    if expect == "on" and not (act["active"] and act["applied"]):
        raise pytest.UsageError(
            f"vllm-hybrid: --overlay=on but the overlay is not active "
            f"({act['reason']}; {len(act['applied'])} patches applied). "
            f"Is VLLM_HYBRID_KV=0 set, or vLLM not {act['vllm']}?"
        )
    if expect == "fork" and (_overlay_installed() or not act.get("fork")):
        raise pytest.UsageError(
            "vllm-hybrid: --overlay=fork needs the fork's environment: vLLM with "
            "HybridKVConfig (vllm-hybrid fork --wheel) and no vllm-hybrid installed"
        )
    if expect == "off" and (act["active"] or act["applied"]):
        raise pytest.UsageError(
            f"vllm-hybrid: --overlay=off but {len(act['applied'])} patches are "
            "applied; run with VLLM_HYBRID_KV=0."
        )


_models_dir: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _models_dir
    expect = config.getoption("overlay")
    if expect is not None:
        _check_activation(expect)
    if config.getoption("hub_redirect") == "yes":
        import hub_models

        _models_dir = tempfile.mkdtemp(prefix="vllm-hybrid-upstream-models-")
        redirect = hub_models.build(Path(_models_dir))
        os.environ["VLLM_MODEL_REDIRECT_PATH"] = str(redirect)
    config.pluginmanager.register(_Recorder(config, expect), "upstream-recorder")


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    if config.getoption("global_cleanup") == "skip":
        for item in items:
            item.add_marker(pytest.mark.skip_global_cleanup)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _models_dir is not None:
        shutil.rmtree(_models_dir, ignore_errors=True)


def pytest_report_header(config: pytest.Config) -> list[str]:
    act = _activation()
    state = "on" if act["active"] else f"off ({act['reason']})"
    return [
        f"vllm-hybrid overlay: {state}, {len(act['applied'])} patches applied, "
        f"vLLM {act['vllm']}"
    ]
