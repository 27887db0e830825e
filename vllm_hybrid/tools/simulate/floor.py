"""The floor: prompt tokens that no cache could have served.

A cache can only serve a prompt's prefix that some sequence it has seen
shares: an earlier request's prompt, or, once that request finished, its
prompt followed by its reply. :class:`PrefixFloor` keeps every such
sequence and tells, for a new prompt, how many of its tokens lie after the
longest prefix any of them shares with it. The sum over a run's requests is
the floor its prefill tokens are compared with.

The sequences are kept as a tree of 16-token blocks keyed by the chained
hash of the blocks before them, with the blocks that followed each prefix
(a sequence's last, partial block included), so a lookup walks whole blocks
and compares tokens only inside the block where the prompt leaves the tree.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Tokens per block of the tree (any size gives the same counts).
BLOCK = 16
#: Key of the empty prefix.
ROOT = 0


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixFloor:
    """Every sequence seen so far, for longest-shared-prefix lookups."""

    def __init__(self) -> None:
        #: prefix key -> the blocks (tuples of at most BLOCK ids) seen after it
        self._next: dict[int, set[tuple[int, ...]]] = {}

    def shared(self, tokens: Sequence[int]) -> int:
        """Length of the longest prefix of ``tokens`` that a sequence seen
        so far shares."""
        key = ROOT
        for start in range(0, len(tokens), BLOCK):
            block = tuple(tokens[start : start + BLOCK])
            seen = self._next.get(key, ())
            if len(block) == BLOCK and block in seen:
                key = hash((key, block))
                continue
            return start + max((_common(block, s) for s in seen), default=0)
        return len(tokens)

    def unserved(self, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens`` after the longest shared prefix."""
        return len(tokens) - self.shared(tokens)

    def add(self, tokens: Sequence[int]) -> None:
        """Remember ``tokens`` (and so every prefix of it)."""
        key = ROOT
        for start in range(0, len(tokens), BLOCK):
            block = tuple(tokens[start : start + BLOCK])
            self._next.setdefault(key, set()).add(block)
            key = hash((key, block))
