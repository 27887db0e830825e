"""The loopback server harness without a server: ``/metrics`` read with
``prometheus_client``'s parser, and a server's log classified (upstream's
exit-time noise counted as harmless, failures and their cause named)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from testing.loopback import Metrics, read_log, shutdown_report


def test_metrics_are_summed_over_engines_and_split_by_label():
    text = (
        "# HELP vllm:prefix_cache_hits Prefix cache hits.\n"
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="/m x"} 12.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="/m x"} 3.0\n'
        'vllm_hybrid:kv_pool_used_bytes{engine="0",pool="token"} 0.0\n'
        'vllm_hybrid:kv_pool_used_bytes{engine="0",pool="state"} 1609728.0\n'
        'vllm_hybrid:kv_pool_used_bytes{engine="1",pool="state"} 2.0\n'
        "vllm:num_requests_running 2\n"
    )
    metrics = Metrics.parse(text)
    assert metrics.total("vllm:prefix_cache_hits_total") == 15.0
    assert metrics.total("vllm:num_requests_waiting") == 0.0
    assert metrics.by("vllm_hybrid:kv_pool_used_bytes", "pool") == {
        "token": 0.0,
        "state": 1609730.0,
    }
    assert metrics.kv_in_use() == {
        "running": 2.0,
        "waiting": 0.0,
        "kv_cache_usage_perc": 0.0,
        "token_used_bytes": 0.0,
        "state_used_bytes": 1609730.0,
    }


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


def test_cause_names_the_root_exception_not_its_consequences():
    log = "INFO start\nWARNING x\nTraceback (most recent call last):\nValueError: bad\n"
    assert read_log(log).cause == "ValueError: bad"
    engine = "(EngineCore pid=2) ERROR 11-25 15:14:32 [core.py:1512]"
    api = "(APIServer pid=1) ERROR 11-25 15:14:32 [serving.py:500]"
    log = (
        "(APIServer pid=1) WARNING [x.py:1] raise the ulimit or get "
        "`OSError: [Errno 24] Too many open files`\n"
        f"{engine} Traceback (most recent call last):\n"
        f"{engine} ValueError: Cannot get 1 free blocks from the pool\n"
        f"{api} vllm.v1.engine.exceptions.EngineDeadError: EngineCore died\n"
        f"{TRIGGER}\n(EngineCore pid=2) ERROR [core.py:1] late\n"
    )
    report = read_log(log)
    assert (
        report.cause == f"{engine} ValueError: Cannot get 1 free blocks from the pool"
    )
    # what went wrong while serving, apart from what the shutdown logged
    assert len(report.while_serving) == 3 and len(report.problems) == 4
    assert read_log("INFO all fine\n") == read_log("")
    assert read_log("INFO all fine\n").cause == ""


def test_a_crash_comes_before_the_errors_it_causes():
    log = (
        "INFO: Application startup complete.\n"
        "!!!!!!! Segfault encountered !!!!!!!\n"
        '  File "./signal/../sysdeps/unix/sysv/linux/libc_sigaction.c", line 0\n'
        '  File "csrc/cpu/cpu_attn_vec.hpp", line 305, in reshape_and_cache\n'
        "(EngineCore pid=2) ERROR [core.py:1512] RuntimeError: cancelled\n"
    )
    assert read_log(log).cause == (
        "!!!!!!! Segfault encountered !!!!!!! "
        'File "csrc/cpu/cpu_attn_vec.hpp", line 305, in reshape_and_cache'
    )
