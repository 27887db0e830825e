"""Cheaper garbage collections in every Python process of the test suite.

tests/conftest.py puts this folder first on ``PYTHONPATH``, so Python loads
this module at start-up in the pytest workers and in every process a test
starts (engine subprocesses, servers and their workers).

vLLM asks for a full collection about seven times while one engine starts
and stops (after loading weights, when it freezes its heap, after
profiling, in distributed tear-down). In a process holding torch and vLLM a
full collection walks some 700,000 objects, about 0.6 s on the suite's
2-core host, which made up about a third of a tiny engine test's CPU time
(tests/v1/core/test_turn_end_retention.py: 49.6 s of CPU with them, 34.4 s
with young collections). Here an explicit ``gc.collect()`` collects the
youngest generation only. The interpreter's automatic collections, which do
reach the oldest generation as it grows, are unchanged, and
:func:`full_collect` is the real full collection, for a test that frees an
engine before it starts the next one.
"""

import gc

_full = gc.collect


def _young(generation: int = 2) -> int:
    return _full(0)


def full_collect() -> int:
    """A full collection, whatever ``gc.collect`` does in this process."""
    return _full()


gc.collect = _young
