"""Classifying a stopped server's log: upstream's exit-time noise is
counted as harmless, failures are named."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from vllm_hybrid.tools.server import shutdown_report

NOISE = "\n".join(
    [
        "(APIServer pid=1) INFO [launcher.py:110] Shutting down FastAPI HTTP server.",
        "nanobind: leaked 64 types!",
        ' - leaked type "triton._C.libtriton.ir.location"',
        " - ... skipped remainder",
        "nanobind: this is likely caused by a reference counting issue in the "
        "binding code.",
        "/x/resource_tracker.py:254: UserWarning: resource_tracker: There appear "
        "to be 2 leaked shared_memory objects to clean up at shutdown",
        "  warnings.warn('resource_tracker: There appear to be %d '",
        "(APIServer pid=1) WARNING [system_utils.py:255] consider "
        "`OSError: [Errno 24] Too many open files`",
        "",
    ]
)


def _handle(tmp_path: Path, text: str) -> SimpleNamespace:
    log = tmp_path / "server.log"
    log.write_text(text)
    return SimpleNamespace(log_text=log.read_text)


def test_known_exit_noise_is_harmless(tmp_path):
    report = shutdown_report(_handle(tmp_path, NOISE), 0)
    assert report.harmless_lines == 6
    assert report.problems == ()
    assert report.clean


RACE = [
    "(APIServer pid=1) ERROR [async_llm.py:906] AsyncLLM output_handler failed.",
    "(APIServer pid=1) ERROR [async_llm.py:906] Traceback (most recent call last):",
    "(APIServer pid=1) ERROR [async_llm.py:906] vllm.v1.engine.exceptions."
    "EngineDeadError: EngineCore encountered an issue.",
]
TRIGGER = (
    "(APIServer pid=1) INFO [launcher.py:254] [shutdown] API server: shutdown triggered"
)


def test_engine_dead_error_before_shutdown_or_exit_code_is_not_clean(tmp_path):
    report = shutdown_report(_handle(tmp_path, "\n".join(RACE) + "\n" + NOISE), 0)
    assert not report.clean
    assert len(report.problems) == 3 and "EngineDeadError" in report.problems[2]
    assert not shutdown_report(_handle(tmp_path, NOISE), -9).clean


def test_engine_dead_error_of_the_abort_shutdown_is_upstreams_race(tmp_path):
    log = "\n".join([TRIGGER, *RACE]) + "\n" + NOISE
    report = shutdown_report(_handle(tmp_path, log), 0)
    assert report.clean and report.harmless_lines == 6 + 3
    # an error from elsewhere during shutdown is still a problem
    other = (
        log + "(EngineCore pid=2) ERROR [core.py:1] Traceback (most recent call last)\n"
    )
    assert not shutdown_report(_handle(tmp_path, other), 0).clean
