"""Run upstream's Triton kernels on CPU tensors, in Triton's interpreter.

vLLM's CPU wheel decides at import time that Triton is unusable here
("Triton is installed, but doesn't include CPU backend") and hands every
kernel module placeholders instead of ``triton``/``triton.language``. With
``TRITON_INTERPRET=1`` the installed Triton runs ``@triton.jit`` kernels on
CPU tensors through NumPy, so the same kernel code CUDA runs can be checked
here. That needs two things before the first kernel module is imported:

* ``TRITON_INTERPRET=1`` in the environment (``triton.jit`` reads it when a
  kernel is decorated), and
* ``vllm.triton_utils`` pointing at the real modules again.

Both are process-wide, which is why the tier runs in its own process.
"""

from __future__ import annotations

import os
import sys

#: Kernel modules that must not have been imported with the placeholders.
KERNEL_PACKAGES = (
    "vllm.v1.attention.ops.triton",
    "vllm.v1.attention.ops.triton_turboquant",
    "vllm.third_party.flash_linear_attention",
    "vllm.model_executor.layers.mamba.ops",
    "vllm.v1.worker.mamba_utils",
)


def enable() -> None:
    """Switch kernel modules imported from now on to the real Triton, in
    interpreter mode. Fails if one was already imported with placeholders."""
    os.environ["TRITON_INTERPRET"] = "1"
    stale = sorted(m for m in sys.modules if m.startswith(KERNEL_PACKAGES))
    if stale:
        raise RuntimeError(
            "Triton kernel modules were imported before the interpreter was "
            f"enabled, so they hold vLLM's placeholders: {stale[:5]}. Run the "
            "kernel tier in its own process: pytest tests/kernels --kernel-tier"
        )
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice
    import vllm.triton_utils as triton_utils
    import vllm.triton_utils.importing as importing
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.language.core import _aggregate

    importing.HAS_TRITON = True
    real = {
        "HAS_TRITON": True,
        "triton": triton,
        "tl": tl,
        "tldevice": tldevice,
        "gluon": gluon,
        "gl": gl,
        "aggregate": _aggregate,
    }
    for name, module in real.items():
        setattr(triton_utils, name, module)
