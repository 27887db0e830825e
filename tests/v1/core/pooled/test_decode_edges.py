"""Which decode edges keep a state, and which runner copies are no copies.

The engine-level behaviour is in ``test_decode_copies.py``; these check the
rules on their own: the last edge a token budget reaches, the default
and the runner's test for a copy of a block onto itself.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_hybrid.v1.core.pooled.policy.positions import (
    DECODE_EDGES,
    DecodeEdges,
    budget_end_edge,
)
from vllm_hybrid.v1.worker.mamba_copies import is_self_copy


def _request(prompt: int, max_tokens: int) -> SimpleNamespace:
    return SimpleNamespace(num_prompt_tokens=prompt, max_tokens=max_tokens)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "edge"),
    [
        # computes 200 + 150 - 1 = 349 tokens; crosses 336 while decoding
        (200, 150, 336),
        # 351 computed: still 336
        (200, 152, 336),
        # 352 computed: the last step ends on edge 352, in the running block
        (200, 153, 352),
        # a one-token reply reaches no edge past the prompt
        (200, 1, 192),
    ],
)
def test_budget_end_is_the_last_edge_the_computed_tokens_reach(
    prompt: int, max_tokens: int, edge: int
) -> None:
    assert budget_end_edge(_request(prompt, max_tokens), 16) == edge


def test_pooled_mode_keeps_the_budget_end() -> None:
    assert DECODE_EDGES is DecodeEdges.BUDGET_END


def test_a_copy_onto_the_same_block_in_every_group_is_no_copy() -> None:
    # groups 0 (attention) and 1, 2 (state); columns 3 -> 4
    lent = ([1, 2, 3, 4, 5], [0, 0, 0, 9, 9], [0, 0, 0, 7, 7])
    assert is_self_copy(lent, [1, 2], 3, 4, 0)
    # an accepted-token shift moves a conv window within the block
    assert not is_self_copy(lent, [1, 2], 3, 4, 1)
    # one group with a fresh block: a real copy
    fresh = ([1, 2, 3, 4, 5], [0, 0, 0, 9, 9], [0, 0, 0, 7, 8])
    assert not is_self_copy(fresh, [1, 2], 3, 4, 0)
