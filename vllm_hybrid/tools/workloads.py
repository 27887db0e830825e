"""Seeded prompt generators of the project's workloads.

Pure functions of a seed and plain sizes, with no tokenizer: token ids are
drawn from a vocabulary list, so every caller (``benchmarks/bench_pooled.py``
on CPU engines, ``vllm-hybrid simulate`` at a real model's geometry) gets
exactly the same ids for the same arguments, in every mode and process.
Each generator draws from its own named random stream, so changing one
workload's size never changes another workload's prompts.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence


def allowed_token_ids(vocab_size: int, special_ids: Iterable[int]) -> list[int]:
    """Ids a random prompt may use: the vocabulary minus special tokens.

    Special tokens (EOS, chat markers) are excluded so that prompts never end
    a sequence early or look like chat structure to the model.
    """
    special = set(special_ids)
    ids = [i for i in range(vocab_size) if i not in special]
    if not ids:
        raise ValueError("no ordinary token ids in the vocabulary")
    return ids


def random_tokens(rng: random.Random, vocab: Sequence[int], length: int) -> list[int]:
    """``length`` ids drawn from ``vocab``; exact lengths need no tokenizer."""
    return [rng.choice(vocab) for _ in range(length)]


def many_short_prompts(
    seed: int, vocab: Sequence[int], count: int, min_len: int, max_len: int
) -> list[list[int]]:
    """``count`` prompts of the many_short workload, lengths uniform in
    [``min_len``, ``max_len``]."""
    rng = random.Random(f"many_short/{seed}")
    return [
        random_tokens(rng, vocab, rng.randint(min_len, max_len)) for _ in range(count)
    ]


def one_long_prompt(seed: int, vocab: Sequence[int], length: int) -> list[int]:
    """The one_long prompt of a given length.

    Each length gets its own stream so that a try never shares a prefix with
    the previous try beyond chance, whatever the search order.
    """
    return random_tokens(random.Random(f"one_long/{seed}/{length}"), vocab, length)


def multi_turn_system(seed: int, vocab: Sequence[int], length: int) -> list[int]:
    """The system prefix every conversation starts with (same ids for all)."""
    rng = random.Random(f"multi_turn/system/{seed}")
    return random_tokens(rng, vocab, length)


def multi_turn_user(
    seed: int, vocab: Sequence[int], conversation: int, turn: int, length: int
) -> list[int]:
    """User tokens of one turn; fixed per (conversation, turn)."""
    rng = random.Random(f"multi_turn/user/{seed}/{conversation}/{turn}")
    return random_tokens(rng, vocab, length)


#: same_tokens prompts in submission order: (starts with the shared prefix,
#: tokens after it). Most lengths sit a few tokens below a multiple of 768,
#: the LCM of the 256- and 384-token blocks upstream uses for the tiny models
#: (and a multiple of every power-of-two block size up to 256), so decoding
#: crosses a block boundary and needs one more block. The first three are
#: long and admitted together in the forced-preemption budget, so they all
#: grow at once in a full pool, which is what makes the scheduler preempt.
SAME_TOKENS_LAYOUT: tuple[tuple[bool, int], ...] = (
    (True, 120),
    (False, 760),
    (True, 120),
    (True, 60),
    (False, 1528),
    (False, 376),
    (False, 120),
    (False, 40),
)
#: Length of the prefix the ``True`` entries share.
SAME_TOKENS_PREFIX = 640


def same_tokens_prompts(seed: int, vocab: Sequence[int]) -> list[list[int]]:
    """Eight fixed prompts: long and short ones, three with a common prefix."""
    rng = random.Random(f"same_tokens/{seed}")
    prefix = random_tokens(rng, vocab, SAME_TOKENS_PREFIX)
    return [
        (prefix if shared else []) + random_tokens(rng, vocab, n)
        for shared, n in SAME_TOKENS_LAYOUT
    ]


def chat_server_system(seed: int, vocab: Sequence[int], length: int) -> list[int]:
    """The system prompt every chat_server conversation starts with."""
    rng = random.Random(f"chat_server/system/{seed}")
    return random_tokens(rng, vocab, length)


def chat_server_user(
    seed: int,
    vocab: Sequence[int],
    conversation: int,
    turn: int,
    min_len: int,
    max_len: int,
) -> list[int]:
    """User tokens of one chat_server turn: length uniform in [``min_len``,
    ``max_len``], fixed per (conversation, turn)."""
    rng = random.Random(f"chat_server/user/{seed}/{conversation}/{turn}")
    length = rng.randint(min_len, max_len)
    return random_tokens(rng, vocab, length)


def chat_server_order(
    seed: int, conversations: int, turns: int
) -> list[tuple[int, int]]:
    """(conversation, turn) in arrival order: a seeded shuffle in which each
    conversation appears once per turn; its k-th appearance is turn k."""
    slots = [conv for conv in range(conversations) for _ in range(turns)]
    random.Random(f"chat_server/order/{seed}").shuffle(slots)
    seen = [0] * conversations
    order = []
    for conv in slots:
        order.append((conv, seen[conv]))
        seen[conv] += 1
    return order
