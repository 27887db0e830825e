"""Kernel conformance tier: Triton's interpreter is switched on before any
test module of this directory imports a kernel (see triton_interpreter)."""

from __future__ import annotations

import pytest
import triton_interpreter

triton_interpreter.enable()


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.kernel)
