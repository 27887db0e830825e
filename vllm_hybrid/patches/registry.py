"""The one registry of upstream vLLM symbols that the overlay replaces.

vLLM offers extension points (plugins, ``scheduler_cls``, ``worker_cls``,
backend and spec registries) for most of what the overlay does. Where it does
not, a symbol is replaced in its home module *and* in every module that bound
it by name with ``from ... import name`` at import time; otherwise the old
object would keep being called through those bindings.

Every such replacement is a :class:`PatchEntry` in :data:`PATCHES`, with the
reason, the mechanism, the upstream status and the condition for deleting it.
Applying and reverting go through :func:`apply_all` and :func:`revert_all`
only, so the registry is the complete list of what differs from upstream.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from vllm_hybrid.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class PatchEntry:
    """One upstream symbol replaced by the overlay.

    ``target`` and ``replacement`` are ``"module:attr"`` or
    ``"module:Class.attr"`` paths. ``bindings`` lists the modules that hold a
    module-level name binding of the target (``from home import attr``);
    they are rebound together with the home module.
    """

    target: str
    replacement: str
    bindings: tuple[str, ...]
    why: str
    how: str
    upstream_status: str
    removal: str
    #: Issue of this project that introduced the patch.
    issue: int = 0
    #: Extra names of the symbol in binding modules (``import x as y``).
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def home_module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def attr_path(self) -> str:
        return self.target.split(":", 1)[1]

    @property
    def name(self) -> str:
        """The attribute name the symbol is bound under."""
        return self.attr_path.rsplit(".", 1)[-1]


def _resolve_owner(path: str) -> tuple[Any, str]:
    """Return ``(owner, attr)`` for a ``module:attr.attr`` path."""
    module_name, attr_path = path.split(":", 1)
    owner: Any = importlib.import_module(module_name)
    *parents, attr = attr_path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, attr


def _get_raw(owner: Any, attr: str) -> Any:
    """Read an attribute without triggering descriptors on classes.

    A ``staticmethod``/``classmethod`` must be saved and restored as the
    descriptor, not as the bound function, or reverting would change it.
    """
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attr in klass.__dict__:
                return klass.__dict__[attr]
        raise AttributeError(f"{owner.__qualname__} has no attribute {attr!r}")
    return getattr(owner, attr)


def load_object(path: str) -> Any:
    owner, attr = _resolve_owner(path)
    return _get_raw(owner, attr)


#: target -> upstream object, for the entries applied in this process.
_originals: dict[str, Any] = {}


def upstream(target: str) -> Any:
    """The upstream object behind ``target``, whether or not it is patched.

    Replacements that extend upstream behaviour call through this instead of
    importing the name, which would return the replacement itself.
    """
    if target in _originals:
        return _originals[target]
    return load_object(target)


def applied() -> list[PatchEntry]:
    """The entries currently applied in this process."""
    return [entry for entry in PATCHES if entry.target in _originals]


def _binding_names(entry: PatchEntry, module_name: str) -> list[str]:
    names = [entry.name]
    alias = entry.aliases.get(module_name)
    if alias:
        names.append(alias)
    return names


def _check_bindings(entry: PatchEntry, original: Any) -> None:
    """Refuse to patch when a listed binding is not upstream's object.

    With the exact version pin this cannot happen unless another plugin got
    there first; patching anyway would leave two different objects in use.
    """
    for module_name in entry.bindings:
        module = importlib.import_module(module_name)
        for name in _binding_names(entry, module_name):
            bound = getattr(module, name, None)
            if bound is not original:
                raise RuntimeError(
                    f"{module_name}.{name} is not upstream's {entry.target}; "
                    "another plugin may have replaced it. vllm-hybrid will not "
                    "patch over it: uninstall the other plugin or set "
                    "VLLM_HYBRID_KV=0."
                )


def _set(entry: PatchEntry, value: Any) -> None:
    owner, attr = _resolve_owner(entry.target)
    setattr(owner, attr, value)
    for module_name in entry.bindings:
        module = importlib.import_module(module_name)
        for name in _binding_names(entry, module_name):
            setattr(module, name, value)


def apply_all() -> list[PatchEntry]:
    """Apply every registry entry; all or nothing.

    Idempotent: entries already applied are left alone.
    """
    pending: list[tuple[PatchEntry, Any, Any]] = []
    for entry in PATCHES:
        if entry.target in _originals:
            continue
        original = load_object(entry.target)
        _check_bindings(entry, original)
        pending.append((entry, original, load_object(entry.replacement)))
    for entry, original, replacement in pending:
        _originals[entry.target] = original
        _set(entry, replacement)
    return [entry for entry, _, _ in pending]


def revert_all() -> None:
    """Put every upstream object back, in reverse order of application."""
    for entry in reversed(PATCHES):
        original = _originals.pop(entry.target, None)
        if original is not None:
            _set(entry, original)


# ---------------------------------------------------------------------------
# The registry. Keep entries grouped by issue; each must say why no extension
# point serves, how the patch works, where upstream stands and when to drop it.
# ---------------------------------------------------------------------------

_ISSUE_4 = "vllm_hybrid.v1.core.kv_cache_utils"

PATCHES: list[PatchEntry] = [
    # -- issue 4: page unification, token capacity ---------------------------
    PatchEntry(
        target="vllm.v1.core.kv_cache_utils:unify_kv_cache_spec_page_size",
        replacement=f"{_ISSUE_4}:unify_kv_cache_spec_page_size",
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
        issue=4,
    ),
    PatchEntry(
        target="vllm.v1.core.kv_cache_utils:get_kv_cache_groups",
        replacement=f"{_ISSUE_4}:get_kv_cache_groups",
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
        issue=4,
    ),
    PatchEntry(
        target="vllm.v1.core.kv_cache_utils:get_kv_cache_capacity",
        replacement=f"{_ISSUE_4}:get_kv_cache_capacity",
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
        issue=4,
    ),
    PatchEntry(
        target="vllm.v1.core.kv_cache_utils:update_kv_cache_capacity",
        replacement=f"{_ISSUE_4}:update_kv_cache_capacity",
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
        issue=4,
    ),
    # -- issue 3: pooled mode (per-pool KV at natural page sizes) ------------
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
        issue=3,
    ),
    PatchEntry(
        target="vllm.v1.core.kv_cache_utils:get_kv_cache_configs",
        replacement="vllm_hybrid.v1.core.pooled_kv_cache_utils:get_kv_cache_configs",
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
        issue=3,
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
        issue=3,
    ),
    PatchEntry(
        target=(
            "vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features"
        ),
        replacement="vllm_hybrid.config.vllm:get_v2_model_runner_unsupported_features",
        bindings=(),
        why=(
            "Pooled mode's worker side is the V1 model runner, which the CPU "
            "runner inherits, so one code path is tested here and runs on "
            "CUDA. vLLM 0.32 picks Model Runner V2 on CUDA unless a feature "
            "it does not support is configured; that list is a private method "
            "with no registry."
        ),
        how=(
            "Method on VllmConfig replaced by a function that appends "
            "'vllm-hybrid pooled KV mode' to upstream's list when pooled mode "
            "applies; vLLM then logs its usual fallback line and uses V1. "
            "VLLM_USE_V2_MODEL_RUNNER still overrides, as upstream."
        ),
        upstream_status="none",
        removal="When pooled mode's worker glue also covers Model Runner V2.",
        issue=3,
    ),
    # -- issue 6: TurboQuant KV cache on CPU, dtype validation ---------------
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
        issue=6,
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
        issue=6,
    ),
]


@dataclass(frozen=True)
class SubclassEntry:
    """An upstream class the overlay subclasses without replacing it.

    Nothing upstream is rebound, but each listed method is an override of an
    upstream method (often a private one) that upstream code calls on our
    objects, so a rename or signature change upstream would silently bypass
    or break it; ``tests/patches`` checks them against what is installed.
    """

    base: str
    subclass: str
    overrides: tuple[str, ...]
    why: str
    how: str
    upstream_status: str
    removal: str
    issue: int


SUBCLASSES: list[SubclassEntry] = [
    SubclassEntry(
        base="vllm.v1.core.block_pool:BlockPool",
        subclass="vllm_hybrid.v1.core.arena:ArenaBlockPool",
        overrides=(
            "get_new_blocks",
            "get_usage",
            "free_blocks",
            "reset_prefix_cache",
            "take_events",
            "cache_full_blocks",
            "cache_partial_block",
            "move_block_hashes",
            "_insert_block_hash",
            "_remove_cached_block_hashes",
            "_maybe_evict_cached_block",
        ),
        why=(
            "Pooled mode has one block pool per page kind inside one arena; "
            "each pool owns a movable id range, hands out blocks in an order "
            "that keeps the boundary movable, and evicts prefix-cache entries "
            "together with the other pool (prefix_cache_view)."
        ),
        how=(
            "Upstream's managers and KVCacheManager call these methods on the "
            "pool they hold; the overrides call upstream's and add boundary "
            "moves, owned-capacity usage, coupled eviction and events of both "
            "pools. Built by the pooled coordinators only."
        ),
        upstream_status="none",
        removal="With the get_kv_cache_coordinator entry.",
        issue=3,
    ),
    SubclassEntry(
        base="vllm.v1.core.kv_cache_coordinator:HybridKVCacheCoordinator",
        subclass=(
            "vllm_hybrid.v1.core.kv_cache_coordinator:PooledHybridKVCacheCoordinator"
        ),
        overrides=("get_num_blocks_to_allocate", "allocate_new_blocks"),
        why="Admission and allocation across the token and state pools.",
        how=(
            "Upstream's per-group managers compute needs; the overrides ask "
            "the arena for both pools at once and may advance a state in place."
        ),
        upstream_status="none",
        removal="With the get_kv_cache_coordinator entry.",
        issue=3,
    ),
    SubclassEntry(
        base="vllm.v1.core.kv_cache_coordinator:KVCacheCoordinatorNoPrefixCache",
        subclass=(
            "vllm_hybrid.v1.core.kv_cache_coordinator:PooledNoPrefixCacheCoordinator"
        ),
        overrides=("get_num_blocks_to_allocate", "allocate_new_blocks"),
        why="As PooledHybridKVCacheCoordinator, with prefix caching off.",
        how="The same mixin as PooledHybridKVCacheCoordinator.",
        upstream_status="none",
        removal="With the get_kv_cache_coordinator entry.",
        issue=3,
    ),
    SubclassEntry(
        base="vllm.v1.core.sched.scheduler:Scheduler",
        subclass="vllm_hybrid.v1.core.sched.scheduler:PooledScheduler",
        overrides=(),
        why=(
            "Align mode ends prefill chunks on cache_config.block_size edges, "
            "which upstream makes the state block; pooled mode keeps attention "
            "at its own block, so a longer --mamba-block-size lost every "
            "checkpoint a chunk ran past."
        ),
        how=(
            "Selected through scheduler_cls by the engine core's KV planning "
            "(get_kv_cache_configs) only when the state block is longer than "
            "the attention block; its constructor gives the scheduler a copy "
            "of the cache config whose block_size is the state block. A test "
            "checks that upstream reads that field only in the Mamba split."
        ),
        upstream_status="none",
        removal=(
            "When upstream's align-mode split reads the state group's block "
            "size, or with the get_kv_cache_configs entry."
        ),
        issue=3,
    ),
    SubclassEntry(
        base="vllm.v1.core.sched.async_scheduler:AsyncScheduler",
        subclass="vllm_hybrid.v1.core.sched.async_scheduler:PooledAsyncScheduler",
        overrides=(),
        why="As PooledScheduler, for engines with async scheduling.",
        how="The same mixin as PooledScheduler.",
        upstream_status="none",
        removal="With the PooledScheduler entry.",
        issue=3,
    ),
]
