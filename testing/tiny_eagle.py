"""A tiny random-weight EAGLE draft for a tiny target model.

EAGLE speculative decoding runs a small draft model that reads the target's
last hidden states. vLLM's ``EagleLlamaForCausalLM`` takes an EAGLE-1
checkpoint: one Llama decoder layer without its input norm, ``fc`` (hidden x
2 hidden) joining the token embedding and the target's hidden state, the
embedding, and the target's LM head (shared). This module writes such a
checkpoint for a model made by :mod:`vllm_hybrid.tools.tiny_models`, with
the target's hidden size, attention heads and head dimension, so that the
draft's attention layer has the target's KV cache spec. Weights are drawn
from the Llama initialiser under a fixed seed; every build is byte-for-byte
reproducible.

Usage::

    python -m testing.tiny_eagle TARGET_DIR OUT_DIR [--seed N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from vllm_hybrid.tools.tiny_models import clear_previous_build, read_marker

#: Name of the file that marks a finished draft (written last).
MARKER_NAME = "tiny_eagle_build.json"
#: Bump whenever a change alters the produced files.
BUILDER_VERSION = 1
#: Tokenizer files copied from the target (the draft shares its vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _draft_config(target: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=target["vocab_size"],
        hidden_size=target["hidden_size"],
        intermediate_size=2 * target["hidden_size"],
        num_hidden_layers=1,
        num_attention_heads=target["num_attention_heads"],
        num_key_value_heads=target["num_key_value_heads"],
        head_dim=target["head_dim"],
        max_position_embeddings=target["max_position_embeddings"],
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=target["eos_token_id"],
        pad_token_id=target["pad_token_id"],
    )


def _draft_weights(config, seed: int) -> dict:
    """EAGLE-1 tensors in bf16: the Llama layer without its input norm, the
    embedding and ``fc``; no final norm and no LM head (the target's)."""
    import torch
    from transformers import LlamaForCausalLM

    skipped = {"model.norm.weight", "model.layers.0.input_layernorm.weight"}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        hidden = config.hidden_size
        fc = torch.randn(hidden, 2 * hidden) * config.initializer_range
    weights = {
        name.removeprefix("model."): tensor.to(torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
        if name not in skipped and not name.startswith("lm_head.")
    }
    weights["fc.weight"] = fc.to(torch.bfloat16)
    return weights


def _marker(target_dir: Path, seed: int) -> dict:
    target_marker = read_marker(target_dir)
    if target_marker is None:
        raise FileNotFoundError(f"{target_dir} is not a finished tiny_models build")
    return {
        "builder_version": BUILDER_VERSION,
        "seed": seed,
        "target": asdict(target_marker),
    }


def build_eagle_draft(
    target_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], seed: int = 0
) -> Path:
    """Build (or reuse) the EAGLE draft of ``target_dir`` in ``out_dir``."""
    from safetensors.torch import save_file

    target, out = Path(target_dir).resolve(), Path(out_dir).resolve()
    marker = _marker(target, seed)
    marker_path = out / MARKER_NAME
    if marker_path.is_file() and json.loads(marker_path.read_text()) == marker:
        return out
    clear_previous_build(out, MARKER_NAME)
    out.mkdir(parents=True)
    config = _draft_config(json.loads((target / "config.json").read_text()))
    save_file(
        _draft_weights(config, seed),
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    data = config.to_dict()
    data["architectures"] = ["EagleLlamaForCausalLM"]
    data["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(target / name, out / name)
    for path in out.iterdir():
        path.chmod(0o644)
    marker_path.write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testing.tiny_eagle",
        description="Build a tiny random-weight EAGLE draft for a tiny model.",
    )
    parser.add_argument("target_dir", type=Path, help="a tiny_models directory")
    parser.add_argument("out_dir", type=Path, help="directory to create")
    parser.add_argument("--seed", type=int, default=0, help="weight seed")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(build_eagle_draft(args.target_dir, args.out_dir, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
