"""What ``config.json`` alone settles, answered before vLLM is imported.

Importing vLLM takes most of a plan's time, so a request that cannot be
planned is rejected from the file where the file decides it. Every check
here is a necessary condition of vLLM's own: it rejects only requests vLLM
would reject too, from fields whose meaning is plain; where a field is
missing, vLLM decides. Whether the budget holds one request of
max_model_len is not decided here: each engine's own planning answers it
(:func:`.compute.length_shortfall`), so that there is one number. Nothing
here imports vLLM or torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hybrid.tools.plan.errors import PlanError
from vllm_hybrid.tools.plan.request import PlanRequest, read_config


@dataclass(frozen=True)
class ConfigFacts:
    """Fields of ``config.json`` (its text part) the checks rely on; None
    where the file does not say it plainly."""

    architecture: str | None
    attention_heads: int | None


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def config_facts(data: dict[str, Any]) -> ConfigFacts:
    """The facts of a parsed ``config.json`` (a multimodal one's text part)."""
    text = data.get("text_config")
    text = text if isinstance(text, dict) else data
    architectures = data.get("architectures") or [None]
    return ConfigFacts(
        architecture=architectures[0],
        attention_heads=_positive_int(text.get("num_attention_heads")),
    )


def check_tensor_parallel(request: PlanRequest, facts: ConfigFacts) -> None:
    """vLLM splits attention heads evenly over the TP ranks."""
    tp, heads = request.tensor_parallel_size, facts.attention_heads
    if heads is not None and heads % tp:
        raise PlanError(
            f"--tensor-parallel-size {tp} does not divide the model's {heads} "
            "attention heads (TP must be a divisor of it)"
        )


def check_before_vllm(request: PlanRequest, directory: Path) -> ConfigFacts:
    """Reject what ``config.json`` settles; the facts for the rest."""
    facts = config_facts(read_config(directory))
    check_tensor_parallel(request, facts)
    return facts
