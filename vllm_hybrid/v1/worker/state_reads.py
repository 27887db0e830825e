"""Prefill chunks that read their checkpoint in one state block and write the
advanced state into another, so that keeping the checkpoint costs no copy.

Align mode keeps a request's recurrent state at each state block edge it
crosses: before the step the runner copies the running state from the block
of the request's last computed token (the *read* column, ``(computed - 1) //
block_size``) into the block the step ends in (the *write* column,
``(seq_len - 1) // block_size``) and the layer advances the copy in place.
With pooled mode's 16-token state blocks most copies are made before prefill
chunks that continue from a kept checkpoint (a prefill checkpoint, the
prompt's end, a prefix hit), each moving the whole state (61.4 MiB for
Qwen3.6-35B-A3B).

A prefill chunk needs no copy: the gated-DeltaNet layer gathers the chunk's
initial states and scatters its final states itself, and its conv kernel
reads one block column and writes another in its prefix-caching form, as
long as the chunk is at least as long as the conv state (``width - 1``
tokens: a shorter chunk's conv state is shifted where it was read,
``tests/kernels/test_state_out_of_place.py``). One rule, used by the runner
that drops the copy and by the metadata builder that hands the layer the
read blocks, decides which rows read out of place (:func:`reads_elsewhere`).

Decode steps read out of place too, in batches of decodes only: the conv
update kernel takes the same prefix-caching form and the recurrent decode
kernel upstream's speculative-decoding form (read column, write column), so
a decode that crosses into a kept checkpoint's block (the turn end) needs no
copy either. Such batches then run the unpacked decode kernel instead of the
packed one (both upstream's). Decode rows of a batch with prefills, and
chunks of one or two tokens, keep align mode's copy.

Where it applies (:func:`reads_out_of_place`): pooled mode on CUDA, align
mode, no speculative decoding (whose rows read at an accepted-token offset).
The runner drops copies only when every state layer of the model is one
whose core reads out of place (Qwen3.5/3.6 and Qwen3-Next gated DeltaNet).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec


def min_chunk_tokens(conv_state_shape: tuple[int, ...], dim_first: bool) -> int:
    """Shortest chunk that may read out of place: the conv state's length in
    tokens (kernel width - 1), at least two so that no decode row qualifies.
    ``conv_state_shape`` is the per-block conv state shape, ``(dim, width -
    1)`` when ``dim_first`` else ``(width - 1, dim)``."""
    state_len = conv_state_shape[-1] if dim_first else conv_state_shape[0]
    return max(2, int(state_len))


def spec_min_chunk_tokens(spec: MambaSpec) -> int:
    """:func:`min_chunk_tokens` of a state group's spec, in the conv state
    layout this process uses."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return min_chunk_tokens(tuple(spec.shapes[0]), is_conv_state_dim_first())


def reads_elsewhere(
    computed: torch.Tensor,
    query_lens: torch.Tensor,
    min_tokens: int,
    decode_only: bool | torch.Tensor = False,
) -> torch.Tensor:
    """Per row, whether this step reads its state out of place: a chunk of at
    least ``min_tokens`` tokens continuing from computed tokens, or, in a
    batch of decodes only (``decode_only``), any decode row."""
    continues = computed > 0
    decoding = (query_lens == 1) & decode_only
    return continues & ((query_lens >= min_tokens) | decoding)


def decode_only_batch(computed: torch.Tensor, query_lens: torch.Tensor) -> torch.Tensor:
    """Whether every row with tokens is a one-token step continuing from
    computed tokens: the metadata builder's batch without prefills (a fresh
    one-token prompt counts as a prefill there). On the tensors' device,
    no host sync."""
    scheduled = query_lens > 0
    decode = (query_lens == 1) & (computed > 0)
    return (decode | ~scheduled).all() & scheduled.any()


def read_columns(
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    block_size: int,
    min_tokens: int,
    decode_only: bool = False,
) -> torch.Tensor:
    """Per row, the block column the step reads its state from: the column of
    the last computed token for rows that read elsewhere, else the column it
    writes (that of its last token, as upstream's state indices)."""
    computed = seq_lens - query_lens
    write = ((seq_lens - 1) // block_size).clamp(min=0)
    read = ((computed - 1) // block_size).clamp(min=0)
    elsewhere = reads_elsewhere(computed, query_lens, min_tokens, decode_only)
    return torch.where(elsewhere, read, write)


def read_state_ids(block_table: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """The block id each row reads, from its group's (batch-ordered) table."""
    rows = block_table[: columns.shape[0]]
    return torch.gather(rows, 1, columns.long().unsqueeze(1)).squeeze(1)


def reads_out_of_place(vllm_config: VllmConfig, cuda: bool | None = None) -> bool:
    """Whether this engine's steps may read their state out of place (module
    docstring): pooled mode, CUDA, align mode, no speculative decoding.
    ``cuda`` stands for the platform (the simulator models a CUDA engine on
    a CPU); None asks the platform."""
    from vllm.platforms import current_platform

    from vllm_hybrid.v1.core.pooled.scope import pooled_mode_decision

    if cuda is None:
        cuda = current_platform.is_cuda()
    cache = vllm_config.cache_config
    return (
        cuda
        and vllm_config.speculative_config is None
        and getattr(cache, "mamba_cache_mode", None) == "align"
        and pooled_mode_decision(vllm_config).enabled
    )


def copy_free_chunk_tokens(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cuda: bool | None = None
) -> int | None:
    """The shortest prefill chunk whose align copy Model Runner V2 drops on
    this engine, or None where it drops none: a pooled config whose prefill
    rows read out of place and whose state groups are all gated-DeltaNet
    groups (the longest conv state of them decides). The runner also checks
    the model's layers; the simulator, which has none, stops here."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_hybrid.v1.core.pooled.spec import PooledKVCacheConfig

    if not isinstance(kv_cache_config, PooledKVCacheConfig):
        return None
    if not reads_out_of_place(vllm_config, cuda):
        return None
    specs = [
        group.kv_cache_spec
        for group in kv_cache_config.kv_cache_groups
        if isinstance(group.kv_cache_spec, MambaSpec)
    ]
    gdn = MambaAttentionBackendEnum.GDN_ATTN
    if not specs or any(spec.mamba_type is not gdn for spec in specs):
        return None
    return max(spec_min_chunk_tokens(spec) for spec in specs)
