"""``vllm-hybrid plan`` as a vLLM user runs it: MODEL as ``vllm serve`` takes
it, vLLM's option names, a ``vllm serve`` line's flags pasted after MODEL,
bad input answered before vLLM is imported where ``config.json`` settles it,
one max_model_len limit computed by the engines' own planning, vLLM's
warnings kept off the terminal."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from vllm_hybrid.tools import plan as planmod
from vllm_hybrid.tools.plan import cli
from vllm_hybrid.tools.plan.errors import shortened
from vllm_hybrid.tools.plan.messages import in_planner_terms, with_flag_names
from vllm_hybrid.tools.plan.models import resolve_model
from vllm_hybrid.tools.plan.request import (
    GPU_BUDGET_OPTIONS,
    KV_CACHE_DTYPES,
    MAMBA_CACHE_MODES,
    MAMBA_DTYPES,
    read_config,
)
from vllm_hybrid.tools.plan.serve_flags import (
    IGNORED_SERVE_OPTIONS,
    check_serve_flags,
    serve_parser,
)

MiB = 2**20

#: Runs the planner's main in a fresh interpreter and reports the exit code
#: and which heavy packages the run imported.
_PROBE = """
import json, sys
from vllm_hybrid.tools.plan.cli import main
try:
    code = main(json.loads(sys.argv[1]))
except SystemExit as exc:
    code = exc.code
