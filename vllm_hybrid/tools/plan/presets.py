"""Built-in model shapes for ``vllm-hybrid plan``: the published checkpoints.

Each preset is a ``transformers`` config class filled with the facts of one
published checkpoint's ``config.json`` that decide its KV cache: layer
counts and layer types, attention heads, KV heads and head size, state
heads and dimensions, the SSM state dtype the checkpoint asks for
(``mamba_ssm_dtype`` / ``mamba_ssm_cache_dtype``), its context length and
quantization block. Fields that do not change the KV cache (experts, MLP
widths, RoPE base) keep the class defaults. Qwen3.5/3.6 checkpoints ship a
vision tower next to the language model; the presets are the language model
(its ``text_config``), which holds every KV cache layer.

Each preset also carries the checkpoint's weights as vLLM loads them, the
default ``--weights-memory``: parameters x bytes per parameter, rounded up
to a quarter GiB (FP8 checkpoints: an estimate of their mixed widths); a
server's own "Model loading took X GiB" line is the
better number where one is at hand.

Nothing is downloaded: a preset becomes a ``config.json`` in a temporary
directory, which vLLM reads like any local model directory. The JSON of each
preset ships with the package (``preset_configs/``), so that ``plan``
answers bad input without importing ``transformers``; :func:`regenerate`
rewrites the files from the installed ``transformers``, and a test checks
that they still agree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Where the presets' ``config.json`` files ship.
CONFIG_DIR = Path(__file__).with_name("preset_configs")

GiB = 2**30

#: vLLM's block-wise FP8 checkpoints (Qwen's FP8 releases): e4m3 weights in
#: 128 x 128 blocks, dynamic activation scales.
FP8_BLOCK_QUANTIZATION = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}

#: Qwen3.5/3.6 text models: three gated DeltaNet layers, then one attention
#: layer, over and over; 262,144-token context; fp32 recurrent state.
_QWEN35_FACTS: dict[str, Any] = {
    "full_attention_interval": 4,
    "max_position_embeddings": 262144,
    "mamba_ssm_dtype": "float32",
    "vocab_size": 248320,
}


def _qwen35_layer_types(layers: int) -> list[str]:
    return [
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention"
        for i in range(layers)
    ]


def _weights(params_billions: float, bytes_per_param: float) -> int:
    """Parameters x bytes, rounded up to a quarter GiB."""
    raw = params_billions * 1e9 * bytes_per_param
    quarters = -(-raw // (GiB / 4))
    return int(quarters * GiB / 4)


@dataclass(frozen=True)
class Preset:
    """One published checkpoint's KV cache shape."""

    name: str
    #: The published checkpoint (Hugging Face id).
    checkpoint: str
    #: ``transformers`` config class the facts fill in.
    config_class: str
    #: vLLM architecture written to ``config.json``.
    architecture: str
    #: "hybrid" or "dense" (a control: both columns of the plan agree).
    kind: str
    description: str
    #: Weights vLLM loads (bytes, whole model): the default --weights-memory.
    weights_bytes: int
    #: Published ``config.json`` fields that differ from the class defaults.
    facts: Mapping[str, Any] = field(default_factory=dict)

    @property
    def shipped_path(self) -> Path:
        """The packaged ``config.json`` text of this preset."""
        return CONFIG_DIR / f"{self.name}.json"

    def config_text(self) -> str:
        """``config.json`` from the installed ``transformers``: the config
        class with this checkpoint's facts, its architecture, bf16."""
        import transformers

        config = getattr(transformers, self.config_class)(**dict(self.facts))
        data = config.to_dict()
        data["architectures"] = [self.architecture]
        # Published checkpoints of all presets run in bf16 (FP8 ones keep
        # bf16 activations next to their FP8 weights).
        data["dtype"] = "bfloat16"
        for key in ("transformers_version", "_name_or_path"):
            data.pop(key, None)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def write_config(self, directory: Path) -> Path:
        """Write the packaged ``config.json`` into ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(self.shipped_path.read_text())
        return directory


_QWEN36_35B = {**_QWEN35_FACTS, "layer_types": _qwen35_layer_types(40)}
_QWEN35_27B = {
    **_QWEN35_FACTS,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "linear_num_value_heads": 48,
    "layer_types": _qwen35_layer_types(64),
}
_NEMOTRON3_NANO = {
    "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "expand": 2,
    "n_routed_experts": 128,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "vocab_size": 131072,
    "max_position_embeddings": 262144,
    "mamba_ssm_cache_dtype": "float32",
}
_GRANITE4_H_SMALL = {
    "hidden_size": 4096,
    "num_hidden_layers": 40,
    # 4 attention layers among 36 Mamba2 layers
    "layer_types": [
        "attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)
    ],
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "num_local_experts": 72,
    "num_experts_per_tok": 10,
    "intermediate_size": 768,
    "shared_intermediate_size": 1536,
    "vocab_size": 100352,
    "max_position_embeddings": 131072,
    "position_embedding_type": "nope",
}

PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="qwen3.6-35b-a3b-fp8",
            checkpoint="Qwen/Qwen3.6-35B-A3B-FP8",
            config_class="Qwen3_5MoeTextConfig",
            architecture="Qwen3_5MoeForCausalLM",
            kind="hybrid",
            description=(
                "40 layers (30 gated DeltaNet + 10 attention), 2 KV heads x 256, "
                "GDN 16 key / 32 value heads x 128, fp32 state, 262,144 tokens, "
                "FP8 weights"
            ),
            # FP8 linear layers; embeddings, LM head, vision tower and
            # DeltaNet parameters stay bf16
            weights_bytes=35 * GiB,
            facts={**_QWEN36_35B, "quantization_config": FP8_BLOCK_QUANTIZATION},
        ),
        Preset(
            name="qwen3.5-35b-a3b",
            checkpoint="Qwen/Qwen3.5-35B-A3B",
            config_class="Qwen3_5MoeTextConfig",
            architecture="Qwen3_5MoeForCausalLM",
            kind="hybrid",
            description=(
                "40 layers (30 gated DeltaNet + 10 attention), 2 KV heads x 256, "
                "GDN 16 key / 32 value heads x 128, fp32 state, 262,144 tokens"
            ),
            weights_bytes=_weights(35.95, 2.0),
            facts=_QWEN36_35B,
        ),
        Preset(
            name="qwen3.5-27b",
            checkpoint="Qwen/Qwen3.5-27B",
            config_class="Qwen3_5TextConfig",
            architecture="Qwen3_5ForCausalLM",
            kind="hybrid",
            description=(
                "dense, 64 layers (48 gated DeltaNet + 16 attention), 4 KV heads "
                "x 256, GDN 16 key / 48 value heads x 128, fp32 state"
            ),
            weights_bytes=_weights(27.8, 2.0),
            facts=_QWEN35_27B,
        ),
        Preset(
            name="qwen3.5-9b",
            checkpoint="Qwen/Qwen3.5-9B",
            config_class="Qwen3_5TextConfig",
            architecture="Qwen3_5ForCausalLM",
            kind="hybrid",
            description=(
                "dense, 32 layers (24 gated DeltaNet + 8 attention), 4 KV heads "
                "x 256, GDN 16 key / 32 value heads x 128, fp32 state"
            ),
            weights_bytes=_weights(9.65, 2.0),
            facts={**_QWEN35_FACTS, "layer_types": _qwen35_layer_types(32)},
        ),
        Preset(
            name="qwen3-next-80b-a3b",
            checkpoint="Qwen/Qwen3-Next-80B-A3B-Instruct",
            config_class="Qwen3NextConfig",
            architecture="Qwen3NextForCausalLM",
            kind="hybrid",
            description=(
                "48 layers (36 gated DeltaNet + 12 attention), 2 KV heads x 256, "
                "GDN 16 key / 32 value heads x 128, 262,144 tokens"
            ),
            weights_bytes=_weights(81.3, 2.0),
            facts={"max_position_embeddings": 262144},
        ),
        Preset(
            name="nemotron-3-nano-30b-a3b",
            checkpoint="nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
            config_class="NemotronHConfig",
            architecture="NemotronHForCausalLM",
            kind="hybrid",
            description=(
                "52 layers (23 Mamba2 + 6 attention + 23 MoE), 2 KV heads x 128, "
                "Mamba2 64 heads x 64, d_state 128, 8 groups, fp32 state"
            ),
            weights_bytes=_weights(31.6, 2.0),
            facts=_NEMOTRON3_NANO,
        ),
        Preset(
            name="granite-4.0-h-small",
            checkpoint="ibm-granite/granite-4.0-h-small",
            config_class="GraniteMoeHybridConfig",
            architecture="GraniteMoeHybridForCausalLM",
            kind="hybrid",
            description=(
                "40 layers (36 Mamba2 + 4 attention), 8 KV heads x 128, Mamba2 "
                "128 heads x 64, d_state 128, 131,072 tokens"
            ),
            weights_bytes=_weights(32.2, 2.0),
            facts=_GRANITE4_H_SMALL,
        ),
        Preset(
            name="jamba-v0.1",
            checkpoint="ai21labs/Jamba-v0.1",
            config_class="JambaConfig",
            architecture="JambaForCausalLM",
            kind="hybrid",
            description=(
                "32 layers (28 Mamba + 4 attention), 8 KV heads x 128, "
                "Mamba d_state 16, expand 2"
            ),
            weights_bytes=_weights(51.6, 2.0),
        ),
        Preset(
            name="llama-2-7b",
            checkpoint="meta-llama/Llama-2-7b-hf",
            config_class="LlamaConfig",
            architecture="LlamaForCausalLM",
            kind="dense",
            description="dense control: 32 attention layers, 32 KV heads x 128",
            weights_bytes=_weights(6.74, 2.0),
        ),
    )
}


def describe_presets() -> str:
    """The ``--list-presets`` text: one line per preset."""
    width = max(len(name) for name in PRESETS)
    return "\n".join(
        f"{p.name:<{width}}  {p.kind:<6}  {p.checkpoint}, weights "
        f"{p.weights_bytes / GiB:.2f} GiB: {p.description}"
        for p in PRESETS.values()
    )


def regenerate() -> None:
    """Write every preset's ``config.json`` from the installed ``transformers``."""
    CONFIG_DIR.mkdir(exist_ok=True)
    for preset in PRESETS.values():
        preset.shipped_path.write_text(preset.config_text())
        print(f"wrote {preset.shipped_path}")
