"""The README's docs index links every page under ``docs/``, and every link
in it leads to a page that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def index_links(readme: str) -> list[str]:
    """Targets of the links in the README's ``## Docs`` section."""
    section = readme.split("\n## Docs\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", section)


def test_the_index_lists_every_page_once():
    links = index_links((ROOT / "README.md").read_text())
    pages = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
    assert sorted(links) == pages


def test_index_links_are_read_from_the_docs_section_only():
    readme = (
        "intro [a](docs/elsewhere.md)\n## Docs\n\n- [docs/a.md](docs/a.md): x\n"
        "- [b](docs/b.md#part): y\n## Layout\n[c](docs/c.md)\n"
    )
    assert index_links(readme) == ["docs/a.md", "docs/b.md"]
