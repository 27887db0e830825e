"""The registry's record of upstream classes the overlay extends without
replacing them: subclasses, attributes re-pointed on upstream instances, and
private upstream attributes it relies on. ``tests/patches`` checks each
against the installed vLLM.
"""

from __future__ import annotations

from vllm_hybrid.patches.entry import (
    AddedAttribute,
    InstanceRewrite,
    PrivateAttribute,
    SubclassEntry,
)
from vllm_hybrid.patches.state_read_entries import (
    STATE_READ_ATTRIBUTES,
    STATE_READ_PRIVATE,
)
from vllm_hybrid.patches.token_move_entries import TOKEN_MOVE_ATTRIBUTES

SUBCLASSES: list[SubclassEntry] = [
    SubclassEntry(
        base="vllm.v1.core.block_pool:BlockPool",
        subclass="vllm_hybrid.v1.core.pooled.block_pool:ArenaBlockPool",
        overrides=(
            "get_new_blocks",
            "get_usage",
            "free_blocks",
            "reset_prefix_cache",
            "take_events",
            "move_block_hashes",
            "_insert_block_hash",
            "_remove_cached_block_hashes",
            "_maybe_evict_cached_block",
            "touch",
        ),
        why=(
            "Pooled mode has one block pool per page kind inside one arena; "
            "each pool owns a movable id range, hands out blocks in an order "
            "that keeps the boundary movable, evicts prefix-cache entries "
            "together with the other pool (pooled.coupling) and hands out "
            "entries that served several prefix hits last (touch counts them)."
        ),
        how=(
            "Upstream's managers and KVCacheManager call these methods on the "
            "pool's handle they hold; the overrides call upstream's and add "
            "owned-capacity usage, the record of prefix-cache events the "
            "coupling handles (pooled.coupling) and KV events of both pools; "
            "touch does upstream's work in the same loop that counts hits. "
            "Built by the pooled coordinators only."
        ),
        upstream_status="none",
        removal="With the get_kv_cache_coordinator entry.",
    ),
    SubclassEntry(
        base="vllm.v1.core.kv_cache_coordinator:HybridKVCacheCoordinator",
        subclass=(
            "vllm_hybrid.v1.core.pooled.coordinator:PooledHybridKVCacheCoordinator"
        ),
        overrides=(
            "get_num_blocks_to_allocate",
            "allocate_new_computed_blocks",
            "cache_blocks",
            "remove_skipped_blocks",
            "free",
            "pop_blocks_for_free",
        ),
        why=(
            "Admission and allocation across the token and state pools; "
            "turn-end state checkpoints (vllm_hybrid/v1/core/pooled/retention.py)."
        ),
        how=(
            "Upstream's per-group managers compute needs; admit() decides, "
            "without changing anything, how the arena serves both pools "
            "(a boundary move, live token blocks moved off it, a state "
            "advanced in place) and allocate() carries that out "
            "(KVCacheManager.allocate_slots' entry hands one to the other); "
            "get_num_blocks_to_allocate returns admit()'s count of token "
            "blocks taken. cache_blocks passes the decode position as one more "
            "reachable boundary to align-mode state managers and evicts the "
            "request's previous decode checkpoint; remove_skipped_blocks and "
            "free put a freed decode checkpoint first in its pool's eviction "
            "order; allocate_new_computed_blocks notes the prefix hit a "
            "request starts from, which the recomputation its checkpoints "
            "save is measured from (pooled.policy, the costed split); "
            "free/pop_blocks_for_free drop the request's record."
        ),
        upstream_status="none",
        removal="With the get_kv_cache_coordinator entry.",
    ),
    SubclassEntry(
        base="vllm.v1.core.kv_cache_coordinator:HybridKVCacheCoordinator",
        subclass=("vllm_hybrid.v1.core.turn_ends:TurnEndHybridKVCacheCoordinator"),
        overrides=(
            "allocate_new_computed_blocks",
            "cache_blocks",
            "remove_skipped_blocks",
            "free",
            "pop_blocks_for_free",
        ),
        why=(
            "Upstream's default retention never keeps the state at the last "
            "edge a request reached while decoding, the longest hit a chat "
            "follow-up can have."
        ),
        how=(
            "Returned by the get_kv_cache_coordinator entry for single-pool "
            "configs with a Mamba group and prefix caching; the same mixin as "
            "the pooled coordinator's turn-end retention (a freed decode "
            "checkpoint is the first cached block evicted; the prefix hit "
            "allocate_new_computed_blocks notes weighs entries only in "
            "pooled mode's arena)."
        ),
        upstream_status=(
            "none; related: https://github.com/vllm-project/vllm/pull/50551 "
            "(open) would retain the final decode checkpoint"
        ),
        removal="When upstream retains the final decode checkpoint.",
    ),
    SubclassEntry(
        base="vllm.v1.core.kv_cache_coordinator:KVCacheCoordinatorNoPrefixCache",
        subclass=(
            "vllm_hybrid.v1.core.pooled.coordinator:PooledNoPrefixCacheCoordinator"
        ),
        overrides=("get_num_blocks_to_allocate",),
        why="As PooledHybridKVCacheCoordinator, with prefix caching off.",
        how="The same mixin as PooledHybridKVCacheCoordinator.",
        upstream_status="none",
        removal="With the get_kv_cache_coordinator entry.",
    ),
    SubclassEntry(
        base="vllm.v1.core.sched.scheduler:Scheduler",
        subclass="vllm_hybrid.v1.core.sched.scheduler:PooledScheduler",
        overrides=("make_stats", "_mamba_block_aligned_split", "schedule"),
        why=(
            "Align mode ends prefill chunks on cache_config.block_size edges, "
            "which upstream makes the state block; pooled mode keeps attention "
            "at its own block, so a longer --mamba-block-size lost every "
            "checkpoint a chunk ran past. Pooled mode also keeps a state every "
            "prefill checkpoint interval, which needs a chunk to end there. "
            "Its 16-token blocks reserve no growth at admission and its steps "
            "filled the token budget with chunks of several prompts, where "
            "upstream's large block does both implicitly (preemptions, a "
            "longer decode tail)."
        ),
        how=(
            "Selected through scheduler_cls by the engine core's KV planning "
            "(get_kv_cache_configs) for every pooled plan; where the state "
            "block is longer than the attention block its constructor gives "
            "the scheduler a copy of the cache config whose block_size is the "
            "state block. A test checks that upstream reads that field only "
            "in the Mamba split. The split override paces the chunk (state "
            "page multiples while few wait), calls upstream's and ends the "
            "chunk at a prefill checkpoint, after shortening a chunk the "
            "budget cuts by the decodes of the running requests behind it; "
            "schedule() sets the step's token "
            "budget and upstream's watermark_blocks (the growth reserve, "
            "also handed to the pooled coordinator so that admission moves "
            "the arena's boundary for it) before upstream's schedule runs."
        ),
        upstream_status="none",
        removal=(
            "When upstream's align-mode split reads the state group's block "
            "size and its scheduler reserves growth and paces prefills for "
            "pooled pages, or with the get_kv_cache_configs entry."
        ),
    ),
    SubclassEntry(
        base="vllm.v1.core.sched.async_scheduler:AsyncScheduler",
        subclass="vllm_hybrid.v1.core.sched.async_scheduler:PooledAsyncScheduler",
        overrides=("make_stats", "_mamba_block_aligned_split", "schedule"),
        why="As PooledScheduler, for engines with async scheduling.",
        how="The same mixin as PooledScheduler.",
        upstream_status="none",
        removal="With the PooledScheduler entry.",
    ),
    SubclassEntry(
        base="vllm.v1.kv_cache_interface:KVCacheConfig",
        subclass="vllm_hybrid.v1.core.pooled.spec:PooledKVCacheConfig",
        overrides=("num_blocks_of",),
        why=(
            "Workers shape each layer's view of its KV tensor with "
            "KVCacheConfig.num_blocks_of (allocate_kv_cache); upstream answers "
            "the one shared num_blocks, pooled mode has one id space per pool."
        ),
        how=(
            "The engine core's planning returns this dataclass subclass; it is "
            "pickled to the workers like any KVCacheConfig, and their "
            "upstream allocation code calls the override."
        ),
        upstream_status="none",
        removal="With the get_kv_cache_configs entry.",
    ),
]

