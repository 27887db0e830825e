"""Registry record of pooled mode's one allocation path: the admission a
pooled coordinator decides is carried out by ``KVCacheManager.allocate_slots``
(:mod:`vllm_hybrid.v1.core.kv_cache_manager`). Part of
:data:`vllm_hybrid.patches.entries.PATCHES`."""

from __future__ import annotations

from vllm_hybrid.patches.entry import PatchEntry

ALLOCATION_PATCHES: list[PatchEntry] = [
    PatchEntry(
        target="vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",
        replacement="vllm_hybrid.v1.core.kv_cache_manager:allocate_slots",
        bindings=(),
        why=(
            "Upstream passes only a block count from the coordinator's count "
            "(get_num_blocks_to_allocate) to its allocation "
            "(allocate_new_blocks). Pooled admission decides more: where the "
            "arena's boundary goes, which live token blocks move off it, "
            "whether a running request advances its state in place, the "
            "growth reserve a waiting request must leave. Without a way to "
            "hand that decision on, the count had to carry it out itself or "
            "leave it in a field for the allocation. The manager is built "
            "inside the scheduler's constructor, so scheduler_cls cannot "
            "give it another class, and a user's scheduler class would miss "
            "a subclass."
        ),
        how=(
            "Class attribute on KVCacheManager replaced; a dispatch at the "
            "top: any coordinator but a pooled one calls upstream's method "
            "(via upstream()) with the same arguments. Over a pooled "
            "coordinator the same steps run in the same order (hit trimming, "
            "the full-sequence check, skipped blocks freed, new computed "
            "blocks, allocation, caching); the count and check are the "
            "coordinator's admit(), a value the allocation (allocate()) "
            "carries out; the watermark and reserved_blocks are kept free "
            "as upstream keeps them, the boundary moving for them."
        ),
        upstream_status="none",
        removal="With the get_kv_cache_coordinator entry.",
        placement="top",
    ),
]
