"""Entry-point behaviour a first run meets: a bad overlay variable stops every
entry point with one line (no traceback); `--version` and `--help` name this
project next to vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

LOAD_PLUGINS = "from vllm.plugins import load_general_plugins; load_general_plugins()"
CLI = str(Path(sys.executable).with_name("vllm-hybrid"))


@pytest.mark.parametrize(
    "command,variable,value,message",
    [
        (
            [sys.executable, "-c", LOAD_PLUGINS],
            "VLLM_HYBRID_KV",
            "maybe",
            "vllm-hybrid: VLLM_HYBRID_KV='maybe' is not understood: set "
            "VLLM_HYBRID_KV=1 (overlay on, the default) or VLLM_HYBRID_KV=0 "
            "(pure upstream vLLM).",
        ),
        (
            [CLI, "serve", "/nonexistent-model"],
            "VLLM_HYBRID_TQ_NATIVE",
            "2",
            "vllm-hybrid: VLLM_HYBRID_TQ_NATIVE='2' is not understood: set "
            "VLLM_HYBRID_TQ_NATIVE=1 (native kernel when built, the default) or "
            "VLLM_HYBRID_TQ_NATIVE=0 (torch reference).",
        ),
    ],
)
def test_bad_variable_ends_with_one_line(command, variable, value, message):
    env = dict(os.environ, **{variable: value})
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == message


def test_version_names_both_distributions():
    proc = subprocess.run(
        [CLI, "--version"], capture_output=True, text=True, timeout=120
    )
    from vllm_hybrid import __version__

    assert proc.returncode == 0
    assert proc.stdout.strip().startswith(f"vllm-hybrid {__version__} (vLLM 0.32.0")


def test_help_lists_the_projects_subcommands_then_vllms():
    proc = subprocess.run([CLI, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    out = proc.stdout
    assert out.index("  plan ") < out.index("  verify ") < out.index("  serve ")


def test_bad_hybrid_kv_option_ends_with_one_line_before_any_engine():
    proc = subprocess.run(
        [
            CLI,
            "serve",
            "/nonexistent-model",
            "--additional-config",
            '{"hybrid_kv": {"bogus": 1}}',
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "vllm-hybrid: Unknown --additional-config hybrid_kv option(s) ['bogus']; "
        "known options: ['max_page_growth', 'max_page_padding_pct', 'pooled', "
        "'prefill_checkpoint_interval', 'retain_turn_ends', 'token_moves']"
    )


def test_hybrid_kv_errors_are_found_in_both_argument_forms():
    from vllm_hybrid.cli import hybrid_kv_error

    bad = '{"hybrid_kv": {"pooled": "yes"}}'
    assert "must be true or false" in hybrid_kv_error(["--additional-config", bad])
    assert "must be true or false" in hybrid_kv_error([f"--additional-config={bad}"])
    assert hybrid_kv_error(["--additional-config", '{"hybrid_kv": {}}']) is None
    assert hybrid_kv_error(["--additional-config", "{not json"]) is None
    assert hybrid_kv_error(["serve", "model"]) is None


def _llm_error(model, arguments: str) -> tuple[str, str]:
    """``LLM(model, <arguments>)`` in a fresh process: the ValueError it
    raised (``"<type> <message>"``) and the process's stderr."""
    code = (
        "from vllm import LLM\n"
        "try:\n"
        f"    LLM({str(model)!r}, {arguments})\n"
        "except ValueError as exc:\n"
        "    print('ERROR:', type(exc).__name__, exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1], proc.stderr


def test_bad_hybrid_kv_option_in_llm_raises_before_any_engine_process(
    tiny_model_dir,
):
    """``LLM(...)`` gets one ValueError in the caller's process, raised where
    the engine's configuration is made: no engine core starts."""
    error, stderr = _llm_error(
        tiny_model_dir("qwen3_5"),
        "additional_config={'hybrid_kv': {'pooled': 'maybe'}}",
    )
    assert error == (
        "ERROR: OverlayConfigError vllm-hybrid: --additional-config "
        "hybrid_kv.pooled must be true or false, got 'maybe'"
    )
    assert "EngineCore" not in stderr
    assert "Traceback" not in stderr


def test_bad_checkpoint_interval_in_llm_raises_before_any_engine_process(
    tiny_model_dir,
):
    """On CPU the attention block is final where the configuration is made,
    so a --mamba-block-size that pooled mode cannot use is refused there."""
    error, stderr = _llm_error(
        tiny_model_dir("qwen3_5"), "mamba_block_size=200, enable_prefix_caching=True"
    )
    assert error.startswith(
        "ERROR: OverlayConfigError vllm-hybrid: --mamba-block-size 200 must be a "
        "multiple of the attention block size 128"
    )
    assert "EngineCore" not in stderr
