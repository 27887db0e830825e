"""The workload generators shared by bench_pooled and the simulator.

Both tools must draw the same ids as every earlier benchmark run did, so the
first ids of each stream are pinned here; the tests also check that every
generator is a pure function of its arguments.
"""

from __future__ import annotations

import pytest

from vllm_hybrid.tools import workloads

VOCAB = workloads.allowed_token_ids(951, [0, 1, 2])


def test_allowed_ids_leave_out_special_tokens() -> None:
    assert VOCAB[:3] == [3, 4, 5]
    assert len(VOCAB) == 948
    with pytest.raises(ValueError, match="no ordinary token ids"):
        workloads.allowed_token_ids(2, [0, 1])


def test_streams_are_the_ones_benchmarks_used() -> None:
    """Ids measured before the generators moved into the package."""
    short = workloads.many_short_prompts(0, VOCAB, 64, 64, 512)
    assert (len(short), len(short[0]), short[0][:5]) == (
        64,
        239,
        [222, 88, 10, 424, 230],
    )
    assert workloads.multi_turn_system(0, VOCAB, 1200)[:5] == [718, 76, 590, 893, 11]
    assert workloads.chat_server_system(0, VOCAB, 1000)[:5] == [477, 424, 102, 430, 333]
    order = workloads.chat_server_order(0, 32, 6)
    assert order[:3] == [(28, 0), (5, 0), (8, 0)]


def test_generators_are_pure_and_seeded() -> None:
    assert workloads.many_short_prompts(1, VOCAB, 4, 8, 16) == (
        workloads.many_short_prompts(1, VOCAB, 4, 8, 16)
    )
    assert workloads.many_short_prompts(1, VOCAB, 4, 8, 16) != (
        workloads.many_short_prompts(2, VOCAB, 4, 8, 16)
    )
    user = workloads.chat_server_user(0, VOCAB, 3, 2, 40, 160)
    assert 40 <= len(user) <= 160
    assert user == workloads.chat_server_user(0, VOCAB, 3, 2, 40, 160)
    assert user != workloads.chat_server_user(0, VOCAB, 3, 1, 40, 160)


def test_chat_server_order_gives_each_conversation_its_turns_in_order() -> None:
    order = workloads.chat_server_order(0, 5, 3)
    assert sorted(order) == [(c, t) for c in range(5) for t in range(3)]
    for conv in range(5):
        assert [t for c, t in order if c == conv] == [0, 1, 2]


def test_multi_turn_prefix_is_shared_and_users_differ() -> None:
    system = workloads.multi_turn_system(0, VOCAB, 50)
    assert len(system) == 50
    assert workloads.multi_turn_user(0, VOCAB, 0, 0, 10) != (
        workloads.multi_turn_user(0, VOCAB, 1, 0, 10)
    )


def test_many_short_prompts_stay_in_range_and_ignore_global_random_state() -> None:
    import random

    random.seed(123)
    first = workloads.many_short_prompts(0, VOCAB, 64, 64, 512)
    random.seed(456)
    assert first == workloads.many_short_prompts(0, VOCAB, 64, 64, 512)
    assert all(64 <= len(p) <= 512 for p in first)
    assert all(t in set(VOCAB) for p in first for t in p)


def test_one_long_prompt_has_exact_length_and_is_stable() -> None:
    for n in (1, 249, 2044):
        prompt = workloads.one_long_prompt(0, VOCAB, n)
        assert len(prompt) == n
        assert prompt == workloads.one_long_prompt(0, VOCAB, n)


def test_multi_turn_users_are_fixed_per_conversation_and_turn() -> None:
    a = workloads.multi_turn_user(0, VOCAB, 0, 0, 100)
    assert len(a) == 100
    assert a == workloads.multi_turn_user(0, VOCAB, 0, 0, 100)
    assert a != workloads.multi_turn_user(0, VOCAB, 0, 1, 100)


def test_same_tokens_prompts_share_a_prefix_and_include_long_ones() -> None:
    fixed = workloads.same_tokens_prompts(0, VOCAB)
    assert fixed == workloads.same_tokens_prompts(0, VOCAB)
    assert len(fixed) == 8
    assert sum(len(p) > 600 for p in fixed) >= 3
    prefix = fixed[0][: workloads.SAME_TOKENS_PREFIX]
    assert sum(p[: workloads.SAME_TOKENS_PREFIX] == prefix for p in fixed) == 3
    # the first three are long and end just before a multiple of 768
    assert all(len(p) % 768 == 760 for p in fixed[:3])


def test_chat_server_order_interleaves_every_turn_once_in_order() -> None:
    from collections import Counter

    order = workloads.chat_server_order(0, 32, 6)
    assert len(order) == 32 * 6
    assert Counter(conv for conv, _ in order) == {c: 6 for c in range(32)}
    # interleaved: a conversation's turns are not back to back
    assert sum(a[0] == b[0] for a, b in zip(order[:-1], order[1:], strict=True)) < 16
    assert workloads.chat_server_order(1, 32, 6) != order
    users = [workloads.chat_server_user(0, VOCAB, c, t, 40, 160) for c, t in order]
    lengths = {len(u) for u in users}
    assert min(lengths) >= 40 and max(lengths) <= 160 and len(lengths) > 20
