"""Prompt generation of every workload: pure and seeded, so both modes get
exactly the same token ids."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from .config import BenchConfig


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


def many_short_prompts(cfg: BenchConfig, vocab: Sequence[int]) -> list[list[int]]:
    """Prompts of the many_short workload, lengths uniform in [min, max]."""
    rng = random.Random(f"many_short/{cfg.seed}")
    return [
        random_tokens(
            rng, vocab, rng.randint(cfg.many_short_min_len, cfg.many_short_max_len)
        )
        for _ in range(cfg.many_short_requests)
    ]


def one_long_prompt(seed: int, vocab: Sequence[int], length: int) -> list[int]:
    """The one_long prompt of a given length.

    Each length gets its own stream so that a try never shares a prefix with
    the previous try beyond chance, whatever the search order.
    """
    return random_tokens(random.Random(f"one_long/{seed}/{length}"), vocab, length)


def multi_turn_system(cfg: BenchConfig, vocab: Sequence[int]) -> list[int]:
    """The system prefix every conversation starts with (same ids for all)."""
    rng = random.Random(f"multi_turn/system/{cfg.seed}")
    return random_tokens(rng, vocab, cfg.multi_turn_system_len)


def multi_turn_user(
    cfg: BenchConfig, vocab: Sequence[int], conversation: int, turn: int
) -> list[int]:
    """User tokens of one turn; fixed per (conversation, turn) for both modes."""
    rng = random.Random(f"multi_turn/user/{cfg.seed}/{conversation}/{turn}")
    return random_tokens(rng, vocab, cfg.multi_turn_user_len)


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


def chat_server_system(cfg: BenchConfig, vocab: Sequence[int]) -> list[int]:
    """The system prompt every chat_server conversation starts with."""
    rng = random.Random(f"chat_server/system/{cfg.seed}")
    return random_tokens(rng, vocab, cfg.chat_server_system_len)


def chat_server_user(
    cfg: BenchConfig, vocab: Sequence[int], conversation: int, turn: int
) -> list[int]:
    """User tokens of one chat_server turn: length uniform in [min, max],
    fixed per (conversation, turn) for both modes."""
    rng = random.Random(f"chat_server/user/{cfg.seed}/{conversation}/{turn}")
    length = rng.randint(cfg.chat_server_user_min, cfg.chat_server_user_max)
    return random_tokens(rng, vocab, length)


def chat_server_order(cfg: BenchConfig) -> list[tuple[int, int]]:
    """(conversation, turn) in arrival order: a seeded shuffle in which each
    conversation appears once per turn; its k-th appearance is turn k."""
    slots = [
        conv
        for conv in range(cfg.chat_server_conversations)
        for _ in range(cfg.chat_server_turns)
    ]
    random.Random(f"chat_server/order/{cfg.seed}").shuffle(slots)
    seen = [0] * cfg.chat_server_conversations
    order = []
    for conv in slots:
        order.append((conv, seen[conv]))
        seen[conv] += 1
    return order


def two_turn_prompts(
    cfg: BenchConfig, vocab: Sequence[int]
) -> tuple[list[int], list[int]]:
    """two_turn: the first prompt and the user tokens of the second turn."""
    rng = random.Random(f"two_turn/{cfg.seed}")
    first = random_tokens(rng, vocab, cfg.two_turn_prompt_len)
    return first, random_tokens(rng, vocab, cfg.two_turn_user_len)
