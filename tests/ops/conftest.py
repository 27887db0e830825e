"""Fixtures for the TurboQuant numeric tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Run these small-tensor tests on one intra-op thread.

    On a loaded 2-core machine, OpenMP threads spinning for each other made
    tiny torch ops ~50x slower; one thread keeps the module within its time
    budget. The previous setting is restored for the rest of the suite.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
