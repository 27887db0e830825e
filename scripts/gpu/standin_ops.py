"""PyTorch forms of the compiled vLLM ops a served hybrid MoE model calls on CUDA.

A device run imports vLLM's Python tree without its compiled extensions
(``sitedir``). Most of a Qwen3.5/3.6-shaped model then runs Triton kernels
or the PyTorch forms of vLLM's custom ops, but a few calls go straight to
compiled ops with no Python path:

* the MoE router's ``_moe_C::topk_softmax`` (softmax over the experts, the
  top k, optionally renormalized);
* ``_moe_C::moe_align_block_size`` (the routed rows sorted by expert and
  padded per expert to the Triton MoE kernel's block);
* ``_moe_C::moe_sum`` (the top-k expert outputs of a token added up);
* ``_C::silu_and_mul`` and its kin, which the MoE activation calls
  directly;
* ``_C::get_cuda_view_from_cpu_tensor``, with which Model Runner V2 reads
  pinned host buffers from the GPU (unified addressing); it needs the GPU
  machine's CuPy for the device pointer, so only a GPU run can check it.

:func:`register` gives each a PyTorch implementation under the op's own
schema, registered for every device (``CompositeExplicitAutograd``), so the
same code runs in the CPU rehearsal, where tests check each against a
reference, and on the GPU. None of it is graph-hostile: no host
synchronisation and no data-dependent shapes, so CUDA graphs can capture
it. It is part of one run's stand-in tree only, never of the package.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Gated activations: ``out = act(x[..., :d]) * x[..., d:]`` (or, for
#: ``mul_and_silu``, ``x[..., :d] * silu(x[..., d:])``).
ACTIVATIONS = {
    "silu_and_mul": lambda gate, up: F.silu(gate) * up,
    "mul_and_silu": lambda gate, up: gate * F.silu(up),
    "gelu_and_mul": lambda gate, up: F.gelu(gate) * up,
    "gelu_tanh_and_mul": lambda gate, up: F.gelu(gate, approximate="tanh") * up,
}

MOE_SCHEMAS = {
    "topk_softmax": (
        "topk_softmax(Tensor(a!) topk_weights, Tensor(b!) topk_ids, "
        "Tensor(c!) token_expert_indices, Tensor gating_output, bool renormalize, "
        "Tensor? e_score_correction_bias=None, Tensor? is_padding=None) -> ()"
    ),
    "moe_align_block_size": (
        "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, "
        "Tensor(a!) sorted_token_ids, Tensor(b!) experts_ids, "
        "Tensor(c!) num_tokens_post_pad, Tensor? expert_map=None, "
        "Tensor(d!)? scatter_idx=None) -> ()"
    ),
    "moe_sum": (
        "moe_sum(Tensor input, Tensor(a!) output, Tensor? topk_ids=None, "
        "Tensor? expert_map=None) -> ()"
    ),
}


def gated(name: str):
    """``_C::<name>(out, input)`` for one gated activation."""
    act = ACTIVATIONS[name]

    def call(out: torch.Tensor, x: torch.Tensor) -> None:
        d = x.shape[-1] // 2
        out.copy_(act(x[..., :d].float(), x[..., d:].float()).to(out.dtype))

    return call


def topk_softmax(
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    token_expert_indices: torch.Tensor,
    gating_output: torch.Tensor,
    renormalize: bool,
    e_score_correction_bias: torch.Tensor | None = None,
    is_padding: torch.Tensor | None = None,
) -> None:
    """Softmax over the experts in float32, the top ``k`` (a correction
    bias, when given, chooses the experts but not their weights), weights
    renormalized to sum to 1 if asked. ``token_expert_indices[t, j]`` is
    the row ``j * tokens + t`` the fused kernels expect."""
    tokens, k = topk_ids.shape
    probs = torch.softmax(gating_output.float(), dim=-1)
    scores = (
        probs if e_score_correction_bias is None else probs + e_score_correction_bias
    )
    ids = torch.topk(scores, k, dim=-1).indices
    weights = probs.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    topk_weights.copy_(weights.to(topk_weights.dtype))
    topk_ids.copy_(ids.to(topk_ids.dtype))
    rows = torch.arange(tokens, device=ids.device).unsqueeze(1)
    cols = torch.arange(k, device=ids.device).unsqueeze(0) * tokens
    token_expert_indices.copy_((rows + cols).to(token_expert_indices.dtype))


def moe_align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    scatter_idx: torch.Tensor | None = None,
) -> None:
    """Routed rows (flattened ``topk_ids``) grouped by expert, in row order
    within an expert, each expert's group padded to a multiple of
    ``block_size`` with the row count as filler; ``experts_ids[b]`` is the
    expert of block ``b`` (-1 past the last block), ``num_tokens_post_pad``
    the padded total. With ``expert_map``, routes to experts mapped to -1
    take no place and blocks carry the local expert id."""
    flat = topk_ids.reshape(-1).long()
    rows = flat.numel()
    device = flat.device
    valid = (flat >= 0) & (flat < num_experts)
    local = torch.arange(num_experts, device=device)
    if expert_map is not None:
        mapped = expert_map.long()[flat.clamp(0, num_experts - 1)]
        valid &= mapped >= 0
        local = expert_map.long()
    # invalid routes go to an extra bucket past the last expert
    bucket = torch.where(valid, flat, torch.full_like(flat, num_experts))
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    counts = counts[:num_experts]
    padded = (counts + block_size - 1) // block_size * block_size
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    # rank of each row within its expert, rows in their original order
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    first = torch.cumsum(
        torch.cat([counts.new_zeros(1), counts]), 0
    )  # where each bucket starts in ``order``
    rank = torch.arange(rows, device=device) - first[sorted_bucket]
    starts_ext = torch.cat([starts, starts.new_zeros(1)])
    dest = starts_ext[sorted_bucket] + rank
    # invalid rows land in one spare slot past the end, dropped below
    spare = sorted_token_ids.numel()
    dest = torch.where(sorted_bucket < num_experts, dest, torch.full_like(dest, spare))
    out = torch.full((spare + 1,), rows, dtype=torch.long, device=device)
    out.scatter_(0, dest, order)
    sorted_token_ids.copy_(out[:spare].to(sorted_token_ids.dtype))
    blocks = torch.arange(experts_ids.numel(), device=device) * block_size
    expert_of_block = torch.searchsorted(ends, blocks, right=True)
    inside = expert_of_block < num_experts
    block_expert = local[expert_of_block.clamp(max=num_experts - 1)]
    block_expert = torch.where(inside, block_expert, torch.full_like(block_expert, -1))
    experts_ids.copy_(block_expert.to(experts_ids.dtype))
    num_tokens_post_pad.copy_(ends[-1:].to(num_tokens_post_pad.dtype))
    if scatter_idx is not None:
        identity = torch.arange(rows, device=device)
        masked = torch.where(valid, identity, torch.full_like(identity, -1))
        scatter_idx.copy_(masked.view(-1, 1).to(scatter_idx.dtype))


def moe_sum(
    input: torch.Tensor,
    output: torch.Tensor,
    topk_ids: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
) -> None:
    """``output[t] = sum_j input[t, j]``; with ``expert_map``, only the
    routes to experts this rank holds."""
    values = input.float()
    if topk_ids is not None and expert_map is not None:
        keep = expert_map.long()[topk_ids.long()] >= 0
        values = values * keep.unsqueeze(-1)
    output.copy_(values.sum(dim=1).to(output.dtype))


def get_cuda_view_from_cpu_tensor(cpu_tensor: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over the same bytes as the pinned ``cpu_tensor``:
    pinned host memory is mapped into the GPU's address space, and CuPy
    hands out its device pointer (PyTorch has no public call for it)."""
    if cpu_tensor.numel() == 0:
        return torch.empty(cpu_tensor.shape, dtype=cpu_tensor.dtype, device="cuda")
    if not cpu_tensor.is_pinned():
        raise ValueError("get_cuda_view_from_cpu_tensor needs pinned memory")
    import cupy

    span = 1 + sum(
        (n - 1) * s for n, s in zip(cpu_tensor.shape, cpu_tensor.stride(), strict=True)
    )
    nbytes = span * cpu_tensor.element_size()
    pointer = cupy.cuda.runtime.hostGetDevicePointer(cpu_tensor.data_ptr(), 0)
    memory = cupy.cuda.UnownedMemory(pointer, nbytes, cpu_tensor)
    raw = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))
    view = torch.as_tensor(raw, device="cuda").view(cpu_tensor.dtype)
    return view.as_strided(cpu_tensor.shape, cpu_tensor.stride())


