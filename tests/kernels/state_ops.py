"""Shared plumbing for the state-kernel ops: the Triton entry points, the
conv kernel's batch metadata, and a memo for kernels that never see a view.

The ops themselves (``gdn_ops``, ``mamba2_ops``, ``align_copy_ops``) call
upstream's kernels with the arguments the model layers build on CUDA, so a
conformance test exercises the same calls a pooled worker makes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from functools import wraps
from types import SimpleNamespace

import torch
from arena_views import DEVICE
from triton_variants import load_triton_variant

#: Kernels run in Triton's interpreter (no CUDA device), not compiled.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

causal_conv1d = load_triton_variant(
    "vllm.model_executor.layers.mamba.ops.causal_conv1d"
)
mamba_ssm = load_triton_variant("vllm.model_executor.layers.mamba.ops.mamba_ssm")
ssd_combined = load_triton_variant("vllm.model_executor.layers.mamba.ops.ssd_combined")


def query_start_loc(lens: list[int]) -> torch.Tensor:
    """``[0, l0, l0+l1, ...]`` as int32 on the CPU (the builders keep a CPU
    copy next to the device one)."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def conv_metadata(query_start_loc_cpu: torch.Tensor) -> SimpleNamespace:
    """What ``causal_conv1d_fn`` reads from the attention metadata, built by
    upstream's helper as the GDN and Mamba2 builders do.

    ``causal_conv1d_fn``'s grid callback puts the metadata's pointer tensors
    into the launch arguments; in the interpreter they must already be
    interpreter pointers (to the same memory)."""
    from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata

    nums, batch_ptr, offset_ptr = compute_causal_conv1d_metadata(
        query_start_loc_cpu, device=DEVICE
    )
    if INTERPRETING:
        import interpreter_quirks

        for entry in nums.values():
            for key in ("batch_ptr", "token_chunk_offset_ptr"):
                entry[key] = interpreter_quirks.interpreter_pointer(entry[key])
    return SimpleNamespace(
        nums_dict=nums, batch_ptr=batch_ptr, token_chunk_offset_ptr=offset_ptr
    )


def _digest(value, h) -> None:
    if isinstance(value, torch.Tensor):
        h.update(repr((value.shape, value.stride(), value.dtype)).encode())
        data = value.detach().contiguous().cpu()
        h.update(data.view(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, (list, tuple)):
        for item in value:
            _digest(item, h)
    else:
        h.update(repr(value).encode())


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    return value


def same_inputs_same_outputs(fn: Callable) -> Callable:
    """Reuse ``fn``'s outputs when called again with bitwise equal inputs.

    For kernels that never see a state view: the layers gather initial states
    into a dense tensor first (``ssm_state[ids]``) and scatter the final
    states back afterwards, so the chunked prefill kernels get equal inputs
    in the pooled and the twin run, and in every boundary case. Reading and
    writing the views is the layer's indexing, which still runs each time;
    if the gathered states differ, the inputs differ and the kernel runs."""
    cache: dict[bytes, object] = {}

    @wraps(fn)
    def wrapper(*args, **kwargs):
        h = hashlib.blake2b(digest_size=20)
        _digest(list(args), h)
        _digest(sorted(kwargs.items(), key=lambda kv: kv[0]), h)
        key = h.digest()
        if key not in cache:
            cache[key] = _clone(fn(*args, **kwargs))
        return _clone(cache[key])

    return wrapper


def seeded(
    shape: tuple[int, ...], seed: int, *, scale: float = 1.0, dtype=torch.bfloat16
):
    """Deterministic normal values on :data:`DEVICE`."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


def conv_view(conv_state: torch.Tensor) -> torch.Tensor:
    """``(..., dim, state_len)`` as the conv kernels want it: the default SD
    layout stores ``(state_len, dim)``, so the layers transpose."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return conv_state if is_conv_state_dim_first() else conv_state.transpose(-1, -2)
