"""Kernel conformance tier: without a CUDA device, Triton's interpreter is
switched on before any test module of this directory imports a kernel (see
triton_interpreter); with one, the same tests run the compiled kernels."""

from __future__ import annotations

import pytest
import torch
import triton_interpreter

if not torch.cuda.is_available():
    # on a GPU runner the kernels run compiled, on real CUDA tensors
    triton_interpreter.enable()
    import interpreter_quirks

    # gaps of the interpreter the kernels would otherwise trip over (bf16
    # arithmetic on raw bits among them), for every module of the tier
    interpreter_quirks.apply()


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.kernel)