#: Upstream objects whose attributes the overlay re-points after upstream
#: built them.
INSTANCE_REWRITES: list[InstanceRewrite] = [
    InstanceRewrite(
        cls="vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager",
        attributes=("block_pool", "_null_block"),
        where="vllm_hybrid.v1.core.pooled.coordinator (PooledCoordinatorMixin)",
        why=(
            "Upstream's coordinator hands every manager its one pool; pooled "
            "mode points each manager at the handle of the arena pool of its "
            "page kind (pooled.coupling.PoolHandle: the pool, then the "
            "coupling's handling of the prefix-cache events it recorded). For "
            "one allocation that advances a state in place, the state "
            "manager's block_pool is an InPlaceView of its pool, which hands "
            "back the reserved running block, and is restored after it."
        ),
    ),
    InstanceRewrite(
        cls="vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator",
        attributes=("block_pool",),
        where="vllm_hybrid.v1.core.pooled.coordinator (PooledCoordinatorMixin)",
        why=(
            "KVCacheManager reads usage, free blocks and events from "
            "coordinator.block_pool; pooled mode makes it the token pool's "
            "handle."
        ),
    ),
    InstanceRewrite(
        cls="vllm.v1.core.sched.scheduler:Scheduler",
        attributes=("cache_config",),
        where="vllm_hybrid.v1.core.sched.scheduler (PooledSchedulerMixin)",
        why=(
            "A private copy whose block_size is the state checkpoint interval, "
            "read only by the align-mode prefill split."
        ),
    ),
]

