"""``vllm-hybrid plan`` without engines: presets, CUDA formula, CLI, JSON, PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_hybrid.tools import plan as planmod
from vllm_hybrid.tools.plan import PRESETS

MiB = 2**20
GiB = 2**30


def _plan(model: str, **kwargs) -> planmod.Plan:
    kwargs.setdefault("kv_cache_memory", 8 * GiB)
    return planmod.build_plan(planmod.PlanRequest(model=model, **kwargs))


# --------------------------------------------------------------------------
# sizes and presets
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("48MiB", 48 * MiB),
        ("10GiB", 10 * GiB),
        # one-letter suffixes as vLLM's --kv-cache-memory-bytes reads them
        ("30G", 30 * GiB),
        ("25.6g", 25_600_000_000),
        ("1.5GB", 1_500_000_000),
        ("123", 123),
        ("2 kib", 2048),
    ],
)
def test_parse_size(text, expected):
    assert planmod.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "12XB", "-5MiB", "0"])
def test_parse_size_rejects_garbage(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        planmod.parse_size(text)


#: Shape facts of each hybrid preset's published config.json: layers,
#: attention layers, KV heads, head size, state dtype, context length.
PRESET_SHAPES = {
    "qwen3.6-35b-a3b-fp8": (40, 10, 2, 256, "float32", 262144),
    "qwen3.5-35b-a3b": (40, 10, 2, 256, "float32", 262144),
    "qwen3.5-27b": (64, 16, 4, 256, "float32", 262144),
    "qwen3.5-9b": (32, 8, 4, 256, "float32", 262144),
    "qwen3-next-80b-a3b": (48, 12, 2, 256, None, 262144),
    "nemotron-3-nano-30b-a3b": (52, 6, 2, 128, "float32", 262144),
    "granite-4.0-h-small": (40, 4, 8, 128, None, 131072),
    "jamba-v0.1": (32, 4, 8, 128, None, 262144),
}


@pytest.mark.parametrize("name", sorted(PRESET_SHAPES))
def test_presets_are_the_shapes_they_name(name, tmp_path):
    data = json.loads(
        (PRESETS[name].write_config(tmp_path) / "config.json").read_text()
    )
    layers, attention, kv_heads, head, state_dtype, length = PRESET_SHAPES[name]
    types = data.get("layer_types") or data.get("layers_block_type")
    if types is None:  # Jamba: one attention layer every attn_layer_period
        types = [
            "attention"
            if i % data["attn_layer_period"] == data["attn_layer_offset"]
            else "mamba"
            for i in range(data["num_hidden_layers"])
        ]
    assert len(types) == layers
    assert sum(t in ("attention", "full_attention") for t in types) == attention
    assert data["num_key_value_heads"] == kv_heads
    assert (
        data.get("head_dim", data["hidden_size"] // data["num_attention_heads"]) == head
    )
    state = data.get("mamba_ssm_dtype") or data.get("mamba_ssm_cache_dtype")
    assert state == state_dtype
    assert data["max_position_embeddings"] == length
    assert PRESETS[name].kind == "hybrid"


def test_the_flagship_preset_is_the_fp8_checkpoint():
    preset = PRESETS["qwen3.6-35b-a3b-fp8"]
    assert preset.checkpoint == "Qwen/Qwen3.6-35B-A3B-FP8"
    assert preset.weights_bytes == 35 * GiB
    data = json.loads(preset.shipped_path.read_text())
    assert data["quantization_config"]["quant_method"] == "fp8"
    assert data["quantization_config"]["weight_block_size"] == [128, 128]
    assert {p.kind for p in PRESETS.values()} == {"hybrid", "dense"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_shipped_preset_config_is_the_config_class_defaults(name, tmp_path):
    """The packaged ``config.json`` (read without importing transformers) is
    what the installed transformers' config class gives; after a transformers
    upgrade that changes a default, this fails until the files are rewritten
    (``presets.regenerate()``)."""
    preset = PRESETS[name]
    written = json.loads((preset.write_config(tmp_path) / "config.json").read_text())
    assert written == json.loads(preset.config_text())
    assert written["architectures"] == [preset.architecture]


def test_preset_bad_input_is_answered_without_transformers_or_vllm():
    code = (
        "import sys\n"
        "from vllm_hybrid.tools.plan.cli import main\n"
        "rc = main(['qwen3.5-35b-a3b', '--kv-cache-memory-bytes', '1G', '-tp', '3'])\n"
        "print(rc, sorted(m for m in ('transformers', 'vllm', 'torch') "
        "if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.strip().splitlines()[-1] == "2 []"
    assert "--tensor-parallel-size 3 does not divide" in proc.stderr


# --------------------------------------------------------------------------
# Qwen3.5-35B-A3B on CUDA against vLLM 0.32's own formula
# --------------------------------------------------------------------------


def _upstream_cuda_block(tp: int, kv_cache_dtype: str) -> tuple[int, int, int]:
    """Attention block, attention page per token and state page, from
    upstream's align function run on a plain CUDA-like config."""
    import copy

    from vllm.config.cache import CacheConfig
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    request = planmod.PlanRequest(
        "qwen3.5-35b-a3b",
        kv_cache_memory=8 * GiB,
        device="cuda",
        tensor_parallel_size=tp,
        kv_cache_dtype=kv_cache_dtype,
    )
    with planmod.model_dir(request.model) as (directory, _):
        config, _ = planmod.engine_config(request, directory)
    config = copy.deepcopy(config)
    cache = config.cache_config
    cache.block_size = CacheConfig.DEFAULT_BLOCK_SIZE
    # the checkpoint asks for fp32 state (Qwen3.5's config hook on CUDA)
    cache.mamba_ssm_cache_dtype = "float32"
    cache.mamba_page_size_padded = None
    backend = (
        AttentionBackendEnum.TURBOQUANT
        if kv_cache_dtype.startswith("turboquant")
        else AttentionBackendEnum.FLASH_ATTN
    ).get_class()

    class CudaLike(Platform):
        @classmethod
        def _find_non_ssm_backends(cls, vllm_config):
            return [backend]

    with planmod.overlay_off():
        planmod.upstream_align().__func__(CudaLike, config, backend)
    per_token = backend.customize_spec(
        FullAttentionSpec(
            block_size=1,
            num_kv_heads=config.model_config.get_num_kv_heads(config.parallel_config),
            head_size=config.model_config.get_head_size(),
            dtype=planmod.kv_torch_dtype(config),
            kv_quant_mode=get_kv_quant_mode(cache.cache_dtype),
        )
    ).page_size_bytes
    return cache.block_size, per_token, cache.mamba_page_size_padded


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "turboquant_k8v4"])
def test_qwen3_5_cuda_block_and_padding_match_upstream(tp, kv_cache_dtype):
    plan = _plan(
        "qwen3.5-35b-a3b",
        device="cuda",
        tensor_parallel_size=tp,
        kv_cache_dtype=kv_cache_dtype,
    )
    block, per_token, padded = _upstream_cuda_block(tp, kv_cache_dtype)
    up = plan.upstream
    assert up.error is None
    assert up.attention_block_size == block > 16
    assert up.attention_page_bytes == block * per_token
    assert up.state_page_padded_bytes == padded == block * per_token
    real = up.state_page_bytes
    assert up.state_padding_bytes == padded - real
    assert up.state_padding_pct == pytest.approx(100 * (padded - real) / real)
    # pooled mode: natural CUDA block, unpadded state
    assert plan.pooled.attention_block_size == 16
    assert plan.pooled.attention_page_bytes == 16 * per_token
    assert plan.pooled.state_padding_bytes == 0
    assert (plan.attention_layers, plan.state_layers) == (10, 30)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_ssm_state_dtype_option_sets_the_state_page(device):
    """Qwen3-Next-80B's GDN layer at TP 1: a 4 x 3 x 4,096 conv state (bf16)
    plus a 32 x 128 x 128 SSM state in the dtype asked for, on either device
    and on any host (the CPU platform forces float32 on AVX512-BF16 CPUs
    only when the option is left at auto)."""
    conv = 3 * (2 * 16 * 128 + 32 * 128) * 2
    pages = {
        dtype: _plan(
            "qwen3-next-80b-a3b", device=device, mamba_ssm_cache_dtype=dtype
        ).pooled.state_page_bytes
        for dtype in ("float32", "bfloat16")
    }
    ssm = 32 * 128 * 128
    assert pages == {"float32": conv + 4 * ssm, "bfloat16": conv + 2 * ssm}


