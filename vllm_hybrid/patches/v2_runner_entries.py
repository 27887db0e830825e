"""Registry entries for pooled mode on Model Runner V2, vLLM 0.32's CUDA
default (:mod:`vllm_hybrid.v1.worker.v2_warmup`); part of
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
    ),
]
