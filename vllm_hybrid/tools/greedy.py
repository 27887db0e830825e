"""How two greedy completions of the same prompts compare: where they part,
and whether the reference was so close to a tie there that bf16 rounding,
not a fault, explains the difference. ``vllm-hybrid verify`` applies this
rule, and so do the engine tests and benchmarks that compare the overlay with
upstream vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.outputs import CompletionOutput

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