MOE_OPS = {
    "topk_softmax": topk_softmax,
    "moe_align_block_size": moe_align_block_size,
    "moe_sum": moe_sum,
}

_LIBRARIES: list = []


def register(c_library=None) -> list[str]:
    """Implement the gated activations on ``c_library`` (the stand-in's
    ``_C`` fragment, where they are already declared; None leaves ``_C``
    alone) and define and implement the MoE ops in a ``_moe_C`` fragment;
    returns the op names."""
    names = []
    for name in ACTIVATIONS if c_library is not None else ():
        c_library.impl(name, gated(name), "CompositeExplicitAutograd")
        names.append(f"_C::{name}")
    if c_library is not None:
        c_library.define("get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor")
        c_library.impl(
            "get_cuda_view_from_cpu_tensor",
            get_cuda_view_from_cpu_tensor,
            "CompositeExplicitAutograd",
        )
        names.append("_C::get_cuda_view_from_cpu_tensor")
    moe = torch.library.Library("_moe_C", "FRAGMENT")
    _LIBRARIES.append(moe)
    for name, schema in MOE_SCHEMAS.items():
        moe.define(schema)
        moe.impl(name, MOE_OPS[name], "CompositeExplicitAutograd")
    return names + [f"_moe_C::{n}" for n in MOE_OPS]
