"""The suite's longest-first hint names modules that exist."""

from pathlib import Path

from suite_order import LONGEST_FIRST

TESTS = Path(__file__).resolve().parent


def test_every_longest_first_module_exists():
    missing = [name for name in LONGEST_FIRST if not (TESTS / name).is_file()]
    assert missing == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
