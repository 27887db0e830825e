"""Registry entries for pooled mode on Model Runner V2, vLLM 0.32's CUDA
default (the start-up warm-up, :mod:`vllm_hybrid.v1.worker.v2_warmup`; the
align pre-copy, :mod:`vllm_hybrid.v1.worker.mamba_copies`); part of
:data:`vllm_hybrid.patches.entries.PATCHES`."""

from __future__ import annotations

from vllm_hybrid.patches.entry import PatchEntry

V2_RUNNER_PATCHES: list[PatchEntry] = [
    PatchEntry(
        target="vllm.v1.worker.gpu.warmup:_warmup_kernels",
        replacement="vllm_hybrid.v1.worker.v2_warmup:warmup_kernels_pooled",
        bindings=(),
        why=(
            "Model Runner V2 warms its kernels up at start-up with requests it "
            "builds itself: their number is sized by the one "
            "kv_cache_config.num_blocks and their block ids for every KV cache "
            "group come from one counter. In pooled mode num_blocks is the "
            "token pool's id space and ids are pool-local, so the warm-up "
            "wrote state blocks outside the state pool (Qwen3.6-35B-A3B at "
            "256 MiB: 128 requests, state ids up to about 256 where the state "
            "pool's view has 4). Both decisions sit in local closures of this "
            "function; no hook or option reaches them."
        ),
        how=(
            "Module attribute replaced; its only caller (warmup_kernels, same "
            "module) looks it up at call time and no module imports it by "
            "name. Configs that are not PooledKVCacheConfig call upstream's "
            "function unchanged. Pooled configs call it too, with the number "
            "of requests capped at what every pool holds at the arena's "
            "initial boundary (through a view of the runner whose "
            "kv_cache_config.num_blocks is that cap's block count) and with "
            "each step's SchedulerOutput renumbered before it reaches the "
            "worker: every group's ids from its own pool's counter."
        ),
        upstream_status=(
            "none (upstream's warm-up assumes one id space for every group)"
        ),
        removal=(
            "When upstream's warm-up sizes and numbers its blocks per KV cache "
            "group's pool, or pooled mode's config exposes one id space."
        ),
        placement="body",
    ),
    PatchEntry(
        target=(
            "vllm.v1.worker.mamba_utils:"
            "MambaSpecDecodeGPUContext.initialize_from_forward_context"
        ),
        replacement=(
            "vllm_hybrid.v1.worker.mamba_copies:initialize_from_forward_context"
        ),
        bindings=(),
        why=(
            "The pre-copy entry below compares block ids in the state groups' "
            "block tables, which the context receives here and keeps only as "
            "addresses; it must also know whether the config is pooled, and "
            "neither the context nor its pre-copy launch sees the config."
        ),
        how=(
            "Class attribute on MambaSpecDecodeGPUContext replaced; the "
            "replacement calls upstream's method unchanged, then, for a "
            "PooledKVCacheConfig only and on the call that set the context up "
            "(upstream ignores later ones), keeps the block-table tensors it "
            "was given in the context's pooled_state_tables (an added "
            "attribute)."
        ),
        upstream_status="none",
        removal="With the run_fused_precopy entry.",
        placement="after",
    ),
    PatchEntry(
        target="vllm.v1.worker.mamba_utils:MambaSpecDecodeGPUContext.run_fused_precopy",
        replacement="vllm_hybrid.v1.worker.mamba_copies:run_fused_precopy",
        bindings=(),
        why=(
            "Pooled mode lets a decoding request cross a state block edge in "
            "place: both block columns name one block. Model Runner V2's "
            "fused align pre-copy compares columns, not block ids, so it "
            "copies that block onto itself: a real read and write of the "
            "whole state (61 MiB for Qwen3.6-35B-A3B, about 0.033 ms per "
            "request on an H200, some 16 requests a step at 256 decoding). "
            "The copy decision sits inside the Triton kernel; no hook reaches "
            "it."
        ),
        how=(
            "Class attribute on MambaSpecDecodeGPUContext replaced; its only "
            "callers (V2's MambaHybridModelState.preprocess_state, V1's "
            "preprocess_mamba) call it on the instance. With the pooled "
            "tables kept (pooled configs) and an idx_mapping (V2), the "
            "kernel gets a copy of the source columns in which every batch "
            "row with no accepted-token bias and one block id in both columns "
            "of every state group names its destination column, which the "
            "kernel skips; torch ops on the device, no host sync. Every other "
            "call goes to upstream's method with upstream's tensors."
        ),
        upstream_status=(
            "none (upstream never names one block in two columns without a "
            "shift, so the case does not arise there)"
        ),
        removal=(
            "When the pre-copy kernel skips copies of a block onto itself "
            "(equal block ids, no bias)."
        ),
        placement="before",
    ),
]
