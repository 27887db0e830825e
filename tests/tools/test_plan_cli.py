"""``vllm-hybrid plan`` as a tool: bad input answered before vLLM is imported,
errors in the planner's own option names, the model's own max_model_len,
vLLM's warnings kept off the terminal."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from vllm_hybrid.tools import plan as planmod
from vllm_hybrid.tools.plan import cli
from vllm_hybrid.tools.plan.messages import in_planner_terms
from vllm_hybrid.tools.plan.precheck import (
    KV_BITS,
    attention_bytes_per_token,
    config_facts,
)
from vllm_hybrid.tools.plan.request import (
    GPU_BUDGET_OPTIONS,
    KV_CACHE_DTYPES,
    read_config,
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
        # 32,768 tokens x 4,096 B = 128 MiB of attention KV alone
        (
            ["{tiny}", "--kv-cache-memory", "48MiB"],
            "Raise --kv-cache-memory, or lower --max-model-len (at most "
            "12,288 tokens fit",
        ),
        (
            ["{tiny}", "--gpu-memory", "0.1", "--weights-memory", "40MiB"],
            f"Raise {GPU_BUDGET_OPTIONS}, or lower --max-model-len",
        ),
        (
            ["{tiny}", "--kv-cache-memory", "1GiB", "-tp", "3"],
            "--tensor-parallel-size 3 does not divide the model's 8 attention heads",
        ),
        (["{tiny}/missing", "--kv-cache-memory", "1GiB"], "neither a built-in preset"),
        (["{tiny}", "--kv-cache-memory", "lots"], "argument --kv-cache-memory"),
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
    ],
)
def test_bad_input_is_answered_without_importing_vllm(tiny, argv, needle):
    code, imported, err = _probe([a.format(tiny=tiny) for a in argv])
    assert code == 2
    assert err.splitlines()[-1].startswith("vllm-hybrid plan: error:")
    assert needle in err
    # neither vLLM nor torch: read config.json, nothing more
    assert imported == []
    assert "--kv-cache-memory-bytes" not in err and "gpu_memory_utilization" not in err


def test_budget_too_small_for_a_preset_needs_no_vllm():
    """A preset's config.json comes from transformers (which imports torch);
    vLLM still is not imported. Qwen3.5-35B-A3B: 10 attention layers x 2 KV
    heads x 256 x 2 x 2 B = 20,480 B per token, 5,120 MiB at its 262,144
    tokens."""
    code, imported, err = _probe(["qwen3.5-35b-a3b", "--kv-cache-memory", "1MiB"])
    assert code == 2 and "vllm" not in imported
    assert "at least 5120.00 MiB (20,480 B per token)" in err
    assert "at most 51 tokens fit" in err


# --------------------------------------------------------------------------
# errors found while planning, in the planner's terms
# --------------------------------------------------------------------------


def test_pooled_shortfall_names_the_planners_budget_options(tiny, capsys):
    """128.5 MiB passes the config.json bound (128 MiB of attention KV) but
    not the pooled plan: 2,048 token blocks of 64 KiB, one state block and
    the null blocks (CUDA, 16-token blocks)."""
    assert cli.main([str(tiny), "--kv-cache-memory", "128.5MiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "vllm-hybrid plan: error: The KV cache budget of 128.50 MiB cannot hold "
        "one request of max_model_len=32768 tokens in pooled mode (129.57 MiB "
        "needed: attention 128.00 MiB, state 0.79 MiB, null blocks 0.79 MiB). "
        "Raise --kv-cache-memory, or lower --max-model-len to 32352."
    )
    argv = [str(tiny), "--gpu-memory", "0.15", "--weights-memory", "10MiB"]
    assert cli.main([*argv, "--gpu-memory-utilization", "0.9"]) == 2
    err = capsys.readouterr().err
    assert f"Raise {GPU_BUDGET_OPTIONS}, or lower --max-model-len to " in err


def test_vllms_budget_advice_becomes_the_planners(capsys):
    """Llama-2-7B has no layer_types, so vLLM's own check answers: 32 layers
    x 2 x 32 heads x 128 x 2 B = 0.5 MiB per token; 100 MiB hold 176 tokens
    in 16-token blocks (vLLM's estimate), the model's 2,048 do not fit."""
    assert cli.main(["llama-2-7b", "--kv-cache-memory", "100MiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert "the estimated maximum model length is 176." in err
    assert err.endswith("Raise --kv-cache-memory, or lower --max-model-len.")
    assert "gpu_memory_utilization" not in err and "http" not in err


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
        "No available memory for the cache blocks. Raise --kv-cache-memory."
    )
    assert in_planner_terms("Use a smaller `max_model_len` (4096).", request) == (
        "Use a smaller --max-model-len (4096)."
    )


def test_kv_cache_dtype_choices_are_vllms():
    from vllm.config.cache import CacheDType

    assert typing.get_args(CacheDType) == KV_CACHE_DTYPES
    assert set(KV_BITS) <= set(KV_CACHE_DTYPES)


# --------------------------------------------------------------------------
# max_model_len and the config.json bound against vLLM
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
    assert config_facts(config).max_model_len == 4_096
    # an explicit value wins
    assert _plan(str(tmp_path), max_model_len=1_024).max_model_len == 1_024


def _plan(model: str, **kwargs) -> planmod.Plan:
    kwargs.setdefault("kv_cache_memory", 512 * MiB)
    return planmod.build_plan(planmod.PlanRequest(model=model, **kwargs))


@pytest.mark.parametrize("kv_cache_dtype", sorted(KV_BITS))
def test_config_bound_never_exceeds_what_vllm_stores(tiny, kv_cache_dtype):
    """The bound the pre-check rejects with is at most the attention KV per
    token both plans really use, for every dtype it knows."""
    request = planmod.PlanRequest(
        str(tiny), kv_cache_memory=512 * MiB, kv_cache_dtype=kv_cache_dtype
    )
    bound = attention_bytes_per_token(request, config_facts(read_config(tiny)))
    plan = planmod.build_plan(request)
    for mode in (plan.upstream, plan.pooled):
        exact = plan.attention_layers * mode.attention_page_bytes
        assert bound * mode.attention_block_size <= exact
    if kv_cache_dtype in ("auto", "bfloat16"):
        assert bound == 2 * 2 * 256 * 2 * 2 == 4_096  # exact for 16-bit


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "max_model_len"),
        ({"seq_length": 2048}, "max_model_len"),
        ({"sliding_window": 1024}, "attention_layers"),
        ({"layer_types": None}, "attention_layers"),
        ({"kv_lora_rank": 512}, "head_dim"),
    ],
)
def test_config_bound_stays_silent_where_vllm_reads_more(tiny, change, field):
    facts = config_facts({**read_config(tiny), **change})
    assert getattr(facts, field) is None
    request = planmod.PlanRequest(str(tiny), kv_cache_memory=MiB)
    if field != "max_model_len":
        assert attention_bytes_per_token(request, facts) is None


def test_config_facts_read_a_multimodal_configs_text_part(tiny):
    text = read_config(tiny)
    facts = config_facts(
        {"architectures": ["Outer"], "text_config": text, "max_position_embeddings": 1}
    )
    assert (facts.architecture, facts.max_model_len) == ("Outer", 32_768)
    assert (facts.attention_layers, facts.kv_heads, facts.head_dim) == (2, 2, 256)


# --------------------------------------------------------------------------
# vLLM's warnings
# --------------------------------------------------------------------------


def test_logs_are_quiet_while_planning_and_restored_after(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    vllm_logger = logging.getLogger("vllm")
    before = vllm_logger.level
    with cli._quiet_vllm_logs():
        assert not vllm_logger.isEnabledFor(logging.WARNING)
        assert vllm_logger.isEnabledFor(logging.ERROR)
        assert not logging.getLogger("transformers").isEnabledFor(logging.WARNING)
    assert vllm_logger.level == before
    # a level the user asks for wins
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "info")
    with cli._quiet_vllm_logs():
        assert vllm_logger.isEnabledFor(logging.INFO)


def test_a_plan_prints_no_warnings(tiny):
    """A fresh process, as a user runs it: the plan on stdout, nothing from
    vLLM, Triton or transformers on stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "vllm_hybrid.cli", "plan", str(tiny)]
        + ["--kv-cache-memory", "256MiB"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "max_model_len 32,768" in result.stdout
    assert result.stderr == ""
