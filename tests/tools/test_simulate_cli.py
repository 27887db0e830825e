"""``vllm-hybrid simulate``: every bad input is one line on stderr and exit
status 2, before any engine process starts.

Each case runs the command's ``main`` with the runner replaced by one that
fails the test if called, and with the runner's one function that starts a
worker process doing the same: a case passes only if nothing was started. The cases that
need vLLM (the plan of the request) run in this process too; the unknown
architecture runs in a fresh interpreter, where vLLM's own log lines would
show on stderr if they were not kept quiet.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hybrid.tools.simulate import cli, runner

MODEL = ["qwen3.6-35b-a3b-fp8", "--gpu-memory", "80"]


@pytest.fixture
def no_worker(monkeypatch):
    """The runner and its subprocesses fail the test if anything starts."""
    started: list[str] = []

    def refuse(*args, **kwargs):
        started.append(repr(args)[:200])
        raise AssertionError("an engine worker was started")

    monkeypatch.setattr(cli, "run_engines", refuse)
    monkeypatch.setattr(runner, "run_in_process", refuse)
    return started


def _refused(argv: list[str], capsys) -> str:
    """Run the command; it must exit 2 with one stderr line, returned."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("vllm-hybrid simulate: error: ")
    return err


def _trace(tmp_path: Path, lines: list) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


MOONCAKE_LINE = {"timestamp": 0, "input_length": 600, "output_length": 5}
FOLLOWUP_LINE = {
    "id": "x",
    "timestamp": 5,
    "segments": [{"hash": 1, "tokens": 5}],
    "output_length": 5,
}


def test_an_unknown_model_is_named_first(no_worker, capsys):
    err = _refused(["qwen3.6-35b", "--gpu-memory", "80"], capsys)
    assert "MODEL 'qwen3.6-35b' is not a built-in preset" in err
    assert "did you mean qwen3.6-35b-a3b-fp8" in err
    assert no_worker == []


def test_unknown_shape_keys_are_refused_as_make_trace_refuses_them(no_worker, capsys):
    err = _refused(
        [*MODEL, "--workload", "chat_server", "--shape", '{"convs": 8}'], capsys
    )
    assert "--shape: unknown field(s) ['convs']; known: ['concurrency'," in err
    err = _refused(
        [*MODEL, "--workload", "many_short", "--shape", '{"min_len": 9, "max_len": 3}'],
        capsys,
    )
    assert "--shape: min_len must be <= max_len" in err
    err = _refused([*MODEL, "--shape", '{"conversations": 8}'], capsys)
    assert "--shape sets the sizes of chat_server" in err
    assert no_worker == []


@pytest.mark.parametrize(
    ("lines", "needle"),
    [
        # a timed-trace line without hash ids
        (
            [dict(MOONCAKE_LINE, hash_ids=[1, 2]), MOONCAKE_LINE],
            "line 2: no hash_ids; a line of this form has timestamp, input_length",
        ),
        # the two forms mixed, either way round
        (
            [dict(MOONCAKE_LINE, hash_ids=[1, 2]), FOLLOWUP_LINE],
            "line 2: a request with follow-ups in a trace whose first line is a "
            "timed-trace line",
        ),
        (
            [FOLLOWUP_LINE, dict(MOONCAKE_LINE, hash_ids=[1, 2])],
            "line 2: a timed-trace line (hash_ids) in a trace with follow-ups",
        ),
        # hash ids that do not cover the input length in 512-token blocks
        (
            [dict(MOONCAKE_LINE, hash_ids=list(range(38)))],
            "line 1: 38 hash ids for input_length 600, but blocks of 512 tokens "
            "need 2; its ids stand for about 16 tokens each: pass "
            "--timed-trace-chunk-hash-size",
        ),
        (["not json"], "line 1: neither a timed-trace line"),
    ],
)
def test_every_trace_line_is_checked_with_its_line_number(
    tmp_path, lines, needle, no_worker, capsys
):
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    )
    err = _refused([*MODEL, "--trace", str(path)], capsys)
    assert f"--trace {path} {needle}" in err
    assert no_worker == []


def test_the_hash_block_size_option_reads_a_16_token_trace(tmp_path, no_worker):
    """The same line is refused at 512 tokens a hash id and read at 16."""
    from vllm_hybrid.tools.simulate.trace import TraceFormat, read_trace

    path = _trace(tmp_path, [dict(MOONCAKE_LINE, hash_ids=list(range(38)))])
    (record,) = read_trace(path, fmt=TraceFormat(block_tokens=16))
    assert len(record.hash_ids) == 38
    with pytest.raises(ValueError, match="need 2"):
        read_trace(path)


