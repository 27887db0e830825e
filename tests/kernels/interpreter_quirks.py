"""Where Triton's interpreter differs from a GPU launch, and the patches that
let upstream's state kernels run in it unchanged (found on Triton 3.9; each
one names the error or the wrong numbers it fixes).

* **Autotuning.** An ``@triton.autotune`` kernel with several configs is
  benchmarked on first use, which needs a GPU driver ("0 active drivers").
  The interpreter has nothing to time, so every autotuner is pruned to the
  config with the largest blocks (the fewest programs, which is what costs
  time in the interpreter); both runs of a conformance test use that one.
* **Module-level aliases of Triton builtins.** The interpreter gives the
  builtins of ``triton.language`` its own semantics while a kernel runs, but
  FLA's kernels call ``exp``/``log`` through aliases bound at import
  (``exp = tl.exp`` in ``ops/op.py``), which it does not see ("Did you forget
  to add @triton.jit ?"). The patch wraps such aliases in a kernel's globals
  the same way, for the duration of the launch.
* **Python ``range`` loop indices.** A GPU compiles ``for i in range(n)``
  to a loop whose index is a tensor, and FLA's ``chunk_delta_h`` calls
  ``i_t.to(tl.int64)`` on it; the interpreter runs plain Python, where the
  index is an ``int`` ("'int' object has no attribute 'to'"). While a kernel
  runs, ``range`` in its globals yields ints that also have ``.to``.
* **bf16 arithmetic.** The interpreter stores bf16 as its raw ``uint16``
  bits and hands those bits to NumPy's arithmetic (``a * b``, ``tl.sum``,
  ``tl.dot`` of bf16 operands give values around 1e30 or NaN). A GPU
  computes bf16 products exactly and rounds to bf16, so the patch widens bf16
  operands to float32 (bf16 is float32's upper half), computes, and rounds
  float results back to bf16, to nearest even.
* **Integer masks.** The conv kernels build load/store masks from
  ``tl.range`` indices, which the interpreter yields as plain Python ints;
  the mask then arrives as int32 and the interpreter rejects it ("mask has
  unsupported dtype"). A GPU treats any non-zero mask element as true, so
  the patch casts integer masks to bool.
* **Grid callbacks that swap pointer arguments.** ``causal_conv1d_fn``'s grid
  callback puts the metadata's ``batch_ptr``/``token_chunk_offset_ptr``
  tensors back into the launch arguments. The interpreter has already turned
  the arguments into pointer values by then and would receive raw tensors;
  :func:`interpreter_pointer` gives the metadata pointer values to the same
  memory instead.

:func:`apply` is idempotent and process-wide, like the interpreter itself.
"""

from __future__ import annotations

import builtins

import numpy as np
import torch
import triton.language as tl
from triton.runtime import autotuner, interpreter

_applied = False


def apply() -> None:
    """Install the patches (once per process)."""
    global _applied
    if _applied:
        return
    _applied = True
    _prune_autotune_to_largest_blocks()
    _patch_builtin_aliases()
    _accept_integer_masks()
    _compute_bf16_in_float32()
    _no_rocm_probe()


def _no_rocm_probe() -> None:
    """Answer upstream's FlyDSL question (a ROCm gfx950 kernel) with no.

    TurboQuant's attention constructor asks it by importing
    ``vllm.platforms.rocm``, which imports ``vllm._C``; where vLLM's CPU wheel
    has already loaded its AVX-512 build (``_C_AVX512``), that second library
    registers the same ops again and the process aborts. No run here has
    ROCm, so the answer is known.
    """
    from vllm.v1.attention.ops import flydsl_turboquant_decode

    flydsl_turboquant_decode._FLYDSL_AVAILABLE = False


def _block_volume(config) -> int:
    volume = 1
    for value in config.kwargs.values():
        if isinstance(value, int) and not isinstance(value, bool):
            volume *= value
    return volume


def _prune_autotune_to_largest_blocks() -> None:
    def prune_configs(self, kwargs):
        return [max(self.configs, key=_block_volume)]

    autotuner.Autotuner.prune_configs = prune_configs


class _Globals:
    """Attribute access to a globals dict, for the interpreter's patch scope."""

    def __init__(self, names: dict) -> None:
        object.__setattr__(self, "_names", names)

    def __getattr__(self, name: str):
        try:
            return self._names[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value) -> None:
        self._names[name] = value

    def __delattr__(self, name: str) -> None:
        del self._names[name]


class _LoopIndex(int):
    """A loop index that, like a compiled kernel's, can be cast with ``.to``."""

    def to(self, dtype, **kwargs):
        return interpreter._implicit_cvt(int(self)).to(dtype, **kwargs)


def _loop_range(*args):
    return map(_LoopIndex, builtins.range(*args))


#: Patch scope of the kernel launch in progress; device functions it calls
#: register their patches there, so they end with the launch.
_launch_scope = None


