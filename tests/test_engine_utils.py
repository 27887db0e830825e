"""The comparison rule the engine tests share (no engine needed)."""

from __future__ import annotations

from engine_utils import NEAR_TIE, Greedy, near_tie_differences


def test_differences_that_start_at_a_near_tie_are_rounding():
    ref = Greedy([[1, 2, 3], [4, 5, 6]], [[0.5, NEAR_TIE, 0.3], [0.5, 0.2, 0.0]])
    assert near_tie_differences(ref, [[1, 2, 3], [4, 5, 6]]) == []
    # the second token was a near-tie: whatever follows may differ
    assert near_tie_differences(ref, [[1, 9, 9], [4, 5, 7]]) == []


def test_differences_where_the_reference_was_confident_are_reported():
    ref = Greedy([[1, 2, 3], [4, 5, 6]], [[0.5, 2 * NEAR_TIE, 0.3], [0.5, 0.2, 0.0]])
    assert near_tie_differences(ref, [[1, 9, 3], [7, 5, 6]]) == [
        (0, 1, 2 * NEAR_TIE),
        (1, 0, 0.5),
    ]
    # a shorter completion differs where it ends; no gap: not a tie
    ref = Greedy([[1, 2]], [[0.5, None]])
    assert near_tie_differences(ref, [[1]]) == [(0, 1, None)]


def test_two_runs_each_within_rounding_of_a_tie_are_rounding():
    ref = Greedy([[1, 2, 3]], [[0.5, 1.25 * NEAR_TIE, 0.3]])
    # the other run put its own token ahead by 0.25 NEAR_TIE: 1.5 together
    assert near_tie_differences(ref, [[1, 9, 9]], [[0.5, 0.25 * NEAR_TIE, 0.1]]) == []
    # ahead by a whole NEAR_TIE: 2.25 together, not rounding
    assert near_tie_differences(ref, [[1, 9, 9]], [[0.5, NEAR_TIE, 0.1]]) == [
        (0, 1, 1.25 * NEAR_TIE)
    ]
    # without the other run's gaps the reference's rule alone applies
    assert near_tie_differences(ref, [[1, 9, 9]]) == [(0, 1, 1.25 * NEAR_TIE)]


def test_top2_gap_is_best_minus_second_best():
    """The gap the comparison reads: best minus second best of one
    position's log-probabilities (a tie is 0; one entry has no gap)."""
    from vllm_hybrid.tools.greedy import top2_gap

    assert top2_gap([-1.5, -0.25]) == 1.25
    assert top2_gap([-0.5, -0.5, -2.0]) == 0.0
    assert top2_gap([-1.0]) is None
