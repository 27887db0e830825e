"""Registry records of token capacity beyond the capacity report: the
routed-experts store sized in vLLM's own worker, and the token groups
reachable at vLLM's name. Part of :data:`vllm_hybrid.patches.entries.PATCHES`
and :data:`vllm_hybrid.patches.entries.ADDED_SYMBOLS`."""

from __future__ import annotations

from vllm_hybrid.patches.entry import AddedSymbol, PatchEntry

ROUTED_EXPERTS_PATCHES: list[PatchEntry] = [
    PatchEntry(
        target="vllm.v1.worker.gpu_worker:Worker.initialize_from_config",
        replacement="vllm_hybrid.v1.worker.routed_experts:initialize_from_config",
        bindings=(),
        why=(
            "The routed-experts store (AuxOutput connector) is sized from "
            "aux_output_config.max_bytes when the model runner builds it inside "
            "initialize_from_config; unset, upstream derives it from the "
            "scheduler block size, the LCM of every group's block size, which "
            "state groups inflate far past the token slots that exist. A "
            "--worker-cls subclass would need the user to select it; the "
            "platform picks the worker class."
        ),
        how=(
            "Class attribute on Worker replaced (CPUWorker inherits it). The "
            "replacement sets max_bytes from the token groups' slots "
            "(routed_experts_store_bytes) when routed-experts capture is on and "
            "the user left max_bytes unset, then calls upstream's method "
            "unchanged."
        ),
        upstream_status="none",
        removal="When upstream sizes the store from the token groups.",
        placement="before",
    ),
]

#: Names the overlay adds to upstream modules, so that they are reachable at
#: vLLM's own path (applied and reverted with :data:`PATCHES`).
ADDED_SYMBOLS: list[AddedSymbol] = [
    AddedSymbol(
        target="vllm.v1.core.kv_cache_utils:token_capacity_kv_cache_groups",
        source=("vllm_hybrid.v1.core.token_capacity:token_capacity_kv_cache_groups"),
        why=(
            "Which KV cache groups count as tokens is a question of vLLM's "
            "KV cache utilities (the capacity report, the routed-experts store "
            "and the scheduler need it); callers written against vLLM find it "
            "at the name vLLM would give it."
        ),
    ),
]
