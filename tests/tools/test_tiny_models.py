"""Fast checks of the tiny model builder (no vLLM engine is started).

The benchmarks and engine tests trust these directories to have the shapes
that matter for hybrid KV-cache planning (layer mix, head dims, KV heads), to
be bf16 and to be bit-reproducible, so those properties are pinned here.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm_hybrid.tools import tiny_models, tiny_tokenizer  # noqa: E402
from vllm_hybrid.tools.tiny_models import KINDS, build_tiny_model  # noqa: E402


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _digests(path: Path) -> dict[str, str]:
    """sha256 of every file in a build directory, keyed by file name."""
    return {
        entry.name: hashlib.sha256(entry.read_bytes()).hexdigest()
        for entry in sorted(path.iterdir())
        if entry.is_file()
    }


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One build per kind, shared by the read-only tests of this module."""
    root = tmp_path_factory.mktemp("tiny")
    return {kind: build_tiny_model(root / kind, kind, seed=0) for kind in KINDS}


def test_files_readable_by_other_users(builds: dict[str, Path]) -> None:
    import os

    umask = os.umask(0)
    os.umask(umask)
    path = builds["qwen3_5"]
    assert path.stat().st_mode & 0o777 == 0o777 & ~umask
    modes = {f.name: f.stat().st_mode & 0o777 for f in path.iterdir()}
    assert modes["model.safetensors"] == 0o666 & ~umask
    assert set(modes.values()) == {0o666 & ~umask}


def test_kinds_are_the_documented_ones() -> None:
    assert set(KINDS) == {"qwen3_next", "qwen3_5", "qwen3_6", "nemotron_h", "dense"}


@pytest.mark.parametrize("kind", KINDS)
def test_build_is_complete_bf16_and_long_context(
    builds: dict[str, Path], kind: str
) -> None:
    path = builds[kind]
    for name in tiny_models.REQUIRED_FILES:
        assert (path / name).is_file(), name
    config = _config(path)
    assert (config.get("dtype") or config.get("torch_dtype")) == "bfloat16"
    assert config["max_position_embeddings"] >= 8192

    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        dtypes = {handle.get_slice(key).get_dtype() for key in handle.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"}
    size_mb = (path / "model.safetensors").stat().st_size / 2**20
    assert size_mb < 64, f"{kind} is {size_mb:.1f} MiB, too big to be tiny"


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5", "qwen3_6"])
def test_gdn_hybrid_layout(builds: dict[str, Path], kind: str) -> None:
    config = _config(builds[kind])
    assert config["architectures"] == ["Qwen3NextForCausalLM"]
    layer_types = config["layer_types"]
    assert len(layer_types) == config["num_hidden_layers"] == 8
    assert layer_types.count("linear_attention") == 6
    assert layer_types.count("full_attention") == 2
    # 3 GDN : 1 attention, attention last in each group of four.
    assert [i for i, t in enumerate(layer_types) if t == "full_attention"] == [3, 7]
    # vLLM's CPU GDN kernel only handles 128-dim key and value heads.
    assert config["linear_key_head_dim"] == 128
    assert config["linear_value_head_dim"] == 128


def test_qwen3_5_attention_shape(builds: dict[str, Path]) -> None:
    config = _config(builds["qwen3_5"])
    assert config["head_dim"] == 256
    assert config["num_key_value_heads"] == 2
    assert config["num_attention_heads"] % config["num_key_value_heads"] == 0


def test_qwen3_6_has_the_real_models_kv_shapes(builds: dict[str, Path]) -> None:
    """Qwen3.6-35B-A3B per layer: 2 KV heads x 256; GDN 16 key / 32 value
    heads x 128 with a float32 SSM state, conv kernel 4."""
    config = _config(builds["qwen3_6"])
    assert (config["num_key_value_heads"], config["head_dim"]) == (2, 256)
    assert config["linear_num_key_heads"] == 16
    assert config["linear_num_value_heads"] == 32
    assert config["linear_conv_kernel_dim"] == 4
    assert config["mamba_ssm_dtype"] == "float32"
    # One GDN layer's state as vLLM sizes it: fp32 SSM (value heads x key dim
    # x value dim) plus the bf16 conv window (kernel - 1 rows of the key,
    # key and value features): the real model's 2,146,304 B.
    key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    ssm = value * config["linear_key_head_dim"] * 4
    conv = (config["linear_conv_kernel_dim"] - 1) * (2 * key + value) * 2
    assert ssm + conv == 2_146_304
    # Attention page per token (K and V, bf16): 2,048 B, the real model's.
    assert 2 * config["num_key_value_heads"] * config["head_dim"] * 2 == 2048


def test_qwen3_next_attention_shape(builds: dict[str, Path]) -> None:
    config = _config(builds["qwen3_next"])
    assert config["head_dim"] in (64, 128)
    assert config["num_key_value_heads"] <= 4


def test_nemotron_h_layout(builds: dict[str, Path]) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(builds["nemotron_h"]))
    assert config.architectures == ["NemotronHForCausalLM"]
    assert config.hybrid_override_pattern == tiny_models.NEMOTRON_H_PATTERN
    kinds = set(config.layers_block_type)
    assert {"linear_attention", "full_attention", "mlp"} <= kinds
    assert "moe" not in kinds
    inner = config.mamba_num_heads * config.mamba_head_dim
    assert inner == config.expand * config.hidden_size
    assert config.mamba_num_heads % config.n_groups == 0


