"""Registry entries for full CUDA graphs of hybrids, sized to the states the
KV cache holds (:mod:`vllm_hybrid.v1.worker.cudagraph_capacity`); part of
:data:`vllm_hybrid.patches.entries.PATCHES`."""

from __future__ import annotations

from vllm_hybrid.patches.entry import PatchEntry

CUDA_GRAPH_PATCHES: list[PatchEntry] = [
    PatchEntry(
        target=(
            "vllm.config.compilation:CompilationConfig.resolve_cudagraph_mode_and_sizes"
        ),
        replacement=(
            "vllm_hybrid.v1.worker.cudagraph_capacity:resolve_cudagraph_mode_and_sizes"
        ),
        bindings=(),
        why=(
            "With full CUDA graphs and Mamba layers, upstream refuses to start "
            "when max_num_seqs > kv_cache_config.num_blocks, because a decode "
            "graph's state rows must fit each state view (GDN's conv update "
            "asserts num_cache_lines >= batch); it refuses rather than capping "
            "the capture sizes, which the piecewise prefill graphs share (vLLM "
            "issue 34094). That stops engines that could run (the scheduler "
            "never runs more sequences than there are states), and in pooled "
            "mode num_blocks is the token pool's id space, so the comparison "
            "passes configurations whose capture then fails in the kernel. The "
            "check sits inside this method; no hook runs between the mode "
            "resolution and it."
        ),
        how=(
            "Method on CompilationConfig replaced by a function that calls "
            "upstream's with kv_cache_config=None (upstream reads it for this "
            "check only), then compares the largest full graph's sequences "
            "with the requests' states the KV cache holds at once (pooled: "
            "state pool at its highest extent / state blocks per running "
            "request; single pool with Mamba layers: num_blocks). Above that, "
            "it records a cap for the dispatcher (next entry) and logs one "
            "line with both numbers and the options; a KV cache without one "
            "request's state raises a ValueError naming the options. "
            "Non-hybrid configs are unaffected (upstream's check needs Mamba "
            "layers)."
        ),
        upstream_status=(
            "none: upstream's check reads num_blocks and raises "
            "(vllm/config/compilation.py, end of this method)"
        ),
        removal=(
            "When upstream sizes full decode graphs to the states its KV cache "
            "holds instead of refusing."
        ),
        placement="after",
    ),
    PatchEntry(
        target="vllm.v1.cudagraph_dispatcher:CudagraphDispatcher.initialize_cudagraph_keys",
        replacement="vllm_hybrid.v1.worker.cudagraph_capacity:initialize_cudagraph_keys",
        bindings=(),
        why=(
            "The dispatcher builds the full-graph keys from max_num_seqs and "
            "the capture sizes, which the piecewise graphs share; capping the "
            "full graphs at the states the KV cache holds, without shrinking "
            "the piecewise ones, needs the full keys alone to stop there. No "
            "option or hook limits the full keys separately."
        ),
        how=(
            "Method on CudagraphDispatcher replaced by a function that calls "
            "upstream's, then drops the FULL keys whose sequences exceed the "
            "cap the resolution recorded for the same CompilationConfig (no "
            "cap: keys unchanged). A batch above the cap finds no full key "
            "and dispatches to its piecewise graph, or to no graph in "
            "FULL-only mode."
        ),
        upstream_status="none",
        removal="With the resolve_cudagraph_mode_and_sizes entry.",
        placement="after",
    ),
    PatchEntry(
        target=("vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager._init_candidates"),
        replacement="vllm_hybrid.v1.worker.cudagraph_capacity:init_candidates",
        bindings=(),
        why=(
            "Model Runner V2 does not use the dispatcher: its CudaGraphManager "
            "builds the descriptors it captures and dispatches to from the "
            "capture sizes and max_num_seqs in this method, which its "
            "constructor calls. Without the cap there, V2 captures full decode "
            "graphs with more state rows than the state views hold (the GDN "
            "conv update asserts at capture). No option limits the full "
            "descriptors separately from the piecewise ones."
        ),
        how=(
            "Method on CudaGraphManager (inherited by V2's model, speculator "
            "and DFlash managers; none overrides it) replaced by a function "
            "that calls upstream's, then drops the FULL descriptors whose "
            "sequences exceed the cap the resolution recorded for the same "
            "CompilationConfig from the capture list and from every token "
            "count's candidates (no cap: unchanged)."
        ),
        upstream_status="none",
        removal="With the resolve_cudagraph_mode_and_sizes entry.",
        placement="after",
    ),
]
