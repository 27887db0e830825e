"""Model directories with a published checkpoint's per-layer shapes and no weights.

A serving measurement of what pooled mode costs per token needs the real
model's layer shapes (attention heads, GDN heads and state, MoE width), not
the tiny models' (:mod:`vllm_hybrid.tools.tiny_models`), but not its
weights: vLLM's ``--load-format dummy`` fills them with random values at
start-up. This module writes such a directory: a ``config.json`` built from
a plan preset's shipped facts (:mod:`vllm_hybrid.tools.plan.presets`, the
one place they live) with the depth cut to ``layers`` (the preset's
attention / state pattern kept), and the tiny models' tokenizer. The
vocabulary is the tokenizer's, so that every token the random weights pick
can be detokenized; the LM head is therefore smaller than the checkpoint's,
and only it.

Qwen3.5/3.6 presets are written as the Qwen3-Next architecture (as the tiny
models are): vLLM's Qwen3.5 classes import torchvision, which CPU installs
lack, and every layer shape the KV cache and the decode step see is the same.

Nothing is downloaded; the directory is written in well under a second.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_hybrid.tools.plan.presets import PRESETS
from vllm_hybrid.tools.tiny_tokenizer import (
    MAX_POSITION_EMBEDDINGS,
    padded_vocab_size,
    save_tokenizer,
)

#: Preset fields carried over as they are (the ones that shape a layer).
SHAPE_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "rms_norm_eps",
    "rope_parameters",
    "mamba_ssm_dtype",
    "full_attention_interval",
)
#: Fields a caller may override (a CPU rehearsal's smaller hidden size and
#: experts, a small card's fewer experts).
OVERRIDABLE = ("hidden_size", "num_experts", "num_experts_per_tok")


def shaped_config(
    preset: str, layers: int, vocab_size: int, **overrides: Any
) -> dict[str, Any]:
    """``config.json`` contents: ``preset``'s layer shapes, ``layers`` deep,
    Qwen3-Next architecture, bf16."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    unknown = set(overrides) - set(OVERRIDABLE)
    if unknown:
        raise ValueError(f"cannot override {sorted(unknown)}; only {OVERRIDABLE}")
    facts = json.loads(PRESETS[preset].shipped_path.read_text())
    if not facts.get("model_type", "").startswith("qwen3_5_moe"):
        raise ValueError(f"{preset}: only Qwen3.5/3.6 MoE presets have a shaped model")
    interval = facts["full_attention_interval"]
    if layers < interval or layers % interval:
        raise ValueError(
            f"layers={layers}: a multiple of the preset's attention interval "
            f"{interval} keeps its state:attention pattern"
        )
    config = {key: facts[key] for key in SHAPE_FIELDS if key in facts}
    config.update(overrides)
    config.update(
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        num_hidden_layers=layers,
        layer_types=facts["layer_types"][:layers],
        vocab_size=vocab_size,
        # the tokenizer's context, as the tiny models have
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=False,
        hidden_act="silu",
        dtype="bfloat16",
    )
    # Qwen3-Next's config names the interval's rotary fraction at the top
    config["partial_rotary_factor"] = config["rope_parameters"].get(
        "partial_rotary_factor", 1.0
    )
    return config


def build_shaped_model(
    out_dir: str | Path, preset: str, layers: int, **overrides: Any
) -> Path:
    """Write the config and the tokenizer into ``out_dir`` (created or
    overwritten); serve it with ``--load-format dummy``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_size, ids = save_tokenizer(out)
    config = shaped_config(
        preset, layers, padded_vocab_size(tokenizer_size), **overrides
    )
    config.update(
        bos_token_id=None, eos_token_id=ids.im_end, pad_token_id=ids.endoftext
    )
    (out / "config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n"
    )
    return out
