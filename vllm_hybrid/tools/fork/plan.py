"""The fork's commits: one per fix, in an order that builds.

Which modules a commit holds is written as path patterns, not as lists of
today's files: a module added later lands in the commit its path says, and a
test fails when a module matches no commit, or when a commit imports a module
that only a later one adds. A registry entry lands in the commit of the
module its replacement is defined in, or in a later one where its code reads
a module a later commit adds (:meth:`.build.ForkBuild.entry_commit`); the
targets themselves are written in the registry only.
A path written out in full wins over any pattern; otherwise the first
commit with a matching pattern takes the module.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass


@dataclass(frozen=True)
class ForkCommit:
    """One fix of the fork."""

    key: str
    #: vLLM-style subject: ``[Area] What changes``.
    subject: str
    #: Why, for the commit message (the registry entries' reasons follow).
    body: str
    #: Patterns over module paths relative to the ``vllm_hybrid`` package.
    modules: tuple[str, ...] = ()
    #: Changes to vLLM's own files that are not registry entries
    #: (:mod:`.wiring`).
    wiring: tuple[str, ...] = ()


COMMITS: tuple[ForkCommit, ...] = (
    ForkCommit(
        key="options",
        subject="[Config] Add HybridKVConfig for hybrid models' KV caches",
        body=(
            "Hybrid models (attention layers next to Mamba/GDN state layers) get "
            "their own KV cache options: whether the attention and state pages "
            "live in separate pools of one arena, how prefix caching keeps state "
            "checkpoints, and how far page unification of a single shared pool "
            "may pad or grow pages. They are a vLLM config (--hybrid-kv-config) "
            "parsed and checked in one place, so every process reads the same "
            "values and a bad one is one error naming the option."
        ),
        modules=("config/*", "envs.py"),
        wiring=("config_field", "environment"),
    ),
    ForkCommit(
        key="lcm",
        subject="[Core] Unify hybrid KV cache pages by LCM, padding state pages only",
        body=(
            "unify_kv_cache_spec_page_size raises NotImplementedError when a page "
            "does not divide the largest page (MLA next to GDN, custom specs) and "
            "otherwise pads attention pages up to the largest page: a TurboQuant "
            "k8v4 attention page next to a GDN state page grows 88x, and a padded "
            "page can no longer be split into kernel blocks. The common page "
            "becomes the LCM of the attention pages rounded up to cover the "
            "largest page, attention blocks scale by whole numbers and only "
            "state pages are padded, within limits that are options."
        ),
        # the dispatch helpers of kv_cache_utils join vLLM's module with the
        # first fix written there
        modules=("v1/core/page_unification.py", "v1/core/kv_cache_utils.py"),
    ),
    ForkCommit(
        key="pools",
        subject="[Core] Pooled KV cache: per-kind block pools in one arena",
        body=(
            "All KV cache groups of a hybrid model share one block pool with one "
            "page size, so the attention block is inflated until one attention "
            "page covers a state page (hundreds to thousands of tokens) and "
            "state pages are padded to it. Pooled mode keeps each page kind at "
            "its natural size in its own pool; both pools share one arena whose "
            "boundary moves at run time, and with prefix caching the two pools "
            "evict together so neither keeps entries the other made useless."
        ),
        modules=(
            "v1/core/pooled/*",
            "platforms/hybrid_block_size.py",
            "v1/worker/pooled_views.py",
        ),
    ),
    ForkCommit(
        key="scheduling",
        subject="[Core] Pooled KV cache: coordinators, scheduler and retention",
        body=(
            "The engine core plans a token pool and a state pool per worker "
            "(PooledKVCacheConfig), the KV cache manager gets coordinators whose "
            "managers allocate from the arena's pools and admit a request across "
            "both, and the scheduler ends align-mode prefill chunks on state "
            "checkpoints and publishes each pool's usage. Prefix caching keeps "
            "the state a follow-up turn resumes from (turn-end checkpoints), in "
            "the pooled arena and in the single shared pool."
        ),
        modules=(
            "v1/core/pooled/coordinator.py",
            "v1/core/pooled/retention.py",
            "v1/core/pooled/engine.py",
            "v1/core/kv_cache_coordinator.py",
            "v1/core/kv_cache_manager.py",
            "v1/core/turn_ends.py",
            "v1/core/sched/*",
        ),
    ),
    ForkCommit(
        key="capacity",
        subject="[Core] Count only the KV cache groups that grow as token capacity",
        body=(
            "The reported 'KV cache size: N tokens' is max_concurrency times "
            "max_model_len with constant-size state groups weighing like "
            "attention, which for a hybrid model is neither the tokens that fit "
            "nor a pool size; the routed-experts store is sized from the "
            "scheduler block size, which state groups inflate. Both now use the "
            "groups whose memory grows with the sequence "
            "(token_capacity_kv_cache_groups). It follows pooled mode's commits "
            "because the capacity arithmetic of both pool kinds lives in one "
            "module and the capacity report also covers pooled plans."
        ),
        modules=("v1/core/token_capacity.py", "v1/worker/routed_experts.py"),
    ),
    ForkCommit(
        key="workers",
        subject="[Core] Pooled KV cache in the workers and Model Runner V2",
        body=(
            "The workers build their tensor views over the arena and keep what "
            "the scheduler decided: a state advanced in place needs no copy onto "
            "itself, prefill chunks read their state out of place instead of "
            "copying it first, token blocks the scheduler moved off the arena's "
            "boundary are copied and renamed before the step, and Model Runner "
            "V2's start-up warm-up stays inside each pool."
        ),
        modules=(
            "v1/worker/mamba_copies.py",
            "v1/worker/state_reads.py",
            "v1/worker/token_moves.py",
            "v1/worker/v2_warmup.py",
            "v1/attention/backends/gdn_reads.py",
            "model_executor/layers/mamba/gdn_out_of_place.py",
        ),
    ),
    ForkCommit(
        key="turboquant",
        subject="[CPU] TurboQuant KV cache on the CPU attention backend",
        body=(
            "--kv-cache-dtype turboquant_* starts on the CPU platform, but "
            "CPU_ATTN writes bf16 into pages sized for the packed format and "
            "crashes under load: nothing checks the backend against the cache "
            "dtype on CPU. A CPU_TURBOQUANT backend stores upstream's packed "
            "TurboQuant slots with a kernel in csrc/cpu/ (built by vLLM's CMake) "
            "and a torch implementation as fallback and oracle, and a backend "
            "that cannot store the requested dtype now stops start-up with one "
            "error."
        ),
        modules=(
            "ops/*",
            "v1/attention/backends/cpu_turboquant_attn.py",
            "platforms/cpu.py",
            "v1/attention/selector.py",
        ),
        wiring=("attention_backend", "cpu_kernel"),
    ),
    ForkCommit(
        key="cudagraphs",
        subject="[Core] Size full CUDA graphs to the states the KV cache holds",
        body=(
            "vLLM refuses to start a hybrid model with full CUDA graphs when "
            "max_num_seqs exceeds the blocks of the KV cache. The full graphs "
            "are now captured up to the requests whose states the KV cache "
            "holds, the piecewise graphs stay, and one log line names the cap."
        ),
        modules=("v1/worker/cudagraph_capacity.py",),
    ),
    ForkCommit(
        key="cpu_spec",
        subject="[CPU] Speculative decoding on hybrid models without Triton",
        body=(
            "Align mode with speculative decoding moves recurrent states with "
            "two fused Triton kernels the CPU platform has no host version of, "
            "so n-gram, EAGLE or MTP decoding with prefix caching stops at its "
            "first step on CPU; and the CPU GDN path writes a request's new "
            "tokens at the end of its rolling conv buffer, which only a full set "
            "of drafts leaves in place."
        ),
        modules=(
            "v1/worker/cpu_mamba_align.py",
            "model_executor/layers/mamba/ops/cpu/*",
        ),
    ),
    ForkCommit(
        key="cpu_pp",
        subject="[CPU] Allocate intermediate tensors on eager pipeline stages",
        body=(
            "With pipeline parallelism every stage but the first receives "
            "activations in a buffer the first dummy run allocates; the CPU "
            "worker skips that run in eager mode with an explicit KV budget, so "
            "the second stage failed its first step, for any model."
        ),
        modules=("v1/worker/cpu_worker.py",),
    ),
    ForkCommit(
        key="frontend",
        subject="[Frontend] Check hybrid KV options early, end requests at shutdown",
        body=(
            "A bad state checkpoint interval is found where the engine's "
            "configuration is made, not in every worker; and on SIGTERM the API "
            "server stopped the engine while requests still waited on output "
            "queues nothing filled, so it never exited: each open request now "
            "ends with an error."
        ),
        modules=("v1/engine/*",),
    ),
)

#: Modules of the overlay that have no place in the fork, and why.
NOT_IN_FORK: dict[str, str] = {
    "plugin.py": "activation of the overlay in every vLLM process",
    "cli.py": "the vllm-hybrid command",
    "patches/*": "the registry of what the overlay replaces",
    "tools/*": "the overlay's own tools (planner, simulator, tiny models)",
    "logger.py": "the fork's modules use vLLM's logger directly",
    "__init__.py": "the overlay's version; the fork is vLLM's package",
    "v1/metrics/*": (
        "per-pool /metrics gauges reach the frontend through a file the plugin "
        "names in every process; in vLLM they would ride in SchedulerStats, a "
        "change this generator does not write"
    ),
}


def _first_match(value: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(value, p) for p in patterns)


def commit_of_module(path: str) -> ForkCommit | None:
    """The commit that adds the module at ``path`` (relative to the package,
    e.g. ``v1/core/pooled/arena.py``); None when it is not in the fork.
    Raises LookupError for a module no rule covers."""
    for pattern in NOT_IN_FORK:
        if fnmatch.fnmatchcase(path, pattern):
            return None
    for commit in COMMITS:
        if path in commit.modules:
            return commit
    for commit in COMMITS:
        if _first_match(path, commit.modules):
            return commit
    raise LookupError(
        f"vllm_hybrid/{path} belongs to no commit of the fork: add a pattern to "
        "COMMITS or NOT_IN_FORK in vllm_hybrid/tools/fork/plan.py"
    )


def commit_index(key: str) -> int:
    return next(i for i, c in enumerate(COMMITS) if c.key == key)
