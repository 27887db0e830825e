"""Registry entries for prefill chunks that read their state out of place
(:mod:`vllm_hybrid.v1.worker.state_reads`): the metadata builder names the
read blocks, the Qwen gated-DeltaNet core reads them, Model Runner V2's
pre-copy drops those rows' copies. Part of
:data:`vllm_hybrid.patches.entries.PATCHES`; the attributes they add are in
:mod:`vllm_hybrid.patches.subclasses`."""

from __future__ import annotations

from vllm_hybrid.patches.entry import AddedAttribute, PatchEntry, PrivateAttribute

_WHY_COPIES = (
    "Align mode copies a request's whole recurrent state (61 MiB for "
    "Qwen3.6-35B-A3B) into the block a step ends in whenever the step starts "
    "from a kept checkpoint in another block; with pooled mode's 16-token "
    "state blocks most such copies come before prefill chunks (85% of the "
    "copies on the first 1,000 Mooncake requests at 80 GB turboquant_k8v4). "
    "A prefill chunk can read the checkpoint's block and write the other "
    "instead, with upstream's kernels unchanged; "
)

STATE_READ_PATCHES: list[PatchEntry] = [
    PatchEntry(
        target="vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadataBuilder.build",
        replacement="vllm_hybrid.v1.attention.backends.gdn_reads:build",
        bindings=(),
        why=_WHY_COPIES
        + (
            "the layer learns which block to read only from its metadata, "
            "which names one block per row."
        ),
        how=(
            "Class attribute replaced; the replacement calls upstream's build "
            "unchanged and, on engines whose prefill chunks read out of place "
            "(pooled mode, CUDA, align mode, no speculative decoding) and for "
            "batches without speculative rows, adds read_state_columns and "
            "read_state_indices to the metadata (for a batch of decodes only "
            "that full CUDA graphs replay, in a buffer of the builder's beside "
            "its write-id buffer)."
        ),
        upstream_status="none",
        removal=(
            "When upstream's gated-DeltaNet layer reads and writes a prefill "
            "row's state in two blocks of its own accord."
        ),
        placement="after",
    ),
    PatchEntry(
        target=(
            "vllm.v1.attention.backends.gdn_attn:"
            "GDNAttentionMetadataBuilder.update_block_table"
        ),
        replacement="vllm_hybrid.v1.attention.backends.gdn_reads:update_block_table",
        bindings=(),
        why=(
            "Both runners build one state group's metadata and re-gather the "
            "state ids for the other groups with update_block_table, which "
            "makes a new metadata object from its dataclass fields: the read "
            "blocks added by the build entry would be lost."
        ),
        how=(
            "Class attribute replaced; upstream's method runs unchanged, then "
            "the read columns are carried over and their block ids looked up "
            "in the group's table."
        ),
        upstream_status="none",
        removal="With the build entry.",
        placement="after",
    ),
    PatchEntry(
        target=(
            "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:"
            "QwenGatedDeltaNetAttention._forward_core"
        ),
        replacement="vllm_hybrid.model_executor.layers.mamba.gdn_out_of_place:forward_core",
        bindings=(),
        why=_WHY_COPIES
        + (
            "upstream's core reads and writes the one block its metadata "
            "names, and its conv call does not pass the prefix-caching "
            "arguments that read one column and write another."
        ),
        how=(
            "Class attribute replaced (its callers, the custom ops and the "
            "fused-norm core, call it through self). Batches whose metadata "
            "carries read_state_indices and has no speculative rows run the "
            "overlay's core, which calls upstream's kernels: with prefills, "
            "the conv in its prefix-caching form, decode rows in place, "
            "prefill states gathered from the read blocks and scattered to "
            "the write blocks; decodes only, the conv update in its "
            "prefix-caching form and the unpacked recurrent update in its "
            "speculative-decoding form (read column, write column). Every "
            "other batch runs upstream's core."
        ),
        upstream_status="none",
        removal="With the build entry.",
        placement="top",
    ),
    PatchEntry(
        target=(
            "vllm.v1.worker.gpu.model_states.mamba_hybrid:"
            "MambaHybridModelState.preprocess_state"
        ),
        replacement="vllm_hybrid.v1.worker.mamba_copies:preprocess_state",
        bindings=(),
        why=_WHY_COPIES
        + (
            "Model Runner V2's fused pre-copy still copies, and its launch "
            "sees neither the chunk lengths nor the config."
        ),
        how=(
            "Class attribute replaced; on a pooled config whose rows read out "
            "of place the replacement hands the pre-copy context each batch "
            "row's scheduled tokens (pooled_query_lens, a device tensor, "
            "cleared after the call) and the shortest chunk that reads out "
            "of place, then calls upstream's method unchanged; the "
            "run_fused_precopy entry drops the copies of the rows that read "
            "out of place when every state layer is a Qwen gated-DeltaNet "
            "layer."
        ),
        upstream_status="none",
        removal="With the build entry.",
        placement="body",
    ),
]

