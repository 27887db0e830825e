"""Prompts of every workload, from a run's :class:`BenchConfig`.

The generators live in :mod:`vllm_hybrid.tools.workloads` (shared with
``vllm-hybrid simulate``); this module only reads their sizes from the
run's settings, so both modes and both tools get exactly the same ids.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_hybrid.tools import workloads
from vllm_hybrid.tools.workloads import (
    SAME_TOKENS_LAYOUT,
    SAME_TOKENS_PREFIX,
    allowed_token_ids,
    one_long_prompt,
    random_tokens,
    same_tokens_prompts,
)

from .config import BenchConfig

__all__ = [
    "SAME_TOKENS_LAYOUT",
    "SAME_TOKENS_PREFIX",
    "allowed_token_ids",
    "chat_server_order",
    "chat_server_system",
    "chat_server_user",
    "many_short_prompts",
    "multi_turn_system",
    "multi_turn_user",
    "one_long_prompt",
    "random_tokens",
    "same_tokens_prompts",
    "two_turn_prompts",
]


def many_short_prompts(cfg: BenchConfig, vocab: Sequence[int]) -> list[list[int]]:
    return workloads.many_short_prompts(
        cfg.seed,
        vocab,
        cfg.many_short_requests,
        cfg.many_short_min_len,
        cfg.many_short_max_len,
    )


def multi_turn_system(cfg: BenchConfig, vocab: Sequence[int]) -> list[int]:
    return workloads.multi_turn_system(cfg.seed, vocab, cfg.multi_turn_system_len)


def multi_turn_user(
    cfg: BenchConfig, vocab: Sequence[int], conversation: int, turn: int
) -> list[int]:
    return workloads.multi_turn_user(
        cfg.seed, vocab, conversation, turn, cfg.multi_turn_user_len
    )


def chat_server_system(cfg: BenchConfig, vocab: Sequence[int]) -> list[int]:
    return workloads.chat_server_system(cfg.seed, vocab, cfg.chat_server_system_len)


def chat_server_user(
    cfg: BenchConfig, vocab: Sequence[int], conversation: int, turn: int
) -> list[int]:
    return workloads.chat_server_user(
        cfg.seed,
        vocab,
        conversation,
        turn,
        cfg.chat_server_user_min,
        cfg.chat_server_user_max,
    )


def chat_server_order(cfg: BenchConfig) -> list[tuple[int, int]]:
    return workloads.chat_server_order(
        cfg.seed, cfg.chat_server_conversations, cfg.chat_server_turns
    )


def two_turn_prompts(
    cfg: BenchConfig, vocab: Sequence[int]
) -> tuple[list[int], list[int]]:
    return workloads.two_turn_prompts(
        cfg.seed, vocab, cfg.two_turn_prompt_len, cfg.two_turn_user_len
    )
