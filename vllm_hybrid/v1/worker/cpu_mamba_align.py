"""Align mode's speculative-decoding state copies, for CPUs without Triton.

With speculative decoding (n-gram, EAGLE, MTP) and prefix caching, align mode
moves each request's recurrent state between block columns with two fused
Triton kernels of ``vllm/v1/worker/mamba_utils.py``: a pre-copy before the
forward pass (the state a request left in its previous column goes to the
column it now writes) and a post-process after it (once the accepted tokens
are known, the state of the last accepted position is saved at the block
edge it reached). vLLM's CPU platform, which has no Triton, registers host
implementations for the other kernels the V1 worker launches (among them the
non-speculative ``batch_memcpy_kernel``) but not for these two, so a hybrid
model with speculative decoding and prefix caching fails at the first step on
CPU: ``'function' object is not subscriptable``.

This module holds host implementations with the kernels' launch interface,
and the launchers that replace the two kernel symbols: ``kernel[grid]``
gives upstream's Triton launch wherever Triton runs and the host version
everywhere else.
Both kernels work on raw addresses, as the Triton code does: every state
tensor is described by its base address, block stride, element size, inner
size (elements per block, or per token for conv states) and conv width (0
for temporal states), and each Mamba group's block table by the address of
its int32 ``[max_reqs, max_blocks]`` tensor. On a CPU all of them are host
memory, so the copies are ``memmove`` calls between those addresses.

One copy of state ``s`` for a request moves

* a conv state (width > 0) by ``bias`` tokens: tokens ``bias..width-1`` of
  the source block become tokens ``0..width-bias-1`` of the destination
  (per conv-dim row when the layout is dim-first, "DS");
* a temporal state whole, taken from column ``src + bias`` (the state of the
  last accepted speculative position).

``memmove`` keeps left shifts within one block correct, which the Triton
code gets by copying tokens in ascending order.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from vllm_hybrid.patches.registry import upstream_of

_INT32 = ctypes.sizeof(ctypes.c_int32)


def _ints(values: Any) -> list[int]:
    """A launch argument (tensor, or None) as a list of Python ints."""
    if values is None:
        return []
    if isinstance(values, torch.Tensor):
        return [int(v) for v in values.tolist()]
    return [int(v) for v in values]


@dataclass(frozen=True)
class StateLayout:
    """The flattened state metadata a fused kernel receives, read once per
    launch. Index ``s`` is one (layer, state) tensor."""

    block_table_addrs: list[int]
    block_table_stride: int
    base_addrs: list[int]
    block_strides: list[int]
    elem_sizes: list[int]
    inner_sizes: list[int]
    conv_widths: list[int]
    group_of: list[int]
    dim_rows: list[int]
    dim_row_strides: list[int]
    conv_dim_first: bool

    @property
    def num_states(self) -> int:
        return len(self.base_addrs)

    def block_id(self, state: int, row: int, column: int) -> int:
        """Block id at ``column`` of ``row`` in the block table of the group
        that ``state`` belongs to."""
        table = self.block_table_addrs[self.group_of[state]]
        address = table + (row * self.block_table_stride + column) * _INT32
        return ctypes.c_int32.from_address(address).value

    def block_addr(self, state: int, block_id: int) -> int:
        return self.base_addrs[state] + block_id * self.block_strides[state]

    def copy(self, state: int, row: int, src_col: int, dst_col: int, bias: int) -> None:
        """Copy one state of request ``row`` from ``src_col`` to ``dst_col``
        with accepted-token bias ``bias`` (see the module docstring)."""
        dst = self.block_addr(state, self.block_id(state, row, dst_col))
        elem = self.elem_sizes[state]
        width = self.conv_widths[state]
        if width == 0:
            src = self.block_addr(state, self.block_id(state, row, src_col + bias))
            ctypes.memmove(dst, src, self.inner_sizes[state] * elem)
            return
        src = self.block_addr(state, self.block_id(state, row, src_col))
        kept = width - bias
        if self.conv_dim_first:
            stride = self.dim_row_strides[state]
            for r in range(self.dim_rows[state]):
                ctypes.memmove(
                    dst + r * stride, src + r * stride + bias * elem, kept * elem
                )
            return
        token_bytes = self.inner_sizes[state] * elem
        ctypes.memmove(dst, src + bias * token_bytes, kept * token_bytes)


#: Launch arguments describing the state layout, in StateLayout's order.
_LAYOUT_ARGS = (
    "block_table_ptrs_ptr",
    "block_table_stride_req",
    "state_base_addrs_ptr",
    "state_block_strides_ptr",
    "state_elem_sizes_ptr",
    "state_inner_sizes_ptr",
    "state_conv_widths_ptr",
    "state_group_indices_ptr",
    "state_dim_row_count_ptr",
    "state_dim_row_stride_ptr",
)


def _layout(launch: dict[str, Any]) -> StateLayout:
    """The state layout from a kernel's launch arguments (by name)."""
    tables, stride, *per_state = (launch[name] for name in _LAYOUT_ARGS)
    return StateLayout(
        _ints(tables),
        int(stride),
        *(_ints(values) for values in per_state),
        conv_dim_first=bool(launch["CONV_STATE_DIM_FIRST"]),
    )