STATE_READ_ATTRIBUTES: list[AddedAttribute] = [
    AddedAttribute(
        cls="vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadata",
        name="read_state_columns",
        where="vllm_hybrid.v1.attention.backends.gdn_reads (build)",
        why="Per non-speculative row, the state block column the step reads.",
        annotation="torch.Tensor | None",
    ),
    AddedAttribute(
        cls="vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadata",
        name="read_state_indices",
        where="vllm_hybrid.v1.attention.backends.gdn_reads (build)",
        why="Per non-speculative row, the state block id the step reads.",
        annotation="torch.Tensor | None",
    ),
    AddedAttribute(
        cls="vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadataBuilder",
        name="read_min_tokens",
        where="vllm_hybrid.v1.attention.backends.gdn_reads (_min_tokens)",
        why="The shortest chunk that reads out of place, or None; once per builder.",
        annotation="int | None",
    ),
    AddedAttribute(
        cls="vllm.v1.worker.gpu.model_states.mamba_hybrid:MambaHybridModelState",
        name="read_min_tokens",
        where="vllm_hybrid.v1.worker.mamba_copies (_min_chunk_tokens)",
        why="The same, once per V2 model state.",
        annotation="int | None",
    ),
    AddedAttribute(
        cls="vllm.v1.worker.mamba_utils:MambaSpecDecodeGPUContext",
        name="pooled_reads_elsewhere",
        where="vllm_hybrid.v1.worker.mamba_copies (initialize_from_forward_context)",
        why="Whether every state layer's core reads prefill rows out of place.",
        annotation="bool",
        default="False",
    ),
    AddedAttribute(
        cls="vllm.v1.worker.mamba_utils:MambaSpecDecodeGPUContext",
        name="pooled_query_lens",
        where="vllm_hybrid.v1.worker.mamba_copies (preprocess_state)",
        why="Per batch row of the current step, its scheduled tokens.",
        annotation="torch.Tensor | None",
    ),
    AddedAttribute(
        cls="vllm.v1.worker.mamba_utils:MambaSpecDecodeGPUContext",
        name="pooled_min_tokens",
        where="vllm_hybrid.v1.worker.mamba_copies (preprocess_state)",
        why="The shortest prefill chunk that reads out of place.",
        annotation="int | None",
    ),
    AddedAttribute(
        cls="vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadataBuilder",
        name="read_state_indices_buffer",
        where="vllm_hybrid.v1.attention.backends.gdn_reads (_staged)",
        why="Full CUDA graphs' buffer of the read ids, beside upstream's write ids.",
        annotation="torch.Tensor | None",
    ),
]

STATE_READ_PRIVATE: list[PrivateAttribute] = [
    PrivateAttribute(
        "vllm.v1.worker.gpu.model_states.mamba_hybrid:MambaHybridModelState",
        "_mamba_ctx",
        "v1.worker.mamba_copies (preprocess_state: the pre-copy context)",
    ),
]