def _patch_builtin_aliases() -> None:
    patch_lang = interpreter._patch_lang

    def _patch_lang(fn):
        global _launch_scope
        scope = patch_lang(fn)
        target = _launch_scope if _launch_scope is not None else scope
        names = _Globals(fn.__globals__)
        for name, member in list(fn.__globals__.items()):
            if tl.core.is_builtin(member):
                interpreter._patch_attr(
                    names, name, member, interpreter.interpreter_builder, target
                )
        if fn.__globals__.get("range") is not _loop_range:
            target.set_attr(names, "range", _loop_range)
        if _launch_scope is None:
            _launch_scope = scope
            restore = scope.restore

            def restore_launch() -> None:
                global _launch_scope
                _launch_scope = None
                restore()

            scope.restore = restore_launch
        return scope

    interpreter._patch_lang = _patch_lang


def _as_bool_mask(mask):
    if mask is None or mask.data.dtype == np.bool_:
        return mask
    return interpreter.TensorHandle(mask.data != 0, tl.int1)


def _accept_integer_masks() -> None:
    builder = interpreter.InterpreterBuilder
    store, load = builder.create_masked_store, builder.create_masked_load

    def create_masked_store(self, ptrs, value, mask, *args):
        return store(self, ptrs, value, _as_bool_mask(mask), *args)

    def create_masked_load(self, ptrs, mask, *args):
        return load(self, ptrs, _as_bool_mask(mask), *args)

    builder.create_masked_store = create_masked_store
    builder.create_masked_load = create_masked_load


def interpreter_pointer(tensor: torch.Tensor):
    """The pointer value the interpreter passes a kernel for ``tensor``
    (CPU tensors are not copied, so it addresses the same memory)."""
    return interpreter._implicit_cvt(tensor)


def _is_bf16(handle) -> bool:
    return handle is not None and handle.dtype.scalar == tl.bfloat16


def _widen(handle):
    """A bf16 handle as float32; other handles unchanged."""
    if not _is_bf16(handle):
        return handle
    bits = handle.data.astype(np.uint32) << 16
    return interpreter.TensorHandle(bits.view(np.float32), tl.float32)


def _narrow(data: np.ndarray) -> np.ndarray:
    """float32 values as bf16 bits, rounded to nearest even (as a GPU does)."""
    values = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _bf16_result(handle):
    """Round a float32 result of bf16 operands back to bf16 (bool results,
    i.e. comparisons, stay as they are)."""
    if handle.data.dtype == np.bool_:
        return interpreter.TensorHandle(handle.data, tl.bfloat16)
    return interpreter.TensorHandle(_narrow(handle.data), tl.bfloat16)


def _compute_bf16_in_float32() -> None:
    builder = interpreter.InterpreterBuilder
    binary, unary, ternary = builder.binary_op, builder.unary_op, builder.ternary_op
    fma, dot, rsqrt = builder.create_fma, builder.create_dot, builder.create_rsqrt

    def binary_op(self, lhs, rhs, op):
        if not (_is_bf16(lhs) or _is_bf16(rhs)):
            return binary(self, lhs, rhs, op)
        return _bf16_result(binary(self, _widen(lhs), _widen(rhs), op))

    def unary_op(self, arg, op):
        if not _is_bf16(arg):
            return unary(self, arg, op)
        return _bf16_result(unary(self, _widen(arg), op))

    def ternary_op(self, lhs, rhs, other, op):
        if op is np.where or not _is_bf16(other):
            return ternary(self, lhs, rhs, other, op)
        return _bf16_result(ternary(self, _widen(lhs), _widen(rhs), _widen(other), op))

    def create_fma(self, x, y, z):
        if not _is_bf16(z):
            return fma(self, x, y, z)
        return _bf16_result(fma(self, _widen(x), _widen(y), _widen(z)))

    def create_rsqrt(self, arg):
        if not _is_bf16(arg):
            return rsqrt(self, arg)
        return _bf16_result(rsqrt(self, _widen(arg)))

    def create_dot(self, a, b, d, *args):
        return dot(self, _widen(a), _widen(b), d, *args)

    builder.binary_op = binary_op
    builder.unary_op = unary_op
    builder.ternary_op = ternary_op
    builder.create_fma = create_fma
    builder.create_rsqrt = create_rsqrt
    builder.create_dot = create_dot
    _reduce_bf16_in_float32()


def _reduce_bf16_in_float32() -> None:
    reduce_ops = interpreter.ReduceOps
    total, min_max = reduce_ops.sum, reduce_ops.min_max

    def as_float32(tensor):
        handle = _widen(tensor.handle)
        return tl.core.tensor(handle, tensor.type.with_element_ty(tl.float32))

    def as_bf16(tensor):
        data = _narrow(tensor.handle.data)
        return tl.core.tensor(
            interpreter.TensorHandle(data, tl.bfloat16),
            tensor.type.with_element_ty(tl.bfloat16),
        )

    def sum_(self, input):
        if input.dtype.scalar != tl.bfloat16:
            return total(self, input)
        return as_bf16(total(self, as_float32(input)))

    def min_max_(self, input, val_reduce_op, idx_reduce_op=None):
        value = input[0] if isinstance(input, tuple) else input
        if value.dtype.scalar != tl.bfloat16:
            return min_max(self, input, val_reduce_op, idx_reduce_op)
        ret = min_max(self, as_float32(value), val_reduce_op, idx_reduce_op)
        if isinstance(ret, tuple):
            return as_bf16(ret[0]), ret[1]
        return as_bf16(ret) if val_reduce_op else ret

    reduce_ops.sum = sum_
    reduce_ops.min_max = min_max_
