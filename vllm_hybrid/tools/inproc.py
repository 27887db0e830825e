"""An in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), read by
the benchmarks, ``vllm-hybrid verify`` and the tests: its engine core, the
token ids random prompts may use, and how close greedy decoding was to a tie.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_hybrid.tools.workloads import allowed_token_ids

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.core import EngineCore


def engine_core(llm: LLM) -> EngineCore:
    """The in-process ``EngineCore`` (needs multiprocessing off):
    ``LLMEngine.engine_core`` is an ``InprocClient``, whose ``engine_core``
    is the core."""
    return llm.llm_engine.engine_core.engine_core


def llm_vocab(llm: LLM) -> list[int]:
    """Token ids random prompts may use (tokenizer and model agree on)."""
    tokenizer = llm.get_tokenizer()
    model_size = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    return allowed_token_ids(min(len(tokenizer), model_size), tokenizer.all_special_ids)


def top2_gaps(completion: CompletionOutput) -> list[float | None]:
    """Per output token of a vLLM ``CompletionOutput``: log-probability of
    the best token minus the second best (needs ``logprobs >= 2``); how
    close greedy decoding was to a tie there."""
    gaps: list[float | None] = []
    for position in completion.logprobs or []:
        best = sorted((lp.logprob for lp in position.values()), reverse=True)
        gaps.append(best[0] - best[1] if len(best) > 1 else None)
    return gaps
