"""Render pooled mode's eviction order as markdown, from the policy module.

docs/pooled-mode.md shows the order in a block that ``scripts/gen_docs.py``
regenerates from this script's output (``<!-- generated markdown: python
scripts/eviction_order.py -->``), so the page cannot drift from
``vllm_hybrid/v1/core/pooled/policy/eviction.py``: the segments and their
order, where each kind of freed entry goes, the kinds that compete, the
admission attempts and the constants they use come from the module's data,
each described by the ``#:`` comment above it in the module's source.

Usage: python scripts/eviction_order.py
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
#: The records the comments link, as the docs page links them.
RECORD = re.compile(r"benchmarks/results/([\w.-]+\.md)")
ROLE = re.compile(r":(?:data|attr|func|meth|mod|class):`~?\.?(?:\w+\.)*(\w+)`")
LITERAL = re.compile(r"``([^`]+)``")


def comments(source: str) -> dict[str, str]:
    """The ``#:`` comment above each assignment, by name: module constants
    as ``NAME``, class members as ``Class.NAME``."""
    lines = source.split("\n")
    found: dict[str, str] = {}

    def above(lineno: int) -> str:
        text: list[str] = []
        i = lineno - 2
        while i >= 0 and lines[i].strip().startswith("#:"):
            text.insert(0, lines[i].strip()[2:].strip())
            i -= 1
        return " ".join(text)

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{node.name}.")
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            for target in targets:
                if isinstance(target, ast.Name) and above(node.lineno):
                    found[prefix + target.id] = above(node.lineno)

    visit(ast.parse(source).body, "")
    return found


class Renderer:
    """Markdown of one policy module's data and comments."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self.notes = comments(inspect.getsource(module))

    def value(self, name: str) -> object:
        return getattr(self.module, name, None)

    def text(self, key: str) -> str:
        """The comment of ``key`` as markdown: roles and literals become
        code, a scalar constant named gets its value, a record a link."""

        def role(match: re.Match) -> str:
            name = match.group(1)
            value = self.value(name)
            if isinstance(value, bool | int | float):
                return f"`{name}` = {value}"
            return f"`{name}`"

        note = ROLE.sub(role, self.notes.get(key, ""))
        note = LITERAL.sub(r"`\1`", note)
        return RECORD.sub(r"[\1](../benchmarks/results/\1)", note)

    @staticmethod
    def lower(text: str) -> str:
        """A comment as a clause: first letter lower case, no final stop."""
        return text[:1].lower() + text[1:].rstrip(".")

    def names(self, members: Sequence[Enum]) -> str:
        return ", ".join(f"`{m.name}`" for m in members)

    def member(self, member: Enum) -> str:
        note = self.text(f"{type(member).__name__}.{member.name}")
        return f"`{member.name}`: {note}"

    def render(self) -> str:
        m = self.module
        out = [
            f"- **Hand-out order** (`HAND_OUT_ORDER`), first to last: "
            f"{self.text('HAND_OUT_ORDER')}"
        ]
        out += [
            f"  {i}. {self.member(segment)}"
            for i, segment in enumerate(m.HAND_OUT_ORDER, 1)
        ]
        out.append(
            f"- **While the arena refuses new requests** (`CLEARING_ORDER`): "
            f"{self.names(m.CLEARING_ORDER)}. {self.text('CLEARING_ORDER')}"
        )
        for name in ("PROTECT_AFTER_HITS", "STATE_EVICTION_WINDOW"):
            out.append(f"- `{name}` = {self.value(name)}: {self.text(name)}")
        out.append("- **Places** (`Place`), where a ranked free block goes:")
        out += [f"  - {self.member(place)}" for place in m.Place]
        out.append(f"- **Where a freed entry goes** (`PLACES`): {self.text('PLACES')}")
        out += [
            f"  - `{entry.name}` → `{place.name}`: {self.text(f'Entry.{entry.name}')}"
            for entry, place in m.PLACES.items()
        ]
        rivals = sorted({frozenset(pair) for pair in m.RIVALS.items()}, key=str)
        pairs = "; ".join(
            " and ".join(f"`{e.name}`" for e in sorted(pair, key=lambda e: e.name))
            for pair in rivals
        )
        out.append(f"- **Rivals** (`RIVALS`: {pairs}): {self.text('RIVALS')}")
        promoted = "; ".join(
            f"`{k.name}` over `{v.name}`" for k, v in m.PROMOTED.items()
        )
        out.append(f"- **Promoted** (`PROMOTED`: {promoted}): {self.text('PROMOTED')}")
        out.append(
            f"- `RIVAL_HALF_LIFE_HITS` = {m.RIVAL_HALF_LIFE_HITS}: "
            f"{self.text('RIVAL_HALF_LIFE_HITS')}"
        )
        out.append(f"- **Admission** (`ADMISSION`): {self.text('ADMISSION')}")
        for i, attempt in enumerate(m.ADMISSION, 1):
            reach = self.lower(self.text(f"Reach.{attempt.reach.name}"))
            step = f"  {i}. reach `{attempt.reach.name}`: {reach}"
            if attempt.in_place:
                in_place = self.lower(self.text("AdmissionAttempt.in_place"))
                step += f"; in place: {in_place}"
            out.append(step)
        return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    del argv  # no options: one module, one rendering
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from vllm_hybrid.v1.core.pooled.policy import eviction

    print(Renderer(eviction).render())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