def test_dense_has_no_state_layers(builds: dict[str, Path]) -> None:
    config = _config(builds["dense"])
    assert config["model_type"] == "qwen3"
    assert set(config.get("layer_types") or ["full_attention"]) == {"full_attention"}
    assert "linear_key_head_dim" not in config
    assert "mamba_num_heads" not in config


@pytest.mark.parametrize("kind", KINDS)
def test_vocab_covers_tokenizer_and_special_ids(
    builds: dict[str, Path], kind: str
) -> None:
    from transformers import AutoTokenizer

    path = builds[kind]
    config = _config(path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert 900 <= len(tokenizer) <= 2048
    assert config["vocab_size"] >= len(tokenizer)
    assert config["vocab_size"] % tiny_tokenizer.VOCAB_MULTIPLE == 0
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert config["pad_token_id"] == tokenizer.pad_token_id
    assert tokenizer.eos_token == tiny_tokenizer.IM_END
    assert tokenizer.pad_token == tiny_tokenizer.ENDOFTEXT


def test_tokenizer_round_trip_and_chat_template(builds: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(builds["qwen3_5"]))
    for text in (
        "The quick state loads three large blocks.",
        "Unseen wörds, digits 12345 and emoji \U0001f600 still encode.",
        "  leading spaces\nand\ttabs ",
    ):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    # Corpus words compress well, so prompt lengths in tokens stay realistic.
    assert len(tokenizer.encode("the careful engineer")) <= 6

    # Special tokens are single, atomic ids.
    for special in tiny_tokenizer.SPECIAL_TOKENS:
        assert len(tokenizer.encode(special, add_special_tokens=False)) == 1

    assert tokenizer.chat_template
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    prompt = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_same_seed_is_bit_identical_other_seed_is_not(tmp_path: Path) -> None:
    first = build_tiny_model(tmp_path / "a", "qwen3_5", seed=3)
    second = build_tiny_model(tmp_path / "b", "qwen3_5", seed=3)
    other = build_tiny_model(tmp_path / "c", "qwen3_5", seed=4)

    assert _digests(first) == _digests(second)
    first_digests, other_digests = _digests(first), _digests(other)
    assert first_digests["model.safetensors"] != other_digests["model.safetensors"]
    # The tokenizer does not depend on the weight seed.
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert first_digests[name] == other_digests[name], name


def test_build_does_not_disturb_global_torch_rng(tmp_path: Path) -> None:
    import torch

    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", "dense", seed=9)
    assert torch.equal(torch.rand(4), expected)


def test_complete_build_is_reused_and_outdated_one_replaced(tmp_path: Path) -> None:
    out = tmp_path / "model"
    build_tiny_model(out, "dense", seed=0)
    weights = out / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    marker = json.loads((out / tiny_models.MARKER_NAME).read_text())
    assert marker == {
        "kind": "dense",
        "seed": 0,
        "builder_version": tiny_models.BUILDER_VERSION,
        "mtp": False,
    }

    assert build_tiny_model(out, "dense", seed=0) == out.resolve()
    assert weights.stat().st_mtime_ns == stamp

    build_tiny_model(out, "nemotron_h", seed=0)
    assert _config(out)["model_type"] == "nemotron_h"
    # No staging directories are left behind.
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_incomplete_build_is_rebuilt(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "model", "dense", seed=0)
    (out / "model.safetensors").unlink()
    build_tiny_model(out, "dense", seed=0)
    assert (out / "model.safetensors").is_file()


def test_refuses_to_overwrite_foreign_directory(tmp_path: Path) -> None:
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_tiny_model(out, "dense")
    assert (out / "notes.txt").read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["precious"]


def test_unknown_kind_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        build_tiny_model(tmp_path / "x", "llama_moe")


def test_cli_builds_and_prints_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli"
    assert tiny_models.main([str(out), "--kind", "nemotron_h", "--seed", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(out.resolve())
    marker = json.loads((out / tiny_models.MARKER_NAME).read_text())
    assert (marker["kind"], marker["seed"]) == ("nemotron_h", 1)


def test_mtp_layer_is_what_vllms_qwen3_next_mtp_loads(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    plain = build_tiny_model(tmp_path / "plain", "qwen3_next", seed=0)
    with_mtp = build_tiny_model(tmp_path / "mtp", "qwen3_next", seed=0, mtp=True)
    again = build_tiny_model(tmp_path / "again", "qwen3_next", seed=0, mtp=True)
    assert _digests(with_mtp) == _digests(again)
    assert _config(with_mtp)["num_nextn_predict_layers"] == 1
    assert "num_nextn_predict_layers" not in _config(plain)
    base, weights = (
        load_file(plain / "model.safetensors"),
        load_file(with_mtp / "model.safetensors"),
    )
    # the model's own weights are unchanged; the MTP layer is a full-attention
    # decoder layer (layer 3 of the 3:1 pattern) plus fc and three norms
    assert all(torch.equal(weights[k], v) for k, v in base.items())
    mtp = {k for k in weights if k.startswith("mtp.")}
    layer = {
        "mtp.layers.0." + k[len("model.layers.3.") :]
        for k in base
        if k.startswith("model.layers.3.")
    }
    assert mtp == layer | {
        "mtp.fc.weight",
        "mtp.norm.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.pre_fc_norm_embedding.weight",
    }
    assert weights["mtp.fc.weight"].shape == (256, 512)
    assert "mtp.layers.0.self_attn.q_proj.weight" in mtp


def test_mtp_only_for_qwen3_next_family(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--mtp: kind 'nemotron_h' has no MTP layer"):
        build_tiny_model(tmp_path / "n", "nemotron_h", mtp=True)
