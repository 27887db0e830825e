"""Errors from vLLM and the engine core, in the planner's own terms.

The engine's messages advise vLLM's options by their config names
(``gpu_memory_utilization``); a planner user sets the budget with
``--kv-cache-memory-bytes`` or ``--gpu-memory``. The facts of a message stay its
author's (one source of the text); only the advice is phrased here: the
pooled core's error carries its numbers and takes the option names, and in
vLLM's own messages the sentences that advise vLLM's options are replaced.
"""

from __future__ import annotations

import re

from vllm_hybrid.tools.plan.errors import shortened, unwrapped
from vllm_hybrid.tools.plan.request import PlanRequest

#: Names in vLLM's messages that mean "the KV budget".
_VLLM_BUDGET_NAMES = (
    "gpu_memory_utilization",
    "--gpu-memory-utilization",
    "--kv-cache-memory-bytes",
    "kv_cache_memory_bytes",
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(])")


def _advice(sentence: str, request: PlanRequest) -> str:
    """A sentence advising vLLM's budget options, with the planner's."""
    if "max_model_len" in sentence or "max-model-len" in sentence:
        return f"Raise {request.budget_options}, or lower --max-model-len."
    return f"Raise {request.budget_options}."


def in_planner_terms(text: str, request: PlanRequest) -> str:
    """``text`` (one of vLLM's messages) advising the planner's options."""
    sentences = []
    for sentence in _SENTENCE_END.split(text.strip()):
        if sentence.startswith("See http"):
            continue  # vLLM's docs link: about engine options
        if any(name in sentence for name in _VLLM_BUDGET_NAMES):
            sentence = _advice(sentence, request)
        sentences.append(sentence.replace("`max_model_len`", "--max-model-len"))
    return " ".join(sentences)


#: vLLM's config field names in its messages, and the flags that set them.
_FIELD_FLAGS = (
    "max_num_seqs",
    "max_model_len",
    "max_num_batched_tokens",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
)


def with_flag_names(text: str) -> str:
    """One of vLLM's messages with its config field names written as the
    flags that set them (``max_num_seqs`` -> ``--max-num-seqs``), the rest
    as vLLM wrote it."""
    for name in _FIELD_FLAGS:
        flag = "--" + name.replace("_", "-")
        text = re.sub(rf"`?(?<![-\w]){name}`?", flag, text)
    return text


def error_text(exc: BaseException, request: PlanRequest) -> str:
    """The one-line message of an error met while planning ``request``."""
    shortfall = getattr(exc, "shortfall", None)
    if shortfall is not None:
        return shortfall.message(request.budget_options)
    text = in_planner_terms(unwrapped(exc), request)
    return shortened(text) or type(exc).__name__