heavy = ("vllm", "torch", "transformers")
print(json.dumps({"code": code, "imported": [m for m in heavy if m in sys.modules]}))
"""


def _probe(argv: list[str]) -> tuple[int, list[str], str]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report["code"], report["imported"], result.stderr.strip()


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Path:
    """The tiny qwen3_5: 2 attention layers of 2 KV heads x 256, bf16, and
    max_position_embeddings 32,768: 4,096 B of attention KV per token."""
    return tiny_model_dir("qwen3_5")


# --------------------------------------------------------------------------
# answered before vLLM is imported
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["{tiny}", "--kv-cache-memory-bytes", "1GiB", "-tp", "3"],
            "--tensor-parallel-size 3 does not divide the model's 8 attention heads",
        ),
        (["{tiny}/missing", "--kv-cache-memory", "1GiB"], "is not a built-in preset"),
        (["{tiny}", "--kv-cache-memory-bytes", "lots"], "--kv-cache-memory-bytes"),
        (
            ["{tiny}", "--kv-cache-memory", "1GiB", "--kv-cache-dtype", "fp9"],
            "argument --kv-cache-dtype: invalid choice: 'fp9'",
        ),
        (
            ["{tiny}", "--gpu-memory", "8", "--weights-memory", "70GiB"],
            "leaves no KV cache memory",
        ),
        (
            ["{tiny}", "--kv-cache-memory", "1GiB", "--plot", "{tiny}/no/x.png"],
            "does not exist",
        ),
        (
            ["{tiny}", "--kv-cache-memory", "1G", "--additional-config", "{{nope"],
            "argument --additional-config: not JSON",
        ),
        (
            ["{tiny}", "--kv-cache-memory", "1G", "--mamba-cache-mode", "most"],
            "argument --mamba-cache-mode: invalid choice: 'most'",
        ),
        # the unknown model is named first, not the option it would need
        (["qwen3.6-35b", "--gpu-memory", "80"], "did you mean qwen3.6-35b-a3b-fp8"),
    ],
)
def test_bad_input_is_answered_without_importing_vllm(tiny, argv, needle):
    code, imported, err = _probe([a.format(tiny=tiny) for a in argv])
    assert code == 2
    assert len(err.splitlines()) == 1
    assert err.startswith("vllm-hybrid plan: error:")
    assert needle in err
    # neither vLLM nor torch: read config.json, nothing more
    assert imported == []


def test_additional_config_is_checked_as_the_engine_checks_it(tiny, capsys):
    argv = [str(tiny), "--kv-cache-memory", "1G", "--additional-config"]
    assert cli.main([*argv, '{"hybrid_kv": {"pooled": "maybe"}}']) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vllm-hybrid plan: error: --additional-config: ")
    assert "pooled" in err


# --------------------------------------------------------------------------
# MODEL as vllm serve takes it
# --------------------------------------------------------------------------


def test_a_checkpoint_id_is_its_preset_and_the_serve_line_names_it(capsys):
    """``plan Qwen/Qwen3.6-35B-A3B-FP8`` (offline, no cache) is the preset's
    plan; the line it prints is the one it planned for."""
    argv = ["--gpu-memory", "80", "--gpu-memory-utilization", "0.9"]
    argv += ["--kv-cache-dtype", "turboquant_k8v4", "--json"]
    assert cli.main(["Qwen/Qwen3.6-35B-A3B-FP8", *argv]) == 0
    by_id = json.loads(capsys.readouterr().out)
    assert cli.main(["qwen3.6-35b-a3b-fp8", *argv]) == 0
    by_name = json.loads(capsys.readouterr().out)
    assert by_id["serve_command"] == (
        "vllm serve Qwen/Qwen3.6-35B-A3B-FP8 --kv-cache-dtype turboquant_k8v4 "
        "--gpu-memory-utilization 0.9"
    )
    assert by_id == by_name
    # 80 GiB x 0.9 - 35 GiB of FP8 weights
    assert by_id["kv_cache_memory"] == int(80 * 2**30 * 0.9) - 35 * 2**30
    assert cli.main(["Qwen/Qwen3.6-35B-A3B-FP8", *argv[:-1]]) == 0
    out = capsys.readouterr().out
    assert "planned for: vllm serve Qwen/Qwen3.6-35B-A3B-FP8 --kv-cache-dtype" in out


def test_a_hugging_face_id_is_read_from_the_local_cache(tiny, tmp_path, monkeypatch):
    """An id in the hub cache resolves to its snapshot; nothing is fetched."""
    snapshot = tmp_path / "models--acme--tiny-hybrid" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((tiny / "config.json").read_text())
    refs = tmp_path / "models--acme--tiny-hybrid" / "refs"
    refs.mkdir()
    (refs / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    resolved = resolve_model("acme/tiny-hybrid")
    assert Path(resolved.source) == snapshot
    assert resolved.serve_name == "acme/tiny-hybrid" and resolved.preset is None
    with pytest.raises(planmod.PlanError, match="not a built-in preset"):
        resolve_model("acme/not-cached")


def test_presets_resolve_by_name_and_by_checkpoint_id():
    by_name = resolve_model("nemotron-3-nano-30b-a3b")
    by_id = resolve_model("nvidia/nvidia-nemotron-3-nano-30b-a3b-bf16")
    assert by_name.source == by_id.source == "nemotron-3-nano-30b-a3b"
    assert by_name.serve_name == "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"


# --------------------------------------------------------------------------
# vLLM's option names, and a vllm serve line pasted after MODEL
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vllm_name", "alias", "value", "dest", "expected"),
    [
        (
            "--kv-cache-memory-bytes",
            "--kv-cache-memory",
            "30G",
            "kv_cache_memory",
            30 * 2**30,
        ),
        ("--enable-prefix-caching", "--prefix-caching", None, "prefix_caching", True),
        (
            "--no-enable-prefix-caching",
            "--no-prefix-caching",
            None,
            "prefix_caching",
            False,
        ),
    ],
)
def test_vllms_names_and_the_earlier_ones_set_the_same_option(
    vllm_name, alias, value, dest, expected
):
    parser = cli.build_parser()
    for name in (vllm_name, alias):
        argv = ["m", name] + ([value] if value is not None else [])
        assert getattr(parser.parse_args(argv), dest) == expected


def test_pasted_serve_flags_are_accepted_or_refused_by_name(capsys):
    """Flags that change nothing planned are accepted, named in a note and
    kept in the printed line; one the planner does not model, one vLLM does
    not know and a bad value are refused, each by name."""
    argv = ["qwen3.6-35b-a3b-fp8", "--gpu-memory", "80", "--max-model-len", "32768"]
    pasted = ["--port", "8001", "--trust-remote-code", "--served-model-name", "q"]
    assert cli.main([*argv, *pasted]) == 0
    out = capsys.readouterr().out
    assert (
        "planned for: vllm serve Qwen/Qwen3.6-35B-A3B-FP8 --max-model-len 32768 "
        "--port 8001 --trust-remote-code --served-model-name q"
    ) in out
    assert (
        "note: vllm serve flags that change nothing planned: --port, "
        "--trust-remote-code, --served-model-name"
    ) in out
    for flag, needle in [
        (["--enforce-eager"], "--enforce-eager: a vllm serve option that plan does"),
        (["--enforce-eagr"], "--enforce-eagr: not an option of vllm serve"),
        (["--port", "abc"], "argument --port: invalid int value: 'abc'"),
        (["--speculative-config", "{}"], "--speculative-config: a vllm serve option"),
    ]:
        assert cli.main([*argv, *flag]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err


def test_ignored_serve_options_are_options_of_the_installed_vllm():
    parser = serve_parser()
    dests = {a.dest for a in parser._actions}
    assert dests >= IGNORED_SERVE_OPTIONS
    # every option the planner itself takes is one of vllm serve's, but for
    # the ones that only say what the planner plans for
    own = {a.dest for a in cli.build_parser()._actions}
    planner_only = {
        "help",
        "model",
        "gpu_memory",
        "weights_memory",
        "device",
        "prompt_lens",
        "json",
        "plot",
        "list_presets",
        "where_it_pays",
        "kv_cache_memory",
        "prefix_caching",
    }
    assert own - planner_only <= dests
    assert {"kv_cache_memory_bytes", "enable_prefix_caching"} <= dests
    assert check_serve_flags([], "plan") == []


def test_kv_cache_dtype_and_mamba_choices_are_vllms():
    from vllm.config.cache import CacheDType, MambaCacheMode, MambaDType

    assert typing.get_args(CacheDType) == KV_CACHE_DTYPES
    assert set(typing.get_args(MambaCacheMode)) == set(MAMBA_CACHE_MODES)
    assert set(typing.get_args(MambaDType)) == set(MAMBA_DTYPES)


# --------------------------------------------------------------------------
# one max_model_len limit: each engine's own planning
# --------------------------------------------------------------------------


def _limits(err: str) -> tuple[int, int, int]:
    """(upstream's limit, pooled mode's, the one advised) of the message."""
    numbers = re.search(
        r"upstream vLLM 0\.32 ([\d,]+) and pooled mode ([\d,]+)\. .*lower "
        r"--max-model-len to ([\d,]+)\.",
        err,
    )
    assert numbers is not None, err
    return tuple(int(n.replace(",", "")) for n in numbers.groups())


def test_the_max_model_len_limit_is_each_engines_own_and_one_number(tiny):
    """48 MiB cannot hold the tiny model's 32,768 tokens. The message's two
    limits are exact for each engine's own planning (one token more fails
    that mode, at the limit it plans), and the one number advised is the
    longest both hold."""
    request = planmod.PlanRequest(str(tiny), kv_cache_memory=48 * MiB)
    with pytest.raises(planmod.PlanError) as exc:
        planmod.build_plan(request)
    upstream, pooled, advised = _limits(str(exc.value))
    assert advised == min(upstream, pooled) == upstream == 11_680
    assert pooled == 11_840
    at_limit = planmod.build_plan(_with(request, max_model_len=upstream))
    assert at_limit.upstream.error is None
    past = planmod.build_plan(_with(request, max_model_len=upstream + 1))
    assert past.pooled.error is None and past.upstream.fits_max_model_len == upstream
    assert past.upstream.error.startswith(f"holds at most {upstream:,} tokens")
    assert planmod.build_plan(_with(request, max_model_len=pooled)).pooled.error is None
    with pytest.raises(planmod.PlanError) as past_pooled:
        planmod.build_plan(_with(request, max_model_len=pooled + 1))
    assert _limits(str(past_pooled.value)) == (upstream, pooled, upstream)
    # a budget of vLLM's names: the advice names the option that sets it
    assert f"Raise {request.budget_options}, or lower" in str(exc.value)


def _with(request, **changes):
    import dataclasses

    return dataclasses.replace(request, **changes)


def test_a_single_engine_without_room_is_noted_with_the_one_number(tiny, capsys):
    """Between the two limits upstream has no room and pooled mode has: the
    plan is printed, the note gives upstream's limit."""
    argv = [str(tiny), "--kv-cache-memory-bytes", "48MiB", "--max-model-len", "11800"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "not possible: holds at most 11,680 tokens per request" in out
    assert "lower --max-model-len to 11,680." in out


def test_a_gpu_budget_names_the_gpu_options(tiny, capsys):
    argv = [str(tiny), "--gpu-memory", "0.15", "--weights-memory", "10MiB"]
    assert cli.main([*argv, "--gpu-memory-utilization", "0.9"]) == 2
    err = capsys.readouterr().err
    assert f"Raise {GPU_BUDGET_OPTIONS}, or lower --max-model-len to " in err


def test_a_dense_models_limit_is_vllms_own_estimate(capsys):
    """Llama-2-7B: 32 layers x 2 x 32 heads x 128 x 2 B = 0.5 MiB per token;
    100 MiB less the null block hold 176 tokens in 16-token blocks, vLLM's
    own estimate; pooled mode does not apply, so one limit is named."""
    assert cli.main(["llama-2-7b", "--kv-cache-memory-bytes", "100MiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "own planning: upstream vLLM 0.32 176." in err
    assert err.endswith(
        "Raise --kv-cache-memory-bytes, or lower --max-model-len to 176."
    )
    assert "pooled" not in err and "http" not in err


# --------------------------------------------------------------------------
# vLLM's messages, in the tools' terms
# --------------------------------------------------------------------------


def test_in_planner_terms_keeps_vllms_facts_and_replaces_its_advice():
    request = planmod.PlanRequest("m", kv_cache_memory=MiB)
    text = (
        "No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine (this flag also "
        "controls CPU memory reservation on the CPU backend, despite its name). "
        "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ "
        "for more details."
    )
    assert in_planner_terms(text, request) == (
        "No available memory for the cache blocks. Raise --kv-cache-memory-bytes."
    )
    assert in_planner_terms("Use a smaller `max_model_len` (4096).", request) == (
        "Use a smaller --max-model-len (4096)."
    )
    assert with_flag_names("lower max_num_seqs or raise gpu_memory_utilization") == (
        "lower --max-num-seqs or raise --gpu-memory-utilization"
    )


def test_long_messages_are_cut_at_a_sentence_or_a_word():
    vllm_message = (
        "Model architectures ['FooForCausalLM'] are not supported for now. "
        "Supported architectures: dict_keys(['" + "', '".join(["Arch"] * 200) + "'])"
    )
    assert shortened(vllm_message) == (
        "Model architectures ['FooForCausalLM'] are not supported for now."
    )
    one_sentence = "word " * 200
    cut = shortened(one_sentence, 50)
    assert cut.endswith(" ...") and len(cut) <= 50
    assert all(w == "word" for w in cut[: -len(" ...")].split())


def test_an_unknown_architecture_is_one_line(tmp_path, tiny, capsys):
    config = read_config(tiny)
    config["architectures"] = ["FooBarForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli.main([str(tmp_path), "--kv-cache-memory-bytes", "1G"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "vllm-hybrid plan: error: vLLM rejects this configuration: Model "
        "architectures ['FooBarForCausalLM'] are not supported for now."
    )


# --------------------------------------------------------------------------
# max_model_len, vLLM's warnings
# --------------------------------------------------------------------------


def test_default_max_model_len_is_the_models(tiny, tmp_path):
    config = read_config(tiny)
    assert config["max_position_embeddings"] == 32_768
    assert _plan(str(tiny)).max_model_len == 32_768
    config["max_position_embeddings"] = 4_096
    (tmp_path / "config.json").write_text(json.dumps(config))
    plan = _plan(str(tmp_path))
    assert plan.max_model_len == 4_096
    assert plan.prompt_lens == [512, 2_048, 4_096, 8_192]
    # an explicit value wins
    assert _plan(str(tmp_path), max_model_len=1_024).max_model_len == 1_024


def _plan(model: str, **kwargs) -> planmod.Plan:
    kwargs.setdefault("kv_cache_memory", 512 * MiB)
    return planmod.build_plan(planmod.PlanRequest(model=model, **kwargs))


def test_logs_are_quiet_while_planning_and_restored_after(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    vllm_logger = logging.getLogger("vllm")
    before = vllm_logger.level
    with cli.quiet_vllm_logs():
        assert not vllm_logger.isEnabledFor(logging.WARNING)
        assert vllm_logger.isEnabledFor(logging.ERROR)
        assert not logging.getLogger("transformers").isEnabledFor(logging.WARNING)
    assert vllm_logger.level == before
    # a level the user asks for wins
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "info")
    with cli.quiet_vllm_logs():
        assert vllm_logger.isEnabledFor(logging.INFO)


def test_a_plan_prints_no_warnings(tiny):
    """A fresh process, as a user runs it: the plan on stdout, nothing from
    vLLM, Triton or transformers on stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "vllm_hybrid.cli", "plan", str(tiny)]
        + ["--kv-cache-memory-bytes", "256MiB"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "max_model_len 32,768" in result.stdout
    assert result.stderr == ""