def _rows(num_reqs: Any, idx_mapping_ptr: Any, has_idx_mapping: bool) -> list[int]:
    """Block-table rows of the batch, in batch order; -1 means skip."""
    n = int(num_reqs)
    if has_idx_mapping and idx_mapping_ptr is not None:
        return _ints(idx_mapping_ptr)[:n]
    return list(range(n))


# The parameters below are the Triton kernels' own, in their order: upstream
# launches pass most arguments by position and the constexprs by name, and
# _layout reads the layout arguments by name.


def precopy_mamba_align_fused(
    mamba_state_idx_ptr,
    src_col_ptr,
    token_bias_ptr,
    block_table_ptrs_ptr,
    block_table_stride_req,
    state_base_addrs_ptr,
    state_block_strides_ptr,
    state_elem_sizes_ptr,
    state_inner_sizes_ptr,
    state_conv_widths_ptr,
    state_group_indices_ptr,
    state_dim_row_count_ptr,
    state_dim_row_stride_ptr,
    idx_mapping_ptr,
    num_reqs,
    COPY_BLOCK_SIZE=None,
    CONV_STATE_DIM_FIRST=False,
    HAS_IDX_MAPPING=True,
    TEMPORAL_TILES=1,
) -> None:
    """Host twin of ``precopy_mamba_align_fused_kernel``: each request whose
    running state sits in another column than the one it writes now (and is
    not fresh, column -1) gets every state copied there first."""
    layout = _layout(locals())
    dst_cols, src_cols = _ints(mamba_state_idx_ptr), _ints(src_col_ptr)
    biases = _ints(token_bias_ptr)
    for row in _rows(num_reqs, idx_mapping_ptr, HAS_IDX_MAPPING):
        if row < 0:
            continue
        src, dst = src_cols[row], dst_cols[row]
        if src < 0 or src == dst:
            continue
        for state in range(layout.num_states):
            layout.copy(state, row, src, dst, biases[row])


def postprocess_mamba_fused(
    num_accepted_tokens_ptr,
    mamba_state_idx_ptr,
    num_scheduled_tokens_ptr,
    num_computed_tokens_ptr,
    num_draft_tokens_ptr,
    block_table_ptrs_ptr,
    block_table_stride_req,
    state_base_addrs_ptr,
    state_block_strides_ptr,
    state_elem_sizes_ptr,
    state_inner_sizes_ptr,
    state_conv_widths_ptr,
    state_group_indices_ptr,
    state_dim_row_count_ptr,
    state_dim_row_stride_ptr,
    num_accepted_tokens_out_ptr,
    idx_mapping_ptr,
    num_reqs,
    block_size,
    COPY_BLOCK_SIZE=None,
    CONV_STATE_DIM_FIRST=False,
    HAS_IDX_MAPPING=False,
    PRECOMPUTED_NEW_COMPUTED=False,
    TEMPORAL_TILES=1,
) -> None:
    """Host twin of ``postprocess_mamba_fused_kernel``.

    After a step with draft tokens a request's state is kept at the last
    block edge its accepted tokens reached, if they reached one past the
    tokens its running state covers: the copy goes to the column ending on
    that edge, with bias = edge - running tokens. A request whose state
    stays in its column gets an accepted-token count of 1 in
    ``num_accepted_tokens_out_ptr`` (the caller pre-fills the others).
    """
    layout = _layout(locals())
    block = int(block_size)
    accepted_of = _ints(num_accepted_tokens_ptr)
    src_cols = _ints(mamba_state_idx_ptr)
    computed_of = _ints(num_computed_tokens_ptr)
    scheduled_of = _ints(num_scheduled_tokens_ptr)
    drafts_of = _ints(num_draft_tokens_ptr)
    for row in _rows(num_reqs, idx_mapping_ptr, HAS_IDX_MAPPING):
        if row < 0:
            continue
        accepted = accepted_of[row]
        if PRECOMPUTED_NEW_COMPUTED:
            new_computed = computed_of[row]
            running = new_computed - accepted + 1
        else:
            running = computed_of[row] + scheduled_of[row] - drafts_of[row]
            new_computed = running + accepted - 1
        edge = new_computed // block * block
        if edge < running:
            continue
        bias = edge - running
        src, dst = src_cols[row], edge // block - 1
        if src == dst:
            num_accepted_tokens_out_ptr[row] = 1
            if bias == 0:
                continue
        for state in range(layout.num_states):
            layout.copy(state, row, src, dst, bias)


class HostFallbackKernel:
    """Stands in for one of upstream's Triton kernels: ``self[grid]`` is
    ``triton_kernel``'s launch when Triton can run in this process, else
    ``host`` (called with the launch arguments, grid ignored)."""

    def __init__(self, triton_kernel: Any, host: Any) -> None:
        self.triton_kernel = triton_kernel
        self.host = host

    def __getitem__(self, grid: Any) -> Any:
        from vllm.triton_utils import HAS_TRITON

        if HAS_TRITON:
            return self.triton_kernel[grid]
        return self.host

    def __repr__(self) -> str:
        return f"HostFallbackKernel({self.host.__name__})"


precopy_mamba_align_fused_kernel = HostFallbackKernel(
    upstream_of(__name__, "precopy_mamba_align_fused_kernel"),
    precopy_mamba_align_fused,
)
postprocess_mamba_fused_kernel = HostFallbackKernel(
    upstream_of(__name__, "postprocess_mamba_fused_kernel"),
    postprocess_mamba_fused,
)