def test_turboquant_k8v4_natural_page_is_12416_bytes_at_tp1():
    plan = _plan("qwen3.5-35b-a3b", device="cuda", kv_cache_dtype="turboquant_k8v4")
    assert plan.pooled.attention_block_size == 16
    assert plan.pooled.attention_page_bytes == 12_416


#: Text config of a Qwen3.6-35B-A3B-shaped checkpoint (the shape of the
#: qwen3.5-35b-a3b preset) that asks for fp32 SSM state, as the published
#: Qwen3.5/3.6 configs do.
QWEN3_6_TEXT = {
    "model_type": "qwen3_5_moe_text",
    "dtype": "bfloat16",
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_value_head_dim": 128,
    "linear_num_value_heads": 32,
    "max_position_embeddings": 32768,
    "vocab_size": 248320,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "mamba_ssm_dtype": "float32",
}


def _qwen3_6_config(form: str) -> dict:
    if form == "causal_lm":
        return {"architectures": ["Qwen3_5MoeForCausalLM"], **QWEN3_6_TEXT}
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "dtype": "bfloat16",
        "text_config": QWEN3_6_TEXT,
        "vision_config": {"depth": 2, "hidden_size": 64, "out_hidden_size": 2048},
    }


@pytest.mark.parametrize("form", ["causal_lm", "conditional_generation"])
def test_cuda_plan_uses_the_checkpoints_fp32_ssm_state(form, tmp_path):
    """A CUDA host running vLLM 0.32 takes ``mamba_ssm_dtype`` from the
    checkpoint (Qwen3.5's config hook), also where Qwen3-Next's class stands
    in for the Qwen3.5 one here.

    Expected figures, from vLLM 0.32's CUDA path at TP 1:

    * TurboQuant k8v4 slot per KV head and token: 256 B fp8 keys + 128 B
      4-bit values + 4 B scale/zero = 388 B; 2 KV heads: 776 B per token.
    * GDN state page: conv 3 x (2 x 16 x 128 + 32 x 128) bf16 = 49,152 B plus
      SSM 32 x 128 x 128 fp32 = 2,097,152 B: 2,146,304 B.
    * ``_align_hybrid_block_size``: kernel alignment 16 (TurboQuant's smallest
      kernel block, the default block 16), block = 16 x ceil(2,146,304 /
      (16 x 776)) = 16 x 173 = 2,768 tokens; attention page 2,768 x 776 =
      2,147,968 B; the state page is padded to it: 1,664 B (0.078%).
    * pooled mode: block 16, page 16 x 776 = 12,416 B, state unpadded.
    """
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    (tmp_path / "config.json").write_text(json.dumps(_qwen3_6_config(form)))
    plan = _plan(
        str(tmp_path),
        kv_cache_memory=10 * GiB,
        device="cuda",
        kv_cache_dtype="turboquant_k8v4",
    )
    up, pooled = plan.upstream, plan.pooled
    assert up.error is None and pooled.error is None
    assert (plan.attention_layers, plan.state_layers) == (10, 30)
    assert up.state_page_bytes == pooled.state_page_bytes == 2_146_304
    assert up.attention_block_size == 2_768
    assert up.attention_page_bytes == up.state_page_padded_bytes == 2_147_968
    assert up.state_padding_bytes == 1_664
    assert up.state_padding_pct == pytest.approx(100 * 1_664 / 2_146_304)
    assert pooled.attention_block_size == 16
    assert pooled.attention_page_bytes == 12_416
    assert pooled.state_padding_bytes == 0
    # the checkpoint's hook is lent to the stand-in only while vLLM runs it
    assert "Qwen3NextForCausalLM" not in MODELS_CONFIG_MAP


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "turboquant_k8v4"])
@pytest.mark.parametrize("name", ["qwen3.6-35b-a3b-fp8", "qwen3-next-80b-a3b"])
def test_both_columns_fit_their_budget(name, kv_cache_dtype):
    """Concurrency x bytes per request never exceeds the budget, in either
    column, at every length; pooled mode never pays more bytes per token of
    attention KV than upstream for the same dtype."""
    budget = 6 * GiB
    plan = _plan(
        name,
        device="cuda",
        kv_cache_memory=budget,
        max_model_len=32768,
        kv_cache_dtype=kv_cache_dtype,
    )
    for mode in (plan.upstream, plan.pooled):
        assert mode.error is None
        for n in plan.prompt_lens:
            at = mode.at_prompt_len[n]
            assert at["max_concurrency"] * at["bytes_per_request"] <= budget
    up, pooled = plan.upstream, plan.pooled
    pooled_per_token = pooled.pools[0]["block_bytes"] / pooled.attention_block_size
    up_per_token = up.attention_page_bytes * plan.attention_layers
    assert pooled_per_token * up.attention_block_size <= up_per_token