@pytest.mark.parametrize(
    ("option", "needle"),
    [
        ("--json", "--json /missing/dir/out.json: directory /missing/dir does not"),
        (
            "--per-request",
            "--per-request /missing/dir/out.json: directory /missing/dir does not",
        ),
        ("--plot", "--plot /missing/dir/out.json: directory /missing/dir does not"),
    ],
)
def test_output_paths_are_checked_first(option, needle, no_worker, capsys):
    err = _refused([*MODEL, option, "/missing/dir/out.json"], capsys)
    assert needle in err
    assert no_worker == []


def test_pasted_serve_flags_and_engine_options_are_checked(no_worker, capsys):
    err = _refused([*MODEL, "--enforce-eager"], capsys)
    assert "--enforce-eager: a vllm serve option that simulate does not model" in err
    err = _refused([*MODEL, "--hybrid-kv", '{"pooled": "maybe"}'], capsys)
    assert err.startswith("vllm-hybrid simulate: error: --hybrid-kv: ")
    err = _refused([*MODEL, "--engines", "fast"], capsys)
    assert "unknown engine 'fast'" in err
    assert no_worker == []


def test_a_budget_too_small_gives_plans_one_number(no_worker, capsys):
    """Qwen3.5-9B on 24 GiB: vllm serve's 262,144 tokens do not fit; the
    message is plan's, in simulate's own option names, with one number."""
    from vllm_hybrid.tools.plan.cli import main as plan

    argv = ["qwen3.5-9b", "--gpu-memory", "24"]
    err = _refused(argv, capsys)
    assert "longest that fit, by each engine's own planning: upstream vLLM 0.32 " in err
    assert err.endswith(
        "Raise --gpu-memory or --gpu-memory-utilization, or lower --max-model-len "
        "to 129,888."
    )
    assert plan(argv) == 2
    plan_err = capsys.readouterr().err.strip()
    assert plan_err.split("error: ")[1] == err.split("error: ")[1]
    # the overlay's single pool is checked by its own planning too, and only
    # the engines asked for are named
    err = _refused([*argv, "--engines", "upstream,single-pool"], capsys)
    assert (
        "own planning: upstream vLLM 0.32 129,888 and the overlay's single pool "
        "129,888. Raise"
    ) in err
    err = _refused([*argv, "--engines", "pooled"], capsys)
    assert "by the engine's own planning: pooled mode 130,464. Raise" in err
    assert err.endswith("lower --max-model-len to 130,464.")
    assert no_worker == []


def test_upstream_refusing_to_start_stops_with_vllms_reason(
    no_worker, capsys, monkeypatch
):
    """Qwen3.5-9B on 24 GiB at 32,768 tokens: vLLM 0.32 refuses its full
    CUDA graphs for 256 sequences over 253 states. Pooled mode alone passes
    every check and goes on to run."""
    argv = ["qwen3.5-9b", "--gpu-memory", "24", "--max-model-len", "32768"]
    err = _refused(argv, capsys)
    assert "0.32 refuses to start here (engines upstream), in vLLM's words: " in err
    assert "--max-num-seqs (256) exceeds available Mamba cache blocks (253)" in err
    assert no_worker == []
    ran: list[list[str]] = []

    def record(spec, variants, jobs):
        ran.append(list(variants))
        return {}

    monkeypatch.setattr(cli, "run_engines", record)
    assert cli.main([*argv, "--engines", "pooled"]) == 0
    assert ran == [["pooled"]]


#: Runs simulate's main in a fresh interpreter with the runner refusing to
#: start anything; prints the exit code.
_PROBE = """
import json, sys
from vllm_hybrid.tools.simulate import cli
def refuse(*args, **kwargs):
    raise SystemExit("an engine worker was started")
cli.run_engines = refuse
print(json.dumps({"code": cli.main(json.loads(sys.argv[1]))}))
"""


def test_an_unknown_architecture_is_one_line_without_vllms_errors(tmp_path):
    from vllm_hybrid.tools.plan.presets import PRESETS

    config = json.loads(PRESETS["llama-2-7b"].shipped_path.read_text())
    config["architectures"] = ["FooBarForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = [str(tmp_path), "--kv-cache-memory-bytes", "10G", "--weights-memory", "1G"]
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"code": 2}
    assert result.stderr.strip() == (
        "vllm-hybrid simulate: error: vLLM rejects this configuration: Model "
        "architectures ['FooBarForCausalLM'] are not supported for now."
    )


def test_the_default_run_is_a_thousand_requests_of_upstream_and_pooled():
    args, extra = cli.build_parser().parse_known_args(MODEL)
    spec = cli.spec_from_args(args, extra)
    assert spec.workload.requests == cli.DEFAULT_REQUESTS == 1000
    assert args.engines == ["upstream", "pooled"]
    everything, _ = cli.build_parser().parse_known_args([*MODEL, "--requests", "all"])
    assert cli.spec_from_args(everything).workload.requests is None
    window, _ = cli.build_parser().parse_known_args([*MODEL, "--window", "0:60"])
    assert cli.spec_from_args(window).workload.requests is None
