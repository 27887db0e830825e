"""Triton's interpreter brought in line with a CUDA launch for the
attention kernels.

The attention kernels run unchanged in the interpreter, but a CPU-only run
differs from a CUDA launch in three places: one launcher queries the device,
and two numeric paths of the interpreter compute something else than a GPU.
The numeric ones would make the float32 reference checks fail (the
pooled-vs-twin comparison is unaffected: both runs see the same
interpreter). :func:`interpreter_fixes` patches all three for the duration
of a test module; on a CUDA machine it does nothing.
"""

from __future__ import annotations

from contextlib import contextmanager
from unittest import mock

import numpy as np
import torch


@contextmanager
def interpreter_fixes():
    """What the attention kernels need from a CPU-only interpreter run, so
    that it computes what a GPU computes:

    * ``torch.cuda.get_device_capability`` answers (9, 0): the bf16 store's
      launcher asks for the major version only to cap its tile at 512
      elements before Hopper; one token's K (2 heads x 256) is 512 elements,
      so every answer launches the same grid.
    * ``tl.dot`` of bf16 operands computes in float32: the interpreter keeps
      bf16 as raw ``uint16`` and multiplies the bit patterns (outputs around
      1e9). A GPU multiplies bf16 exactly and accumulates in float32, which
      widening the operands reproduces.
    * Rounding to fp8e4nv (TurboQuant's key format) is to nearest even and
      saturates at 448, as the GPU's conversion does: the interpreter rounds
      ties up and drops the mantissa carry (-1.9375 becomes -1.0, not -2.0).
    """
    if torch.cuda.is_available():
        yield
        return
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot
    convert_float = interpreter._convert_float

    def dot_widening_bf16(self, a, b, *args):
        return create_dot(self, _widen_bf16(a), _widen_bf16(b), *args)

    def convert_rounding_fp8(data, src, dst, rounding):
        target = _TORCH_FP8.get(str(dst))
        if target is None or rounding is None or src.primitive_bitwidth <= 8:
            return convert_float(data, src, dst, rounding)
        return _to_fp8(data, src, target)

    with (
        mock.patch.object(torch.cuda, "get_device_capability", lambda *a: (9, 0)),
        mock.patch.object(builder, "create_dot", dot_widening_bf16),
        mock.patch.object(interpreter, "_convert_float", convert_rounding_fp8),
    ):
        yield


#: Triton fp8 types whose rounding is replaced, and their torch twins.
_TORCH_FP8 = {"fp8e4nv": torch.float8_e4m3fn}


def _widen_bf16(handle):
    """A bf16 interpreter tensor as float32 (bf16 is float32's top half)."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    if handle.dtype.scalar != tl.bfloat16:
        return handle
    bits = handle.data.astype(np.uint32) << 16
    return TensorHandle(bits.view(np.float32), tl.float32)


def _to_fp8(data: np.ndarray, src, target: torch.dtype) -> np.ndarray:
    """``data`` (float32/float16, or bf16 bits) rounded to ``target`` bits,
    saturating at its largest finite value as the GPU conversion does."""
    if src.primitive_bitwidth == 16 and not src.is_fp16():
        data = (data.astype(np.uint32) << 16).view(np.float32)
    values = torch.from_numpy(np.ascontiguousarray(data)).float()
    limit = torch.finfo(target).max
    values = values.clamp(-limit, limit)
    return values.to(target).view(torch.uint8).numpy().reshape(data.shape)