def test_dense_control_pooled_equals_upstream():
    plan = _plan("llama-2-7b", device="cuda", kv_cache_memory=4 * GiB)
    assert not plan.hybrid
    assert plan.upstream.attention_block_size == 16
    # 32 layers x 2 (K, V) x 32 heads x 128 x 2 bytes x 16 tokens
    assert plan.upstream.attention_page_bytes == 2 * 32 * 128 * 2 * 16
    assert plan.upstream.num_blocks == 4 * GiB // (32 * 2 * 32 * 128 * 2 * 16)
    assert plan.pooled.num_blocks == plan.upstream.num_blocks
    assert plan.pooled.token_capacity == plan.upstream.token_capacity
    assert "does not apply" in plan.pooled.note


# --------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_hybrid.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_help_documents_every_option():
    parser = planmod.build_parser()
    text = parser.format_help()
    for action in parser._actions:
        for option in action.option_strings:
            assert option in text
        if action.option_strings:
            assert action.help, action.option_strings
    for option in (
        "--kv-cache-dtype",
        "--tensor-parallel-size",
        "-tp",
        "--kv-cache-memory-bytes",
        "--kv-cache-memory",
        "--gpu-memory",
        "--gpu-memory-utilization",
        "--weights-memory",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--prefix-caching",
        "--no-prefix-caching",
        "--mamba-cache-mode",
        "--mamba-block-size",
        "--mamba-ssm-cache-dtype",
        "--additional-config",
        "--device",
        "--prompt-lens",
        "--json",
        "--plot",
        "--list-presets",
    ):
        assert option in text, option


