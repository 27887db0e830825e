"""The Triton entry points of kernel modules that a CPU platform rebinds.

A few upstream kernel modules end by replacing their Triton entry points with
CPU implementations when the platform is a CPU (``causal_conv1d``,
``mamba_ssm``, ``ssd_combined``). The CUDA worker calls the Triton versions,
so the conformance tier needs those: :func:`load_triton_variant` executes the
module's source once more under a private name while the platform answers
``is_cpu() == False``, which keeps the Triton definitions bound. The module
itself is untouched, so code that imported it keeps the CPU versions.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from types import ModuleType
from unittest import mock

#: Upstream modules whose tail rebinds Triton entry points on a CPU platform.
CPU_REBOUND = (
    "vllm.model_executor.layers.mamba.ops.causal_conv1d",
    "vllm.model_executor.layers.mamba.ops.mamba_ssm",
    "vllm.model_executor.layers.mamba.ops.ssd_combined",
)


@cache
def load_triton_variant(module_name: str) -> ModuleType:
    """A private copy of ``module_name`` with its Triton entry points bound.

    Cached, so every test module shares one copy (and one set of compiled
    interpreter kernels)."""
    if module_name not in CPU_REBOUND:
        raise ValueError(f"{module_name} does not rebind on CPU; import it directly")
    origin = importlib.util.find_spec(module_name).origin
    package, _, leaf = module_name.rpartition(".")
    spec = importlib.util.spec_from_file_location(f"{package}._triton_{leaf}", origin)
    module = importlib.util.module_from_spec(spec)
    from vllm.platforms import current_platform

    with mock.patch.object(current_platform, "is_cpu", return_value=False):
        spec.loader.exec_module(module)
    return module
