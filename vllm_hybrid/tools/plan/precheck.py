"""What ``config.json`` alone settles, answered before vLLM is imported.

Importing vLLM takes most of a plan's time, so a request that cannot be
planned is rejected from the file where the file decides it. Every check
here is a necessary condition of vLLM's own: it rejects only requests vLLM
would reject too, from fields whose meaning is plain. Where a config is
outside that (no ``layer_types``, sliding windows, MLA, scaled RoPE, a KV
dtype without a fixed width), the check stays silent and vLLM decides.
Nothing here imports vLLM or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hybrid.tools.plan.request import PlanError, PlanRequest, read_config

#: Fewest bits a KV cache dtype stores per key and per value element (scales
#: and padding not counted: a lower bound). "auto" is the model's dtype, which
#: vLLM keeps at 16 bits or more. Dtypes not listed are not pre-checked.
KV_BITS: dict[str, tuple[int, int]] = {
    "auto": (16, 16),
    "float16": (16, 16),
    "bfloat16": (16, 16),
    "fp8": (8, 8),
    "fp8_e4m3": (8, 8),
    "fp8_e5m2": (8, 8),
    "turboquant_k8v4": (8, 4),
    "turboquant_4bit_nc": (4, 4),
    "turboquant_k3v4_nc": (3, 4),
    "turboquant_3bit_nc": (3, 3),
}

#: Config keys vLLM 0.32 takes the model's maximum length from (the smallest
#: one present wins).
_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


@dataclass(frozen=True)
class ConfigFacts:
    """Fields of ``config.json`` (its text part) the checks rely on; None
    where the file does not say it plainly."""

    architecture: str | None
    attention_heads: int | None
    kv_heads: int | None
    head_dim: int | None
    #: Full attention layers, from ``layer_types``.
    attention_layers: int | None
    #: The model's own length, where vLLM takes it unchanged (one length
    #: key, RoPE unscaled).
    max_model_len: int | None


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def _attention_layers(text: dict[str, Any]) -> int | None:
    types = text.get("layer_types")
    if not isinstance(types, list) or not types:
        return None
    layers = _positive_int(text.get("num_hidden_layers"))
    types = types[:layers] if layers else types
    if any("sliding" in str(t) for t in types):
        return None
    return sum(t in ("full_attention", "attention") for t in types)


def _rope_scaled(text: dict[str, Any]) -> bool:
    """Whether any RoPE entry scales the length (vLLM multiplies it)."""
    entries = []
    for key in ("rope_parameters", "rope_scaling"):
        value = text.get(key)
        if isinstance(value, dict):
            nested = [v for v in value.values() if isinstance(v, dict)]
            entries += nested or [value]
    return any(
        e.get("rope_type", e.get("type", "default")) != "default" for e in entries
    )


def _model_max_len(text: dict[str, Any]) -> int | None:
    present = {k: text[k] for k in _LENGTH_KEYS if text.get(k) is not None}
    if list(present) != ["max_position_embeddings"] or _rope_scaled(text):
        return None
    return _positive_int(present["max_position_embeddings"])


def config_facts(data: dict[str, Any]) -> ConfigFacts:
    """The facts of a parsed ``config.json`` (a multimodal one's text part)."""
    text = data.get("text_config")
    text = text if isinstance(text, dict) else data
    heads = _positive_int(text.get("num_attention_heads"))
    head_dim = _positive_int(text.get("head_dim"))
    hidden = _positive_int(text.get("hidden_size"))
    if head_dim is None and hidden and heads and hidden % heads == 0:
        head_dim = hidden // heads
    mla = text.get("kv_lora_rank") is not None
    architectures = data.get("architectures") or [None]
    return ConfigFacts(
        architecture=architectures[0],
        attention_heads=heads,
        kv_heads=_positive_int(text.get("num_key_value_heads", heads)),
        head_dim=None if mla else head_dim,
        attention_layers=None
        if text.get("sliding_window")
        else _attention_layers(text),
        max_model_len=_model_max_len(text),
    )


def attention_bytes_per_token(request: PlanRequest, facts: ConfigFacts) -> int | None:
    """A lower bound of one token's attention KV bytes per GPU; None if the
    config or the KV dtype does not give one plainly."""
    bits = KV_BITS.get(request.kv_cache_dtype)
    if bits is None or None in (facts.attention_layers, facts.kv_heads, facts.head_dim):
        return None
    kv_heads = max(1, facts.kv_heads // request.tensor_parallel_size)
    per_layer = kv_heads * facts.head_dim * sum(bits) // 8
    return facts.attention_layers * per_layer


def check_tensor_parallel(request: PlanRequest, facts: ConfigFacts) -> None:
    """vLLM splits attention heads evenly over the TP ranks."""
    tp, heads = request.tensor_parallel_size, facts.attention_heads
    if heads is not None and heads % tp:
        raise PlanError(
            f"--tensor-parallel-size {tp} does not divide the model's {heads} "
            "attention heads (TP must be a divisor of it)"
        )


def check_budget(request: PlanRequest, facts: ConfigFacts) -> None:
    """One request of max_model_len must fit its attention KV, whatever the
    block size, padding or pool: a bound both plans exceed."""
    length = request.max_model_len or facts.max_model_len
    per_token = attention_bytes_per_token(request, facts)
    if length is None or not per_token:
        return
    needed = length * per_token
    budget = request.kv_cache_memory
    if needed <= budget:
        return
    mib = 2**20
    raise PlanError(
        f"The KV cache budget of {budget / mib:.2f} MiB cannot hold one request "
        f"of max_model_len={length} tokens: its attention KV alone takes at "
        f"least {needed / mib:.2f} MiB ({per_token:,} B per token). Raise "
        f"{request.budget_options}, or lower --max-model-len (at most "
        f"{budget // per_token:,} tokens fit; a plan at a lower value gives the "
        "exact limit)."
    )


def check_before_vllm(request: PlanRequest, directory: Path) -> ConfigFacts:
    """Reject what ``config.json`` settles; the facts for the rest."""
    facts = config_facts(read_config(directory))
    check_tensor_parallel(request, facts)
    check_budget(request, facts)
    return facts