def test_list_presets(capsys):
    assert planmod.main(["--list-presets"]) == 0
    out = capsys.readouterr().out
    for preset in PRESETS.values():
        assert preset.name in out and preset.checkpoint in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["no-such-preset", "--kv-cache-memory", "1GiB"], "is not a built-in preset"),
        (["llama-2-7b", "--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["llama-2-7b"], "--kv-cache-memory-bytes SIZE or --gpu-memory"),
        (["llama-2-7b", "--gpu-memory", "8"], "--weights-memory"),
        (
            ["qwen3.5-35b-a3b", "--kv-cache-memory", "1GiB", "-tp", "3"],
            "--tensor-parallel-size 3 does not divide",
        ),
        (["qwen3.5-35b-a3b", "--kv-cache-memory", "1MiB"], "cannot hold one request"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_info:
        code = planmod.main(argv)
        raise SystemExit(code)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("vllm-hybrid plan: error:")
    assert needle in err[-1]


def test_non_hybrid_attention_free_model_is_rejected(tmp_path, capsys):
    import transformers

    config = transformers.Mamba2Config(num_hidden_layers=2).to_dict()
    config["architectures"] = ["Mamba2ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert planmod.main([str(tmp_path), "--kv-cache-memory", "1GiB"]) == 2
    assert "no attention layers" in capsys.readouterr().err


def test_json_and_png_from_the_command(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    result = _cli(
        "qwen3.5-35b-a3b",
        "--kv-cache-memory",
        "6GiB",
        "--max-model-len",
        "32768",
        "--prompt-lens",
        "1024,4096",
        "--json",
        "--plot",
        str(png),
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["preset"] == "qwen3.5-35b-a3b"
    assert data["prompt_lens"] == [1024, 4096, 32768]
    assert data["device"] == "cuda" and data["max_model_len"] == 32768
    for mode in ("upstream", "pooled"):
        figures = data[mode]
        assert figures["error"] is None
        assert set(figures["at_prompt_len"]) == {"1024", "4096", "32768"}
        for entry in figures["at_prompt_len"].values():
            assert entry["max_concurrency"] > 0 and entry["bytes_per_request"] > 0
        assert figures["token_capacity"] > 0 and figures["num_blocks"] > 0
    assert [p["kind"] for p in data["pooled"]["pools"]] == ["token", "state"]
    assert data["upstream"]["pools"][0]["kind"] == "shared"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 5000


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path, capsys):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    code = planmod.main(
        ["llama-2-7b", "--kv-cache-memory", "4GiB", "--plot", str(tmp_path / "x.png")]
    )
    assert code == 2
    assert "pip install vllm-hybrid[plot]" in capsys.readouterr().err


def test_table_has_both_columns(capsys):
    argv = ["qwen3-next-80b-a3b", "--kv-cache-memory", "4GiB"]
    assert planmod.main([*argv, "--max-model-len", "32768"]) == 0
    out = capsys.readouterr().out
    assert "upstream vLLM 0.32" in out and "vllm-hybrid pooled" in out
    assert "state padding" in out and "concurrency @ 8,192 tokens" in out


def test_gpu_memory_budget():
    assert planmod.kv_budget_from_gpu(24, 0.9, 8 * GiB, 2) == int(24 * GiB * 0.9) - (
        4 * GiB
    )
    with pytest.raises(planmod.PlanError):
        planmod.kv_budget_from_gpu(8, 0.5, 70 * GiB, 1)


def test_cpu_turboquant_upstream_is_not_possible_pooled_uses_packed_slot():
    from vllm.model_executor.layers.quantization.turboquant.config import (
        TurboQuantConfig,
    )

    plan = _plan("qwen3-next-80b-a3b", device="cpu", kv_cache_dtype="turboquant_k8v4")
    assert "TurboQuant" in plan.upstream.error
    slot = TurboQuantConfig.from_cache_dtype("turboquant_k8v4", 256).slot_size_aligned
    block = plan.pooled.attention_block_size
    assert block == 128
    assert plan.pooled.attention_page_bytes == block * 2 * slot


def test_cli_entry_point_is_registered():
    from vllm_hybrid import cli

    assert cli.OWN_SUBCOMMANDS["plan"] == "vllm_hybrid.tools.plan"
    assert Path(planmod.__file__).parent.name == "plan"
    assert cli.main(["plan", "--list-presets"]) == 0
