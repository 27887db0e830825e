"""The tiny EAGLE draft: vLLM's EAGLE-1 layout, the target's attention shape,
reproducible bytes."""

from __future__ import annotations

import json

from safetensors.torch import load_file

from testing.tiny_eagle import build_eagle_draft


def test_draft_matches_the_target_and_rebuilds_byte_for_byte(tiny_model_dir, tmp_path):
    target = tiny_model_dir("qwen3_next")
    first = build_eagle_draft(target, tmp_path / "a")
    second = build_eagle_draft(target, tmp_path / "b")
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in second.iterdir())
    for name in files:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    config = json.loads((first / "config.json").read_text())
    target_config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["EagleLlamaForCausalLM"]
    for key in ("hidden_size", "num_key_value_heads", "head_dim", "vocab_size"):
        assert config[key] == target_config[key], key
    assert config["num_hidden_layers"] == 1
    weights = load_file(str(first / "model.safetensors"))
    hidden = config["hidden_size"]
    assert tuple(weights["fc.weight"].shape) == (hidden, 2 * hidden)
    # EAGLE-1: no input norm on the first layer, no final norm, LM head shared
    assert "layers.0.input_layernorm.weight" not in weights
    assert not any(n.startswith(("lm_head.", "norm.", "model.")) for n in weights)
    assert {p.stat().st_mode & 0o777 for p in first.iterdir()} == {0o644}
    # a finished build is reused, another seed is rebuilt
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert build_eagle_draft(target, first) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    build_eagle_draft(target, first, seed=1)
    assert (first / "model.safetensors").read_bytes() != (
        second / "model.safetensors"
    ).read_bytes()
