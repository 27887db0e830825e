"""An in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), read by
the benchmarks, ``vllm-hybrid verify`` and the tests: how to open and release
one, its engine core, the token ids random prompts may use, how close greedy
decoding was to a tie, and where two greedy completions part.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm_hybrid.tools.workloads import allowed_token_ids

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.core import EngineCore


@contextlib.contextmanager
def open_llm(
    kwargs: Mapping[str, Any], collect: Callable[[], object] | None = None
) -> Iterator[LLM]:
    """A ``vllm.LLM`` of ``kwargs`` with its engine core in this process,
    released however the body (or the start) ends: the core shut down, the
    last reference dropped and collected (``collect``, default
    ``gc.collect``), vLLM's distributed state cleaned up. Several engines
    run one after another in one process (a benchmark worker, a test) only
    when nothing of the previous one survives."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    llm = None
    try:
        llm = LLM(**kwargs)
        yield llm
    finally:
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
        del llm
        (collect or gc.collect)()
        with contextlib.suppress(Exception):
            cleanup_dist_env_and_memory()


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


#: Largest best-minus-second log-probability at which greedy decoding counts
#: as a near-tie: one bf16 step of a logit in [4, 8) (four in [1, 2)).
#: Logits are bf16, so a gap this small flips when a kernel sums in another
#: order, which vLLM's CPU kernels do when the batch around a request
#: changes (with more than one thread everywhere, and with one thread in the
#: AVX2 fallbacks). Flips measured on an AVX2 host: at gaps of 2**-7 (bf16
#: KV cache) and 3 * 2**-7 (TurboQuant k8v4, whose dequantized keys pass
#: through more bf16 roundings).
NEAR_TIE = 2**-5


def top2_gap(logprobs: Iterable[float]) -> float | None:
    """The best of one position's log-probabilities (one per token id) minus
    the second best; how close greedy decoding was to a tie there (None with
    fewer than two)."""
    best = sorted(logprobs, reverse=True)
    return best[0] - best[1] if len(best) > 1 else None


def top2_gaps(completion: CompletionOutput) -> list[float | None]:
    """:func:`top2_gap` per output token of a vLLM ``CompletionOutput``
    (needs ``logprobs >= 2``)."""
    return [
        top2_gap(lp.logprob for lp in position.values())
        for position in completion.logprobs or []
    ]


def first_difference(mine: Sequence[int], theirs: Sequence[int]) -> int | None:
    """Index of the first token where two completions differ (the shorter
    one's length if one is a prefix of the other); None if they are equal."""
    if list(mine) == list(theirs):
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(mine, theirs, strict=False)) if x != y),
        min(len(mine), len(theirs)),
    )