#: Attributes the overlay adds to upstream instances.
ADDED_ATTRIBUTES: list[AddedAttribute] = [
    AddedAttribute(
        cls="vllm.v1.worker.mamba_utils:MambaSpecDecodeGPUContext",
        name="pooled_state_tables",
        where=("vllm_hybrid.v1.worker.mamba_copies (initialize_from_forward_context)"),
        why=(
            "The state groups' block tables (rows by request slot) of a "
            "pooled config, which run_fused_precopy compares to drop copies "
            "of a block onto itself; upstream keeps only their addresses."
        ),
        annotation="tuple[torch.Tensor, ...] | None",
    ),
    AddedAttribute(
        cls="vllm.v1.kv_cache_interface:KVCacheConfig",
        name="retain_turn_ends",
        where="vllm_hybrid.v1.core.turn_ends (mark_turn_end_retention)",
        why=(
            "Carries hybrid_kv.retain_turn_ends of a single-pool hybrid plan "
            "from the engine core's planning to the scheduler's coordinator "
            "factory, which sees no VllmConfig (pooled plans have the field)."
        ),
        annotation="bool",
        default="False",
    ),
    *STATE_READ_ATTRIBUTES,
    *TOKEN_MOVE_ATTRIBUTES,
]

#: Private upstream attributes the overlay reads or calls (overrides of
#: private methods are in SUBCLASSES).
PRIVATE_ATTRIBUTES: list[PrivateAttribute] = [
    PrivateAttribute(
        "vllm.v1.core.sched.scheduler:Scheduler",
        "_preempt_request",
        "benchmarks/pooled/admission.py (the admission probe hears each "
        "preemption; it wraps the method on the instance and calls it)",
    ),
    PrivateAttribute(
        "vllm.v1.core.block_pool:BlockHashToBlockMap",
        "_cache",
        "pooled.block_pool (cached keys, blocks of a key)",
    ),
    PrivateAttribute(
        "vllm.v1.core.block_pool:BlockPool",
        "_reuse_watchers",
        "pooled.block_pool (boundary moves, cache reset)",
    ),
    PrivateAttribute(
        "vllm.v1.core.block_pool:BlockPool",
        "_notify_reuse",
        "pooled.block_pool (boundary moves, cache reset)",
    ),
    PrivateAttribute(
        "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager",
        "_null_block",
        "pooled.coordinator (rebinding managers)",
    ),
    PrivateAttribute(
        "vllm.v1.core.single_type_kv_cache_manager:MambaManager",
        "_allocated_block_reqs",
        "pooled.coordinator (state advanced in place)",
    ),
    PrivateAttribute(
        "vllm.v1.core.kv_cache_utils",
        "_kv_cache_device_name",
        "v1.core.kv_cache_utils (capacity log line)",
    ),
    PrivateAttribute(
        "vllm.model_executor.layers.fused_moe.routed_experts_capturer",
        "_get_routed_experts_shape",
        "v1.worker.routed_experts (bytes per token)",
    ),
    PrivateAttribute(
        "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention",
        "_unpacked_conv_weight",
        "model_executor.layers.mamba.ops.cpu.gdn_spec (conv weight)",
    ),
    PrivateAttribute(
        "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager",
        "_capture_descs",
        "v1.worker.cudagraph_capacity (V2's full graphs above the cap)",
    ),
    PrivateAttribute(
        "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager",
        "_candidates",
        "v1.worker.cudagraph_capacity (V2's full graphs above the cap)",
    ),
    PrivateAttribute(
        "vllm.v1.worker.gpu.warmup",
        "_warmup_block_counter",
        "v1.worker.v2_warmup (blocks of one warm-up request per group)",
    ),
    PrivateAttribute(
        "vllm.logger",
        "_last_configured_logging_config",
        "plugin (whether vLLM configured its log handlers yet)",
    ),
    PrivateAttribute(
        "vllm.platforms.interface:Platform",
        "_find_non_ssm_backends",
        "platforms.hybrid_block_size (the attention backends a worker "
        "aligns for); tools.plan.config (the planned device's backend)",
    ),
    # The planner (tools/plan) runs upstream's engine functions for a device
    # it does not have: a platform class built for that device answers them
    # for the duration of a call, and is never left in place.
    PrivateAttribute(
        "vllm.platforms",
        "_current_platform",
        "tools.plan.config (current_platform_as)",
    ),
    PrivateAttribute(
        "vllm.platforms.cpu:CpuPlatform",
        "_enum",
        "tools.plan.config (the planned device's kind)",
    ),
    PrivateAttribute(
        "vllm.config.vllm:VllmConfig",
        "_set_cudagraph_sizes",
        "tools.plan.cuda_defaults (capture sizes on the planned GPU)",
    ),
    *STATE_READ_PRIVATE,
]
