"""A/B benchmark of the hybrid KV cache: upstream vLLM against the overlay.

One command runs the same workloads twice per model, once with the overlay
switched off (``VLLM_HYBRID_KV=0``, pure upstream vLLM) and once with it on,
under the same KV cache byte budget, then prints overlay/upstream ratios::

    python benchmarks/bench_pooled.py --models qwen3_5,qwen3_next

The overlay reads its switch when vLLM loads plugins, i.e. once per process,
so each mode runs in its own worker subprocess (this same file started with
``--worker``). A worker drives in-process engines
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) step by step so it can read the
scheduler's block pools between steps, and prints one ``BENCH_RESULT {json}``
line that the driver parses. Everything runs on CPU with the tiny random
weight models of :mod:`vllm_hybrid.tools.tiny_models`; see
``benchmarks/README.md`` for what each metric means.

The only code that knows how block pools look is :func:`kv_pools`, so the
harness measures pooled mode (one token pool and one state pool in an
elastic arena) as soon as the overlay exposes it, without other changes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import queue
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

MIB = 2**20
RESULT_PREFIX = "BENCH_RESULT "
MODES: tuple[str, ...] = ("upstream", "overlay")
#: Value of ``VLLM_HYBRID_KV`` that selects each mode.
MODE_SWITCH: dict[str, str] = {"upstream": "0", "overlay": "1"}
WORKLOADS: tuple[str, ...] = ("many_short", "one_long", "multi_turn", "same_tokens")
DEFAULT_MODELS: tuple[str, ...] = ("qwen3_5", "qwen3_next")
#: Kinds whose CPU kernels fail with prefix caching (see the tiny model tests).
NO_PREFIX_CACHING_KINDS: frozenset[str] = frozenset({"nemotron_h"})
REPO_ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    """Every knob of a run; the driver hands it to workers as JSON.

    Defaults are the acceptance settings of the pooled-mode issue, so runs of
    different people compare; the CLI can shrink them for quick checks.
    """

    seed: int = 0
    budget_bytes: int = 48 * MIB
    one_long_budget_bytes: int = 5 * MIB
    #: Budget of the forced-preemption run of ``same_tokens``; None picks a
    #: per-model default (:data:`PREEMPT_BUDGET_MIB`).
    preempt_budget_bytes: int | None = None
    preempt_max_num_seqs: int = 8
    max_num_seqs: int = 64
    max_model_len: int = 4096
    #: ``-1`` lets the engine fit ``max_model_len`` to the 5 MiB budget, the
    #: only setting in which upstream starts at all with such a small cache.
    one_long_max_model_len: int = -1
    #: Attention block of the one_long engines (both modes). A 5 MiB budget
    #: holds only a handful of the CPU default's 128-token blocks; 32 is the
    #: smallest block the CPU attention kernel takes. None keeps the default.
    one_long_block_size: int | None = 32
    #: ``--mamba-block-size`` (state checkpoint interval in align mode) of the
    #: prefix-caching engines except one_long's; None keeps the default (the
    #: attention block). Upstream overrides it with its inflated block.
    mamba_block_size: int | None = None
    same_tokens_max_model_len: int = 2048
    many_short_requests: int = 64
    many_short_min_len: int = 64
    many_short_max_len: int = 512
    many_short_output: int = 32
    one_long_output: int = 16
    #: Upper bound of the one_long search, besides ``max_model_len``.
    one_long_search_cap: int = 16384
    multi_turn_conversations: int = 6
    multi_turn_turns: int = 5
    multi_turn_system_len: int = 1200
    multi_turn_user_len: int = 100
    multi_turn_output: int = 32
    same_tokens_output: int = 24
    #: OpenMP threads of the same_tokens workers (own processes, both modes);
    #: 0 runs same_tokens in the main workers with the platform's threads.
    #: vLLM's CPU attention shares a step's work among its threads by the
    #: KV length of the whole batch, so with more than one thread a request's
    #: bf16 bits depend on which requests it runs with; one thread removes
    #: that, which is what a token-for-token comparison needs.
    same_tokens_threads: int = 1
    #: Also run same_tokens without prefix caching (pc_off, alone) and in
    #: forced preemption; off runs only the cached passes (pc_on, repeat).
    same_tokens_uncached: bool = True
    #: Wall-clock cap of one engine drive; a stuck run ends as "time_limit".
    drive_time_limit_s: float = 1800.0
    #: Steps without any token progress after which a drive counts as stalled.
    stall_steps: int = 64
    enforce_eager: bool = True
    #: ``--mamba-ssm-cache-dtype`` of every engine, both modes. vLLM's CPU
    #: platform forces float32 SSM state on AVX512-BF16 hosts and keeps the
    #: model's bf16 elsewhere, which halves the state pages and changes every
    #: memory row; pinning float32 gives the same figures on any host.
    #: "auto" keeps the host's choice.
    mamba_ssm_cache_dtype: str = "float32"
    #: Pooled mode's coordinated prefix-cache eviction across its pools
    #: (``hybrid_kv.couple_prefix_caches``); upstream ignores the option.
    couple_prefix_caches: bool = True


# ---------------------------------------------------------------------------
# Prompt generation (pure, seeded)
# ---------------------------------------------------------------------------


def allowed_token_ids(vocab_size: int, special_ids: Iterable[int]) -> list[int]:
    """Ids a random prompt may use: the vocabulary minus special tokens.

    Special tokens (EOS, chat markers) are excluded so that prompts never end
    a sequence early or look like chat structure to the model.
    """
    special = set(special_ids)
    ids = [i for i in range(vocab_size) if i not in special]
    if not ids:
        raise ValueError("no ordinary token ids in the vocabulary")
    return ids


def random_tokens(rng: random.Random, vocab: Sequence[int], length: int) -> list[int]:
    """``length`` ids drawn from ``vocab``; exact lengths need no tokenizer."""
    return [rng.choice(vocab) for _ in range(length)]


def many_short_prompts(cfg: BenchConfig, vocab: Sequence[int]) -> list[list[int]]:
    """Prompts of the many_short workload, lengths uniform in [min, max]."""
    rng = random.Random(f"many_short/{cfg.seed}")
    return [
        random_tokens(
            rng, vocab, rng.randint(cfg.many_short_min_len, cfg.many_short_max_len)
        )
        for _ in range(cfg.many_short_requests)
    ]


def one_long_prompt(seed: int, vocab: Sequence[int], length: int) -> list[int]:
    """The one_long prompt of a given length.

    Each length gets its own stream so that a try never shares a prefix with
    the previous try beyond chance, whatever the search order.
    """
    return random_tokens(random.Random(f"one_long/{seed}/{length}"), vocab, length)


def multi_turn_system(cfg: BenchConfig, vocab: Sequence[int]) -> list[int]:
    """The system prefix every conversation starts with (same ids for all)."""
    rng = random.Random(f"multi_turn/system/{cfg.seed}")
    return random_tokens(rng, vocab, cfg.multi_turn_system_len)


def multi_turn_user(
    cfg: BenchConfig, vocab: Sequence[int], conversation: int, turn: int
) -> list[int]:
    """User tokens of one turn; fixed per (conversation, turn) for both modes."""
    rng = random.Random(f"multi_turn/user/{cfg.seed}/{conversation}/{turn}")
    return random_tokens(rng, vocab, cfg.multi_turn_user_len)


#: same_tokens prompts in submission order: (starts with the shared prefix,
#: tokens after it). Most lengths sit a few tokens below a multiple of 768,
#: the LCM of the 256- and 384-token blocks upstream uses for the tiny models
#: (and a multiple of every power-of-two block size up to 256), so decoding
#: crosses a block boundary and needs one more block. The first three are
#: long and admitted together in the forced-preemption budget, so they all
#: grow at once in a full pool, which is what makes the scheduler preempt.
SAME_TOKENS_LAYOUT: tuple[tuple[bool, int], ...] = (
    (True, 120),
    (False, 760),
    (True, 120),
    (True, 60),
    (False, 1528),
    (False, 376),
    (False, 120),
    (False, 40),
)
#: Length of the prefix the ``True`` entries share.
SAME_TOKENS_PREFIX = 640


def same_tokens_prompts(seed: int, vocab: Sequence[int]) -> list[list[int]]:
    """Eight fixed prompts: long and short ones, three with a common prefix."""
    rng = random.Random(f"same_tokens/{seed}")
    prefix = random_tokens(rng, vocab, SAME_TOKENS_PREFIX)
    return [
        (prefix if shared else []) + random_tokens(rng, vocab, n)
        for shared, n in SAME_TOKENS_LAYOUT
    ]


#: KV budget of the forced-preemption run per model kind: room for about
#: three of the 760-token prompts in upstream's plan (6 blocks of 1 MiB each
#: for qwen3_5, 5 blocks of 0.75 MiB for qwen3_next), but not for their growth.
PREEMPT_BUDGET_MIB: dict[str, float] = {"qwen3_5": 20.0, "qwen3_next": 12.0}
DEFAULT_PREEMPT_BUDGET_MIB = 16.0


def preempt_budget_bytes(cfg: BenchConfig, kind: str) -> int:
    """The forced-preemption budget: the CLI value, else the kind's default."""
    if cfg.preempt_budget_bytes is not None:
        return cfg.preempt_budget_bytes
    return int(PREEMPT_BUDGET_MIB.get(kind, DEFAULT_PREEMPT_BUDGET_MIB) * MIB)


# ---------------------------------------------------------------------------
# KV geometry and pools (pure; work on upstream's config classes)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class KVGeometry:
    """What one request really needs, from the model's layer specs.

    Uses unpadded sizes: the point of ``needed/reserved`` is to show how much
    of the reserved memory is padding, rounding and fragmentation.
    """

    #: Bytes one token occupies summed over all attention layers.
    attn_bytes_per_token: float
    #: Bytes of one request's recurrent state summed over all state layers.
    state_bytes_per_request: int
    num_attention_layers: int
    num_state_layers: int
    #: Layers of other spec types; they are not counted in "needed".
    other_layers: tuple[str, ...] = ()

    def bytes_needed(self, num_computed_tokens: Iterable[int]) -> float:
        """Bytes the running requests with these token counts truly need."""
        counts = list(num_computed_tokens)
        return sum(counts) * self.attn_bytes_per_token + len(counts) * (
            self.state_bytes_per_request
        )

    def token_bound(self, budget_bytes: int) -> int:
        """Longest sequence one request could have if bytes were exact."""
        if self.attn_bytes_per_token <= 0:
            return 0
        free = budget_bytes - self.state_bytes_per_request
        return max(0, math.floor(free / self.attn_bytes_per_token))


def _layer_specs(group: Any) -> Iterator[tuple[str, Any]]:
    """(layer name, spec) of every layer of a KV cache group."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        yield from spec.kv_cache_specs.items()
        return
    for name in group.layer_names:
        yield name, spec


def kv_geometry(kv_cache_config: Any) -> KVGeometry:
    """Per-token and per-request bytes of a ``KVCacheConfig``'s layers.

    Attention layers count ``real_page_size_bytes / block_size`` per token
    (a full page without ``page_size_padded``); state layers (``MambaSpec``:
    Mamba, GDN, short conv) count their unpadded state, the bytes of
    ``shapes``/``dtypes``, not ``page_size_padded``.
    """
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    per_token = 0.0
    state = 0
    n_attn = n_state = 0
    other: list[str] = []
    for group in kv_cache_config.kv_cache_groups:
        for name, spec in _layer_specs(group):
            if isinstance(spec, MambaSpec):
                state += spec.real_page_size_bytes
                n_state += 1
            elif isinstance(spec, AttentionSpec):
                per_token += spec.real_page_size_bytes / spec.block_size
                n_attn += 1
            else:
                other.append(name)
    return KVGeometry(per_token, state, n_attn, n_state, tuple(other))


@dataclass(frozen=True)
class PoolView:
    """One block pool as the benchmark sees it, whatever its implementation.

    ``num_blocks_total`` counts the blocks requests can get (never the null
    block), so ``used`` is what requests and the prefix cache's live blocks
    hold. Evictable cached blocks count as free, as the allocator sees them.
    """

    name: str
    block_bytes: int
    num_blocks_total: int
    num_free: int

    @property
    def used(self) -> int:
        return self.num_blocks_total - self.num_free

    @property
    def reserved_bytes(self) -> int:
        return self.used * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_blocks_total * self.block_bytes


def _count(value: Any) -> int | None:
    """An int from an attribute that may be a number, a callable or a range."""
    if value is None:
        return None
    if callable(value):
        value = value()
    if isinstance(value, int):
        return value
    try:
        return len(value)
    except TypeError:
        return None


def _owned_blocks(pool: Any) -> int | None:
    """Blocks an arena pool owns now (it may own fewer ids than it indexes)."""
    for attr in ("owned_blocks", "owned_capacity", "owned_ids"):
        count = _count(getattr(pool, attr, None))
        if count is not None:
            return count
    return None


def _pooled_block_bytes(coordinator: Any, name: str, pool: Any) -> int:
    """Bytes of one block id of a named pool of the arena."""
    value = getattr(pool, "block_bytes", None)
    if value is not None:
        return int(value)
    config = getattr(coordinator, "kv_cache_config", None)
    for spec in getattr(config, "pools", None) or ():
        if getattr(spec, "kind", None) == name:
            return int(spec.block_bytes)
    raise AttributeError(f"cannot find the block size in bytes of pool {name!r}")


def shared_pool_block_bytes(kv_cache_config: Any) -> int:
    """Bytes of one block id of upstream's single pool.

    Every group's ``KVCacheTensor`` aliases one allocation of
    ``bytes_per_block * num_blocks`` bytes from byte 0, so a block id stands
    for ``size / num_blocks`` bytes across all layers.
    """
    tensors = kv_cache_config.kv_cache_tensors
    if not tensors or kv_cache_config.num_blocks <= 0:
        return 0
    return max(t.size for t in tensors) // kv_cache_config.num_blocks


def coupled_evictions(scheduler: Any) -> int | None:
    """Blocks pooled mode evicted because the other pool made them useless
    (coordinated prefix-cache eviction); None without coupling."""
    coordinator = getattr(scheduler.kv_cache_manager, "coordinator", None)
    links = getattr(getattr(coordinator, "arena", None), "links", None)
    return None if links is None else sum(links.evictions.values())


def _delta(after: int | None, before: int | None) -> int | None:
    return None if after is None or before is None else after - before


def kv_pools(scheduler: Any) -> list[PoolView]:
    """The block pools of a scheduler; the one place that knows their shape.

    Pooled mode exposes ``kv_cache_manager.coordinator.pools`` (name -> pool
    of an elastic arena, owning ``owned_*`` blocks of its id space, null
    excluded); otherwise there is upstream's single ``block_pool`` whose
    ``num_gpu_blocks`` includes the null block.
    """
    manager = scheduler.kv_cache_manager
    coordinator = getattr(manager, "coordinator", None)
    pools = getattr(coordinator, "pools", None)
    if isinstance(pools, dict) and pools:
        views = []
        for name, pool in pools.items():
            owned = _owned_blocks(pool)
            total = owned if owned is not None else pool.num_gpu_blocks - 1
            views.append(
                PoolView(
                    name=str(name),
                    block_bytes=_pooled_block_bytes(coordinator, name, pool),
                    num_blocks_total=total,
                    num_free=pool.get_num_free_blocks(),
                )
            )
        return views
    pool = manager.block_pool
    return [
        PoolView(
            name="shared",
            block_bytes=shared_pool_block_bytes(scheduler.kv_cache_config),
            num_blocks_total=pool.num_gpu_blocks - 1,
            num_free=pool.get_num_free_blocks(),
        )
    ]


def kv_layout_name(pools: Sequence[PoolView]) -> str:
    """ "pooled" when the scheduler has separate pools, else "single"."""
    return "pooled" if len(pools) > 1 else "single"


# ---------------------------------------------------------------------------
# Formatting (pure)
# ---------------------------------------------------------------------------


def ratio(overlay: Any, upstream: Any) -> float | None:
    """overlay / upstream for numbers; None when it has no meaning."""
    if isinstance(overlay, bool) or isinstance(upstream, bool):
        return None
    if not isinstance(overlay, (int, float)) or not isinstance(upstream, (int, float)):
        return None
    if upstream == 0 or math.isnan(upstream) or math.isnan(overlay):
        return None
    return overlay / upstream


def format_value(value: Any) -> str:
    """Short, aligned-friendly text for a table cell."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:.1f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    text = str(value)
    return text if len(text) <= 32 else text[:29] + "..."


def format_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


@dataclass(frozen=True)
class Row:
    """One line of the final table."""

    model: str
    workload: str
    metric: str
    upstream: Any
    overlay: Any

    @property
    def ratio(self) -> float | None:
        return ratio(self.overlay, self.upstream)

    def cells(self) -> list[str]:
        return [
            self.model,
            self.workload,
            self.metric,
            format_value(self.upstream),
            format_value(self.overlay),
            format_ratio(self.ratio),
        ]


TABLE_HEADER: tuple[str, ...] = (
    "model",
    "workload",
    "metric",
    "upstream",
    "overlay",
    "overlay/upstream",
)


def format_table(rows: Sequence[Row]) -> str:
    """Plain-text table; numbers right-aligned, names left-aligned."""
    lines = [list(TABLE_HEADER)] + [row.cells() for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(TABLE_HEADER))]

    def render(cells: Sequence[str]) -> str:
        left = [c.ljust(w) for c, w in zip(cells[:3], widths[:3], strict=True)]
        right = [c.rjust(w) for c, w in zip(cells[3:], widths[3:], strict=True)]
        return "  ".join(left + right).rstrip()

    out = [render(lines[0]), "  ".join("-" * w for w in widths)]
    out += [render(line) for line in lines[1:]]
    return "\n".join(out)


# ---------------------------------------------------------------------------
# Engine helpers (vLLM imported lazily so the pure helpers load fast)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSpec:
    """Arguments of one engine; identical for both modes by construction."""

    model_path: str
    budget_bytes: int
    prefix_caching: bool
    max_num_seqs: int
    max_model_len: int
    enforce_eager: bool
    seed: int
    block_size: int | None = None
    mamba_block_size: int | None = None
    couple_prefix_caches: bool = True
    mamba_ssm_cache_dtype: str = BenchConfig.mamba_ssm_cache_dtype

    def llm_kwargs(self) -> dict[str, Any]:
        extra = {} if self.block_size is None else {"block_size": self.block_size}
        if not self.couple_prefix_caches:
            extra["additional_config"] = {"hybrid_kv": {"couple_prefix_caches": False}}
        if self.mamba_block_size is not None and self.prefix_caching:
            extra["mamba_block_size"] = self.mamba_block_size
        return extra | {
            "model": self.model_path,
            "kv_cache_memory_bytes": self.budget_bytes,
            "kv_cache_dtype": "auto",
            "enable_prefix_caching": self.prefix_caching,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            "mamba_ssm_cache_dtype": self.mamba_ssm_cache_dtype,
        }


def llm_vocab(llm: Any) -> list[int]:
    """Token ids random prompts may use (tokenizer and model agree on)."""
    tokenizer = llm.get_tokenizer()
    model_size = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    return allowed_token_ids(min(len(tokenizer), model_size), tokenizer.all_special_ids)


@dataclass
class Engine:
    """An open ``vllm.LLM`` with the handles the workloads read."""

    llm: Any
    spec: EngineSpec
    start_s: float

    @property
    def core(self) -> Any:
        """The in-process ``EngineCore`` (needs multiprocessing off)."""
        return self.llm.llm_engine.engine_core.engine_core

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def vllm_config(self) -> Any:
        return self.llm.llm_engine.vllm_config

    def vocab(self) -> list[int]:
        return llm_vocab(self.llm)

    def describe(self) -> dict[str, Any]:
        """Engine facts for the report: capacity, pools, plan."""
        cache = self.vllm_config.cache_config
        pools = kv_pools(self.scheduler)
        return {
            "start_s": round(self.start_s, 2),
            "kv_layout": kv_layout_name(pools),
            "pools": [asdict(p) for p in pools],
            "kv_bytes_total": sum(p.total_bytes for p in pools),
            "reported_capacity_tokens": getattr(cache, "kv_cache_size_tokens", None),
            "max_model_len": self.vllm_config.model_config.max_model_len,
            "max_num_batched_tokens": (
                self.vllm_config.scheduler_config.max_num_batched_tokens
            ),
            "mamba_cache_mode": getattr(cache, "mamba_cache_mode", None),
            "group_block_sizes": [
                g.kv_cache_spec.block_size
                for g in self.scheduler.kv_cache_config.kv_cache_groups
            ],
        }

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())


@contextlib.contextmanager
def open_engine(spec: EngineSpec) -> Iterator[Engine]:
    """Start an engine and always release it (and vLLM's process state)."""
    from vllm import LLM

    start = time.perf_counter()
    llm = None
    try:
        llm = LLM(**spec.llm_kwargs())
        yield Engine(llm, spec, time.perf_counter() - start)
    finally:
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        from vllm.distributed import cleanup_dist_env_and_memory

        with contextlib.suppress(Exception):
            cleanup_dist_env_and_memory()


@dataclass(frozen=True)
class KVSample:
    """Scheduler state after one engine step."""

    step: int
    running: int
    waiting: int
    reserved_bytes: int
    needed_bytes: float

    @property
    def needed_over_reserved(self) -> float | None:
        if self.reserved_bytes <= 0:
            return None
        return self.needed_bytes / self.reserved_bytes


def sample_kv(scheduler: Any, geometry: KVGeometry, step: int) -> KVSample:
    """Needed vs reserved bytes of the requests running now."""
    running = list(scheduler.running)
    return KVSample(
        step=step,
        running=len(running),
        waiting=len(scheduler.waiting),
        reserved_bytes=sum(p.reserved_bytes for p in kv_pools(scheduler)),
        needed_bytes=geometry.bytes_needed(r.num_computed_tokens for r in running),
    )


@dataclass(frozen=True)
class Submission:
    """One request to add: our id, its prompt ids and its output length."""

    key: str
    prompt: list[int]
    max_tokens: int
    #: top log-probabilities to return per output token (None: none)
    logprobs: int | None = None


@dataclass
class DriveResult:
    """Outcome of driving a batch of requests to completion (or a limit)."""

    outputs: dict[str, Any]
    steps: int
    wall_s: float
    samples: list[KVSample]
    preemptions: int
    #: finished | stalled | time_limit | preempted | rejected
    outcome: str
    detail: str = ""
    #: CPU seconds of this process during the drive; unlike wall time it
    #: barely moves when other jobs share the machine's cores.
    cpu_s: float = 0.0

    def output_tokens(self) -> int:
        return sum(len(o.outputs[0].token_ids) for o in self.outputs.values())

    def token_ids(self, key: str) -> list[int]:
        return [int(t) for t in self.outputs[key].outputs[0].token_ids]

    def top2_gaps(self, key: str) -> list[float | None]:
        """:func:`top2_gaps_of` the request's completion."""
        return top2_gaps_of(self.outputs[key].outputs[0])


def top2_gaps_of(completion: Any) -> list[float | None]:
    """Per output token of a vLLM ``CompletionOutput``: log-probability of
    the best token minus the second best (needs ``logprobs >= 2``); how
    close greedy decoding was to a tie there."""
    gaps: list[float | None] = []
    for position in completion.logprobs or []:
        best = sorted((lp.logprob for lp in position.values()), reverse=True)
        gaps.append(best[0] - best[1] if len(best) > 1 else None)
    return gaps


@dataclass
class _PreemptionCounter:
    """Counts preemptions from ``Request.num_preemptions``.

    The scheduler increments ``num_preemptions`` on the request each time it
    preempts it; a preempted request stays in ``scheduler.requests`` (waiting)
    for at least one more step, so sampling after every step sees every count.
    """

    seen: dict[str, int] = field(default_factory=dict)

    def update(self, scheduler: Any) -> None:
        for req_id, request in scheduler.requests.items():
            count = int(getattr(request, "num_preemptions", 0) or 0)
            if count > self.seen.get(req_id, 0):
                self.seen[req_id] = count

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def _progress(scheduler: Any) -> int:
    """A number that grows whenever the engine computes any token."""
    return sum(
        r.num_computed_tokens + r.num_output_tokens for r in scheduler.requests.values()
    )


def drive(
    engine: Engine,
    submissions: Sequence[Submission],
    cfg: BenchConfig,
    geometry: KVGeometry | None = None,
    stop_on_preemption: bool = False,
) -> DriveResult:
    """Add every request, then step the engine until all are finished.

    Stepping by hand (instead of ``LLM.generate``) lets the harness sample
    the scheduler after every step. A drive also ends when no token was
    computed for ``cfg.stall_steps`` steps (upstream can leave a request that
    never fits waiting forever), at the time limit, or on the first
    preemption if asked; unfinished requests are then aborted.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm_engine = engine.llm.llm_engine
    scheduler = engine.scheduler
    internal: dict[str, str] = {}
    for sub in submissions:
        # Random weights emit EOS at random: ignore it so lengths are fixed.
        params = SamplingParams(
            max_tokens=sub.max_tokens,
            temperature=0.0,
            ignore_eos=True,
            logprobs=sub.logprobs,
        )
        try:
            internal[sub.key] = llm_engine.add_request(
                sub.key, TokensPrompt(prompt_token_ids=sub.prompt), params
            )
        except Exception as exc:  # validation (e.g. longer than max_model_len)
            _abort(llm_engine, internal.values())
            detail = f"{type(exc).__name__}: {exc}"
            return DriveResult({}, 0, 0.0, [], 0, "rejected", detail)
    outputs: dict[str, Any] = {}
    samples: list[KVSample] = []
    counter = _PreemptionCounter()
    start = time.perf_counter()
    cpu_start = time.process_time()
    steps = idle = 0
    last_progress = -1
    outcome = "finished"
    while llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            if out.finished:
                outputs[out.request_id] = out
        steps += 1
        counter.update(scheduler)
        if geometry is not None:
            samples.append(sample_kv(scheduler, geometry, steps))
        progress = _progress(scheduler) + len(outputs)
        idle = idle + 1 if progress == last_progress else 0
        last_progress = progress
        if stop_on_preemption and counter.total:
            outcome = "preempted"
        elif idle >= cfg.stall_steps:
            outcome = "stalled"
        elif time.perf_counter() - start > cfg.drive_time_limit_s:
            outcome = "time_limit"
        if outcome != "finished":
            _abort(llm_engine, [internal[k] for k in internal if k not in outputs])
            break
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    return DriveResult(outputs, steps, wall, samples, counter.total, outcome, cpu_s=cpu)


def _abort(llm_engine: Any, internal_ids: Iterable[str]) -> None:
    ids = list(internal_ids)
    if ids:
        llm_engine.abort_request(ids, internal=True)


# ---------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------


def _peak_samples(samples: Sequence[KVSample]) -> dict[str, Any]:
    """Peak running, and needed/reserved at the first step of that peak."""
    if not samples:
        return {}
    peak = max(samples, key=lambda s: (s.running, -s.step))
    ratios = [s.needed_over_reserved for s in samples if s.running]
    ratios = [r for r in ratios if r is not None]
    return {
        "peak_running": peak.running,
        "peak_step": peak.step,
        "needed_bytes_at_peak": round(peak.needed_bytes),
        "reserved_bytes_at_peak": peak.reserved_bytes,
        "needed_over_reserved_at_peak": peak.needed_over_reserved,
        "max_needed_over_reserved": max(ratios) if ratios else None,
        "mean_needed_over_reserved": sum(ratios) / len(ratios) if ratios else None,
        "max_reserved_bytes": max(s.reserved_bytes for s in samples),
    }


def _per(amount: float, seconds: float) -> float | None:
    """A rate, or None for an empty interval."""
    return amount / seconds if seconds > 0 else None


def _check_finished(result: DriveResult, workload: str) -> None:
    if result.outcome != "finished":
        raise RuntimeError(
            f"{workload}: engine drive ended {result.outcome} after "
            f"{result.steps} steps {result.detail}".rstrip()
        )


def run_many_short(engine: Engine, cfg: BenchConfig) -> dict[str, Any]:
    """64 random prompts at once under the 48 MiB budget."""
    geometry = kv_geometry(engine.scheduler.kv_cache_config)
    prompts = many_short_prompts(cfg, engine.vocab())
    subs = [
        Submission(f"short-{i}", p, cfg.many_short_output)
        for i, p in enumerate(prompts)
    ]
    result = drive(engine, subs, cfg, geometry=geometry)
    _check_finished(result, "many_short")
    out_tokens = result.output_tokens()
    metrics = {
        **_peak_samples(result.samples),
        "preemptions": result.preemptions,
        "steps": result.steps,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tok_per_s": _per(out_tokens, result.wall_s),
        "cpu_s": result.cpu_s,
        "output_tok_per_cpu_s": _per(out_tokens, result.cpu_s),
        "attn_bytes_per_token": geometry.attn_bytes_per_token,
        "state_bytes_per_request": geometry.state_bytes_per_request,
    }
    details = {
        "running_per_step": [s.running for s in result.samples],
        "needed_over_reserved_per_step": [
            s.needed_over_reserved for s in result.samples
        ],
    }
    return {"metrics": metrics, "details": details, "wall_s": result.wall_s}


def run_multi_turn(engine: Engine, cfg: BenchConfig) -> dict[str, Any]:
    """Conversations sharing a system prefix, run turn by turn."""
    engine.reset_prefix_cache()
    evicted_before = coupled_evictions(engine.scheduler)
    vocab = engine.vocab()
    system = multi_turn_system(cfg, vocab)
    histories = [list(system) for _ in range(cfg.multi_turn_conversations)]
    per_turn: list[dict[str, Any]] = []
    cached = prompt_tokens = out_tokens = preemptions = 0
    wall = cpu = 0.0
    for turn in range(cfg.multi_turn_turns):
        subs = [
            Submission(
                f"conv{conv}-turn{turn}",
                history + multi_turn_user(cfg, vocab, conv, turn),
                cfg.multi_turn_output,
            )
            for conv, history in enumerate(histories)
        ]
        result = drive(engine, subs, cfg)
        _check_finished(result, f"multi_turn turn {turn}")
        turn_cached = sum(o.num_cached_tokens or 0 for o in result.outputs.values())
        turn_prompt = sum(len(s.prompt) for s in subs)
        per_turn.append(
            {
                "turn": turn,
                "prompt_tokens": turn_prompt,
                "cached_tokens": turn_cached,
                "hit_rate": turn_cached / turn_prompt,
                "preemptions": result.preemptions,
            }
        )
        for conv, sub in enumerate(subs):
            histories[conv] = sub.prompt + result.token_ids(sub.key)
        cached += turn_cached
        prompt_tokens += turn_prompt
        out_tokens += result.output_tokens()
        preemptions += result.preemptions
        wall += result.wall_s
        cpu += result.cpu_s
    metrics = {
        "hit_rate": cached / prompt_tokens if prompt_tokens else None,
        "hit_rate_last_turn": per_turn[-1]["hit_rate"] if per_turn else None,
        "coupled_evictions": _delta(
            coupled_evictions(engine.scheduler), evicted_before
        ),
        "cached_tokens": cached,
        "prompt_tokens": prompt_tokens,
        "preemptions": preemptions,
        "output_tok_per_s": _per(out_tokens, wall),
        "cpu_s": cpu,
        "output_tok_per_cpu_s": _per(out_tokens, cpu),
    }
    return {"metrics": metrics, "details": {"turns": per_turn}, "wall_s": wall}


def _same_tokens_pass(
    engine: Engine, cfg: BenchConfig, prompts: Sequence[list[int]]
) -> dict[str, Any]:
    """One batch of the fixed prompts; token ids per prompt."""
    subs = [
        Submission(f"fixed-{i}", p, cfg.same_tokens_output, logprobs=2)
        for i, p in enumerate(prompts)
    ]
    result = drive(engine, subs, cfg)
    _check_finished(result, "same_tokens")
    return {
        "tokens": [result.token_ids(s.key) for s in subs],
        "top2_gaps": [result.top2_gaps(s.key) for s in subs],
        "preemptions": result.preemptions,
        "cached_tokens": sum(o.num_cached_tokens or 0 for o in result.outputs.values()),
        "wall_s": result.wall_s,
    }


def run_same_tokens_on(engine: Engine, cfg: BenchConfig) -> dict[str, Any]:
    """Prefix caching on: a cold pass, then the same prompts again (hits)."""
    engine.reset_prefix_cache()
    prompts = same_tokens_prompts(cfg.seed, engine.vocab())
    return {
        "pc_on": _same_tokens_pass(engine, cfg, prompts),
        "pc_on_repeat": _same_tokens_pass(engine, cfg, prompts),
    }


def run_same_tokens_plain(
    engine: Engine, cfg: BenchConfig, name: str
) -> dict[str, Any]:
    """One pass of the fixed prompts on an engine set up for ``name``."""
    prompts = same_tokens_prompts(cfg.seed, engine.vocab())
    return {name: _same_tokens_pass(engine, cfg, prompts)}


def run_same_tokens_alone(engine: Engine, cfg: BenchConfig) -> dict[str, Any]:
    """Each fixed prompt by itself, one after the other (prefix caching off).

    Against the batched ``pc_off`` pass of the same engine this shows whether
    a request's tokens depend on the requests it is batched with: a
    difference here, in either mode, is the kernels' batch dependence, which
    any change of schedule (more requests admitted, other prefix hits, other
    preemptions) exposes.
    """
    prompts = same_tokens_prompts(cfg.seed, engine.vocab())
    passes = [_same_tokens_pass(engine, cfg, [prompt]) for prompt in prompts]
    return {
        "alone": {
            "tokens": [p["tokens"][0] for p in passes],
            "top2_gaps": [p["top2_gaps"][0] for p in passes],
            "preemptions": sum(p["preemptions"] for p in passes),
            "cached_tokens": sum(p["cached_tokens"] for p in passes),
            "wall_s": sum(p["wall_s"] for p in passes),
        }
    }


def omp_threads() -> int:
    """OpenMP threads this process computes with."""
    import torch

    return int(torch.get_num_threads())


@dataclass(frozen=True)
class Try:
    """One one_long attempt."""

    length: int
    outcome: str
    steps: int
    wall_s: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome == "finished"


def try_one_long(engine: Engine, cfg: BenchConfig, length: int) -> Try:
    """Can a ``length``-token prompt finish alone, without preemption?"""
    prompt = one_long_prompt(cfg.seed, engine.vocab(), length)
    sub = Submission(f"long-{length}", prompt, cfg.one_long_output)
    try:
        result = drive(engine, [sub], cfg, stop_on_preemption=True)
    except Exception as exc:  # the engine itself failed on this request
        return Try(length, "error", 0, 0.0, f"{type(exc).__name__}: {exc}")
    outcome = result.outcome
    if outcome == "finished":
        produced = len(result.token_ids(sub.key))
        if produced != cfg.one_long_output:
            outcome = "short_output"
    engine.reset_prefix_cache()
    return Try(length, outcome, result.steps, round(result.wall_s, 2), result.detail)


def longest_completing(
    check: Callable[[int], bool], low: int, high: int
) -> tuple[int, list[int]]:
    """Largest n in [low, high] with check(n), assuming monotonicity.

    Returns (n, probed lengths); n is low - 1 when even ``low`` fails.
    """
    probed: list[int] = []
    best = low - 1
    lo, hi = low, high
    while lo <= hi:
        mid = (lo + hi) // 2
        probed.append(mid)
        if check(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best, probed


def run_one_long(engine: Engine, cfg: BenchConfig) -> dict[str, Any]:
    """Binary search for the longest prompt that finishes without preemption."""
    geometry = kv_geometry(engine.scheduler.kv_cache_config)
    max_len = engine.vllm_config.model_config.max_model_len
    high = min(max_len - cfg.one_long_output, cfg.one_long_search_cap)
    tries: list[Try] = []

    def check(length: int) -> bool:
        outcome = try_one_long(engine, cfg, length)
        tries.append(outcome)
        return outcome.ok

    start = time.perf_counter()
    longest, _ = longest_completing(check, 1, high)
    wall = time.perf_counter() - start
    return _one_long_metrics(engine, cfg, geometry, longest, tries, wall)


def _one_long_metrics(
    engine: Engine | None,
    cfg: BenchConfig,
    geometry: KVGeometry | None,
    longest: int,
    tries: Sequence[Try],
    wall: float,
) -> dict[str, Any]:
    reported = None
    if engine is not None:
        reported = engine.vllm_config.cache_config.kv_cache_size_tokens
    bound = geometry.token_bound(cfg.one_long_budget_bytes) if geometry else None
    failures = [t for t in tries if not t.ok]
    metrics = {
        "longest_prompt": longest,
        "reported_capacity_tokens": reported,
        "reported_over_longest": (reported / longest) if reported and longest else None,
        "bound_tokens": bound,
        "longest_over_bound": (longest / bound) if bound else None,
        "tries": len(tries),
        "failed_tries_preempted": sum(t.outcome == "preempted" for t in failures),
        "failed_tries_stalled": sum(t.outcome == "stalled" for t in failures),
        "failed_tries_rejected": sum(t.outcome == "rejected" for t in failures),
    }
    details = {"tries": [asdict(t) for t in tries]}
    return {"metrics": metrics, "details": details, "wall_s": wall}


# ---------------------------------------------------------------------------
# Worker
# ---------------------------------------------------------------------------


@dataclass
class WorkerReport:
    """Everything one worker process measured, printed as one JSON line."""

    model: str
    mode: str
    overlay_active: bool | None = None
    overlay_state: str = ""
    vllm_version: str = ""
    workloads: dict[str, dict[str, Any]] = field(default_factory=dict)
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Bytes per token / per request of the model (same in both modes).
    geometry: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)
    #: where -> traceback text (tail), for the driver to print.
    tracebacks: dict[str, str] = field(default_factory=dict)

    def record_error(self, where: str, exc: BaseException) -> None:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.errors.append(f"{where}: {type(exc).__name__}: {exc}")
        key, n = where, 1
        while key in self.tracebacks:
            n += 1
            key = f"{where}#{n}"
        self.tracebacks[key] = text[-4000:]


def _overlay_state() -> tuple[bool | None, str]:
    try:
        from vllm_hybrid import plugin

        state = plugin.state()
    except Exception as exc:  # the overlay is not importable at all
        return None, f"unavailable: {exc}"
    if state is None:
        return None, "not activated"
    return state.active, state.reason


def _engine_specs(
    model_path: str, kind: str, cfg: BenchConfig
) -> dict[str, EngineSpec]:
    """The engines a worker may need, by purpose."""
    pc = kind not in NO_PREFIX_CACHING_KINDS

    def spec(
        budget: int, prefix: bool, seqs: int, max_len: int, block: int | None = None
    ) -> EngineSpec:
        return EngineSpec(
            model_path,
            budget,
            prefix,
            seqs,
            max_len,
            cfg.enforce_eager,
            cfg.seed,
            block,
            cfg.mamba_block_size if block is None else None,
            cfg.couple_prefix_caches,
            cfg.mamba_ssm_cache_dtype,
        )

    specs = {
        "main": spec(cfg.budget_bytes, pc, cfg.max_num_seqs, cfg.max_model_len),
        "no_pc": spec(cfg.budget_bytes, False, cfg.max_num_seqs, cfg.max_model_len),
        "preempt": spec(
            preempt_budget_bytes(cfg, kind),
            False,
            cfg.preempt_max_num_seqs,
            cfg.same_tokens_max_model_len,
        ),
        "one_long_pc_off": spec(
            cfg.one_long_budget_bytes,
            False,
            1,
            cfg.one_long_max_model_len,
            cfg.one_long_block_size,
        ),
    }
    if pc:
        specs["one_long_pc_on"] = spec(
            cfg.one_long_budget_bytes,
            True,
            1,
            cfg.one_long_max_model_len,
            cfg.one_long_block_size,
        )
    return specs


def _timed(
    report: WorkerReport,
    name: str,
    fn: Callable[[], dict[str, Any]],
) -> dict[str, Any] | None:
    """Run one workload piece, recording its result or its exception."""
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:
        report.record_error(name, exc)
        return None
    result.setdefault("wall_s", time.perf_counter() - start)
    return result


def _with_engine(
    report: WorkerReport,
    name: str,
    spec: EngineSpec,
    body: Callable[[Engine], None],
    start_error_is_result: bool = False,
) -> None:
    """Open one engine, run ``body`` on it, record start-up facts or errors.

    For one_long an engine that refuses the budget is a result (it can serve
    no prompt), not a harness failure, hence ``start_error_is_result``.
    """
    try:
        with open_engine(spec) as engine:
            report.engines[name] = {**engine.describe(), "spec": asdict(spec)}
            if report.geometry is None:
                geometry = kv_geometry(engine.scheduler.kv_cache_config)
                report.geometry = asdict(geometry)
            body(engine)
    except Exception as exc:
        if start_error_is_result and name not in report.engines:
            report.engines[name] = {
                "spec": asdict(spec),
                "start_error": f"{type(exc).__name__}: {exc}",
            }
            return
        report.record_error(name, exc)


def _run_main_engine(
    report: WorkerReport, engine: Engine, cfg: BenchConfig, workloads: set[str]
) -> None:
    """many_short, multi_turn and same_tokens' prefix-caching pass share it."""
    if "many_short" in workloads:
        result = _timed(report, "many_short", lambda: run_many_short(engine, cfg))
        if result is not None:
            result["engine"] = "main"
            report.workloads["many_short"] = result
    if "multi_turn" in workloads:
        result = _timed(report, "multi_turn", lambda: run_multi_turn(engine, cfg))
        if result is not None:
            result["engine"] = "main"
            report.workloads["multi_turn"] = result
    if "same_tokens" in workloads and engine.spec.prefix_caching:
        _add_same_tokens(report, lambda: run_same_tokens_on(engine, cfg))


def _add_same_tokens(report: WorkerReport, fn: Callable[[], dict[str, Any]]) -> None:
    """Merge one same_tokens configuration into the report."""
    result = _timed(report, "same_tokens", fn)
    if result is None:
        return
    result.pop("wall_s", None)
    configs = report.workloads.setdefault("same_tokens", {}).setdefault("configs", {})
    configs.update(result)


def _same_tokens_body(
    report: WorkerReport, cfg: BenchConfig, config: str
) -> Callable[[Engine], None]:
    """The same_tokens passes of the engine set up for ``config``."""

    def body(engine: Engine) -> None:
        _add_same_tokens(report, lambda: run_same_tokens_plain(engine, cfg, config))
        if config == "pc_off":
            _add_same_tokens(report, lambda: run_same_tokens_alone(engine, cfg))

    return body


def start_error(spec: EngineSpec) -> str | None:
    """Why an engine with ``spec`` does not start, or None if it does."""
    try:
        with open_engine(spec):
            return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


#: Granularity of the max_model_len search when auto-fit is refused.
MAX_MODEL_LEN_STEP = 128


def startable_max_model_len(spec: EngineSpec, cap: int) -> tuple[int, int]:
    """Largest ``max_model_len`` (a multiple of the step) an engine accepts.

    Used when an engine refuses ``max_model_len=-1`` (auto-fit): the largest
    explicit value it accepts is what auto-fit would have chosen. Returns
    (value or 0, number of probe starts).
    """
    probes = 0

    def starts(k: int) -> bool:
        nonlocal probes
        probes += 1
        trial = replace(spec, max_model_len=k * MAX_MODEL_LEN_STEP)
        return start_error(trial) is None

    best, _ = longest_completing(starts, 1, cap // MAX_MODEL_LEN_STEP)
    return best * MAX_MODEL_LEN_STEP, probes


def _one_long_part(
    report: WorkerReport, name: str, spec: EngineSpec, cfg: BenchConfig
) -> dict[str, Any]:
    """One prefix-caching setting of one_long: start, fall back, search.

    Both modes first try ``max_model_len=-1``. An engine that refuses it gets
    the largest explicit ``max_model_len`` it accepts; an engine that accepts
    none scores 0 tokens (a result, not a harness failure).
    """
    parts: dict[str, Any] = {}

    def body(engine: Engine) -> None:
        parts["result"] = run_one_long(engine, cfg)

    _with_engine(report, name, spec, body, start_error_is_result=True)
    first_error = report.engines.get(name, {}).get("start_error")
    fallback = None
    if first_error is not None and spec.max_model_len == -1:
        cap = cfg.one_long_search_cap + cfg.one_long_output
        max_len, probes = startable_max_model_len(spec, cap)
        fallback = {"max_model_len": max_len, "probe_starts": probes}
        if max_len:
            retry = replace(spec, max_model_len=max_len)
            report.engines.pop(name, None)
            _with_engine(report, name, retry, body, start_error_is_result=True)
    result = parts.get("result")
    if result is None:
        geometry = KVGeometry(**report.geometry) if report.geometry else None
        result = _one_long_metrics(None, cfg, geometry, 0, [], 0.0)
        last_error = report.engines.get(name, {}).get("start_error", first_error)
        result["metrics"]["engine_start_error"] = last_error
    result["metrics"]["auto_fit_refused"] = first_error is not None
    result["details"]["auto_fit_error"] = first_error
    result["details"]["max_model_len_fallback"] = fallback
    started = report.engines.get(name, {})
    if first_error is not None and not started.get("start_error"):
        started["auto_fit_error"] = first_error
    result["metrics"]["max_model_len"] = report.engines.get(name, {}).get(
        "max_model_len"
    )
    return result


def _run_one_long(
    report: WorkerReport, specs: dict[str, EngineSpec], cfg: BenchConfig
) -> None:
    """One engine per prefix-caching setting."""
    parts: dict[str, Any] = {}
    start = time.perf_counter()
    for pc_name in ("pc_on", "pc_off"):
        name = f"one_long_{pc_name}"
        if name in specs:
            parts[pc_name] = _one_long_part(report, name, specs[name], cfg)
    if parts:
        report.workloads["one_long"] = {
            "parts": parts,
            "wall_s": time.perf_counter() - start,
        }


def run_worker(model: str, model_dir: Path, workloads: list[str], cfg: BenchConfig):
    """Run the selected workloads for one model in this process's mode."""
    mode = "overlay" if os.environ.get("VLLM_HYBRID_KV", "1") != "0" else "upstream"
    report = WorkerReport(model=model, mode=mode)
    try:
        import vllm

        report.vllm_version = str(getattr(vllm, "__version__", "unknown"))
        from vllm_hybrid.tools.tiny_models import build_tiny_model

        path = str(build_tiny_model(model_dir / model, model))
        specs = _engine_specs(path, model, cfg)
        selected = set(workloads)
        if selected & {"many_short", "multi_turn", "same_tokens"}:
            _with_engine(
                report,
                "main",
                specs["main"],
                lambda e: _run_main_engine(report, e, cfg, selected),
            )
        if "same_tokens" in selected and cfg.same_tokens_uncached:
            for name, config in (("no_pc", "pc_off"), ("preempt", "preempt")):
                _with_engine(
                    report, name, specs[name], _same_tokens_body(report, cfg, config)
                )
        if "same_tokens" in selected:
            report.workloads.setdefault("same_tokens", {})["omp_threads"] = (
                omp_threads()
            )
        if "one_long" in selected:
            _run_one_long(report, specs, cfg)
    except Exception as exc:
        report.record_error("worker", exc)
    report.overlay_active, report.overlay_state = _overlay_state()
    for name, data in report.workloads.items():
        if name == "same_tokens" and "configs" in data:
            data["wall_s"] = sum(c["wall_s"] for c in data["configs"].values())
    print(RESULT_PREFIX + json.dumps(asdict(report)), flush=True)
    return report


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerRun:
    """One finished worker subprocess."""

    model: str
    mode: str
    returncode: int
    wall_s: float
    log_path: str
    report: dict[str, Any] | None


def parse_result(text: str) -> dict[str, Any] | None:
    """The last ``BENCH_RESULT`` JSON line of a worker's output."""
    found = None
    for line in text.splitlines():
        if line.startswith(RESULT_PREFIX):
            found = json.loads(line[len(RESULT_PREFIX) :])
    return found


def worker_env(mode: str, threads: int = 0, first_core: int = 0) -> dict[str, str]:
    """Environment of a worker: the overlay switch and in-process engines.

    ``threads`` > 0 pins the worker's vLLM CPU worker to that many OpenMP
    threads on cores ``first_core..first_core+threads-1``; 0 keeps the
    platform's choice.
    """
    env = dict(os.environ)
    env["VLLM_HYBRID_KV"] = MODE_SWITCH[mode]
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
        last = first_core + threads - 1
        env["VLLM_CPU_OMP_THREADS_BIND"] = (
            str(first_core) if threads == 1 else f"{first_core}-{last}"
        )
    return env


@dataclass(frozen=True)
class WorkerJob:
    """One worker process to run: a model, a mode and its workloads."""

    model: str
    mode: str
    workloads: tuple[str, ...]
    #: OpenMP threads (0: the platform's choice), see ``worker_env``
    threads: int = 0

    @property
    def name(self) -> str:
        part = "" if self.threads == 0 else f"-{'+'.join(self.workloads)}"
        return f"{self.model}-{self.mode}{part}"


def worker_jobs(
    models: Sequence[str], workloads: Sequence[str], cfg: BenchConfig
) -> list[WorkerJob]:
    """The workers of a run: per model and mode, one for the workloads that
    use the platform's threads and, unless ``same_tokens_threads`` is 0, one
    for same_tokens with that many threads."""
    separate = "same_tokens" in workloads and cfg.same_tokens_threads > 0
    rest = tuple(w for w in workloads if not (separate and w == "same_tokens"))
    jobs = []
    for model in models:
        for mode in MODES:
            if rest:
                jobs.append(WorkerJob(model, mode, rest))
            if separate:
                jobs.append(
                    WorkerJob(model, mode, ("same_tokens",), cfg.same_tokens_threads)
                )
    return jobs


def merge_runs(runs: Sequence[WorkerRun]) -> dict[tuple[str, str], WorkerRun]:
    """One run per (model, mode): the reports of its workers combined.

    Workloads, errors and tracebacks are joined; engine facts and geometry
    come from the first worker that reported them, so an engine both workers
    opened is described once.
    """
    merged: dict[tuple[str, str], WorkerRun] = {}
    for run in runs:
        key = (run.model, run.mode)
        prev = merged.get(key)
        if prev is None:
            merged[key] = run
            continue
        report = _merge_reports(prev.report, run.report)
        merged[key] = WorkerRun(
            run.model,
            run.mode,
            prev.returncode or run.returncode,
            prev.wall_s + run.wall_s,
            f"{prev.log_path}; {run.log_path}",
            report,
        )
    return merged


def _merge_reports(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return None
    out = dict(a)
    out["workloads"] = {**a.get("workloads", {}), **b.get("workloads", {})}
    out["engines"] = {**b.get("engines", {}), **a.get("engines", {})}
    out["geometry"] = a.get("geometry") or b.get("geometry")
    out["errors"] = [*a.get("errors", []), *b.get("errors", [])]
    out["tracebacks"] = {**b.get("tracebacks", {}), **a.get("tracebacks", {})}
    return out


class CoreSlots:
    """Which cores a worker pinned to a few threads may use while others run.

    With ``--jobs N`` up to N workers run at once; each takes a free slot k
    and a worker with T threads is pinned to cores ``k*T .. k*T+T-1`` (modulo
    the machine's cores), so single-thread workers run on separate cores
    instead of sharing core 0.
    """

    def __init__(self, jobs: int) -> None:
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for k in range(jobs):
            self._free.put(k)

    @contextlib.contextmanager
    def first_core(self, threads: int) -> Iterator[int]:
        slot = self._free.get()
        try:
            cores = os.cpu_count() or 1
            yield (slot * threads) % cores if threads > 0 else 0
        finally:
            self._free.put(slot)


def spawn_worker(
    job: WorkerJob,
    args: argparse.Namespace,
    cfg: BenchConfig,
    log_dir: Path,
    slots: CoreSlots | None = None,
) -> WorkerRun:
    """Run one worker subprocess to completion, its output in a log file."""
    model, mode = job.model, job.mode
    log_path = log_dir / f"{job.name}.log"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--models",
        model,
        "--workloads",
        ",".join(job.workloads),
        "--model-dir",
        str(args.model_dir),
        "--config-json",
        json.dumps(asdict(cfg)),
    ]
    _say(f"{job.name}: worker started, log {log_path}")
    start = time.perf_counter()
    with (
        (slots or CoreSlots(1)).first_core(job.threads) as first_core,
        open(log_path, "w") as log,
    ):
        proc = subprocess.run(
            cmd,
            env=worker_env(mode, job.threads, first_core),
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    wall = time.perf_counter() - start
    text = log_path.read_text(errors="replace")
    report = parse_result(text)
    _say(f"{job.name}: worker exited {proc.returncode} after {wall:.0f} s")
    return WorkerRun(model, mode, proc.returncode, wall, str(log_path), report)


def _say(message: str) -> None:
    print(f"[bench_pooled] {message}", flush=True)


#: Table rows per workload: (result path inside the workload, label).
MANY_SHORT_ROWS: tuple[tuple[str, str], ...] = (
    ("peak_running", "peak running requests"),
    ("preemptions", "preemptions"),
    ("needed_over_reserved_at_peak", "needed/reserved at peak"),
    ("max_needed_over_reserved", "needed/reserved max"),
    ("mean_needed_over_reserved", "needed/reserved mean"),
    ("steps", "engine steps"),
    ("output_tok_per_s", "output tokens/s"),
    ("output_tok_per_cpu_s", "output tokens/CPU s"),
    ("wall_s", "wall s"),
    ("cpu_s", "CPU s"),
)
MULTI_TURN_ROWS: tuple[tuple[str, str], ...] = (
    ("hit_rate", "prefix hit rate (tokens)"),
    ("hit_rate_last_turn", "hit rate, last turn"),
    ("coupled_evictions", "coupled evictions"),
    ("cached_tokens", "cached tokens"),
    ("prompt_tokens", "prompt tokens"),
    ("preemptions", "preemptions"),
    ("output_tok_per_s", "output tokens/s"),
    ("output_tok_per_cpu_s", "output tokens/CPU s"),
    ("wall_s", "wall s"),
    ("cpu_s", "CPU s"),
)
ONE_LONG_ROWS: tuple[tuple[str, str], ...] = (
    ("longest_prompt", "longest prompt"),
    ("reported_capacity_tokens", "reported capacity"),
    ("reported_over_longest", "reported/longest"),
    ("bound_tokens", "bound (budget-state)/attn"),
    ("longest_over_bound", "longest/bound"),
    ("failed_tries_preempted", "tries preempted"),
    ("failed_tries_stalled", "tries stalled"),
    ("max_model_len", "max_model_len used"),
    ("auto_fit_refused", "refused max_model_len=-1"),
    ("engine_start_error", "engine start error"),
)


def _workload(report: dict[str, Any] | None, name: str) -> dict[str, Any]:
    if not report:
        return {}
    return report.get("workloads", {}).get(name, {}) or {}


def _metric(workload: dict[str, Any], key: str) -> Any:
    if key == "wall_s":
        return workload.get("wall_s")
    return workload.get("metrics", {}).get(key)


#: Per-engine rows: (key of the engine description, label).
ENGINE_ROWS: tuple[tuple[str, str], ...] = (
    ("kv_layout", "kv layout"),
    ("kv_bytes_total", "kv bytes in blocks"),
    ("reported_capacity_tokens", "reported capacity tokens"),
    ("max_model_len", "max_model_len"),
    ("start_s", "start s"),
)


def _engines(report: dict[str, Any] | None) -> dict[str, Any]:
    return ((report or {}).get("engines")) or {}


def _engine_value(engine: dict[str, Any], key: str) -> Any:
    if key == "kv_layout" and engine.get("start_error"):
        return "start failed"
    return engine.get(key)


def _engine_rows(model: str, up: dict | None, ov: dict | None) -> list[Row]:
    """Which KV layout each mode ran, and its capacity, per engine."""
    rows = [
        Row(
            model,
            "setup",
            "overlay active",
            (up or {}).get("overlay_active"),
            (ov or {}).get("overlay_active"),
        )
    ]
    eu_all, eo_all = _engines(up), _engines(ov)
    for name in list(dict.fromkeys([*eu_all, *eo_all])):
        eu, eo = eu_all.get(name, {}), eo_all.get(name, {})
        rows += [
            Row(
                model,
                f"engine {name}",
                label,
                _engine_value(eu, key),
                _engine_value(eo, key),
            )
            for key, label in ENGINE_ROWS
        ]
    return rows


def start_error_notes(runs: Sequence[WorkerRun]) -> list[str]:
    """Full text of engine start errors (the table truncates them)."""
    notes = []
    for run in runs:
        for name, engine in _engines(run.report).items():
            for key in ("auto_fit_error", "start_error"):
                if engine.get(key):
                    notes.append(f"{run.model}/{run.mode} {name} {key}: {engine[key]}")
    return notes


def tokens_verdict(upstream: Sequence[list[int]], overlay: Sequence[list[int]]) -> str:
    """ "k/n prompts equal", comparing token ids prompt by prompt."""
    n = max(len(upstream), len(overlay))
    same = sum(a == b for a, b in zip(upstream, overlay, strict=False))
    return f"{same}/{n} prompts equal"


def first_difference(mine: Sequence[int], theirs: Sequence[int]) -> int | None:
    """Index of the first token where two completions differ (the shorter
    one's length if one is a prefix of the other); None if they are equal."""
    if list(mine) == list(theirs):
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(mine, theirs, strict=False)) if x != y),
        min(len(mine), len(theirs)),
    )


def first_difference_gap(run: dict[str, Any], other: Sequence[list[int]]) -> str:
    """Largest, over the prompts whose tokens differ from ``other``'s, of this
    run's best-minus-second log-probability at the first differing token: a
    small value means greedy decoding was close to a tie there, so rounding
    noise decides the token."""
    worst: float | None = None
    for mine, theirs, gaps in zip(
        run["tokens"], other, run.get("top2_gaps", []), strict=False
    ):
        at = first_difference(mine, theirs)
        if at is None:
            continue
        gap = gaps[at] if at < len(gaps) else None
        if gap is not None:
            worst = gap if worst is None else max(worst, gap)
    return "-" if worst is None else f"{worst:.4f}"


def _same_tokens_rows(model: str, up: dict | None, ov: dict | None) -> list[Row]:
    """Token-for-token equality per configuration, plus preemption counts.

    Besides overlay vs upstream, each configuration is compared with the
    ``pc_off`` run of the same mode: a difference there in both modes means
    numerics (prefix-cache state, recomputation) rather than the overlay.
    """
    cu = _workload(up, "same_tokens").get("configs", {})
    co = _workload(ov, "same_tokens").get("configs", {})
    rows: list[Row] = []
    for name in list(dict.fromkeys([*cu, *co])):
        a, b = cu.get(name), co.get(name)
        where = f"same_tokens {name}"
        verdict = tokens_verdict(a["tokens"], b["tokens"]) if a and b else "missing"
        rows.append(Row(model, where, "overlay == upstream", "", verdict))
        if a and b and a["tokens"] != b["tokens"]:
            rows.append(
                Row(
                    model,
                    where,
                    "top-2 logprob gap, 1st diff",
                    first_difference_gap(a, b["tokens"]),
                    first_difference_gap(b, a["tokens"]),
                )
            )
        if name != "pc_off":
            rows.append(
                Row(
                    model,
                    where,
                    "== pc_off, same mode",
                    _same_as_pc_off(cu, name),
                    _same_as_pc_off(co, name),
                )
            )
        for key, label in (
            ("preemptions", "preemptions"),
            ("cached_tokens", "cached tokens"),
        ):
            rows.append(
                Row(model, where, label, (a or {}).get(key), (b or {}).get(key))
            )
    if cu or co:
        wu, wo = _workload(up, "same_tokens"), _workload(ov, "same_tokens")
        for key, label in (("omp_threads", "OpenMP threads"), ("wall_s", "wall s")):
            rows.append(Row(model, "same_tokens", label, wu.get(key), wo.get(key)))
    return rows


def _same_as_pc_off(configs: dict[str, Any], name: str) -> str | None:
    base, other = configs.get("pc_off"), configs.get(name)
    if not base or not other:
        return None
    return tokens_verdict(base["tokens"], other["tokens"])


def comparison_rows(model: str, up: dict | None, ov: dict | None) -> list[Row]:
    """All table rows of one model."""
    rows = _engine_rows(model, up, ov)
    for name, spec in (
        ("many_short", MANY_SHORT_ROWS),
        ("multi_turn", MULTI_TURN_ROWS),
    ):
        wu, wo = _workload(up, name), _workload(ov, name)
        if not (wu or wo):
            continue
        rows += [
            Row(model, name, label, _metric(wu, key), _metric(wo, key))
            for key, label in spec
        ]
    pu = _workload(up, "one_long").get("parts", {})
    po = _workload(ov, "one_long").get("parts", {})
    for part in list(dict.fromkeys([*pu, *po])):
        wu, wo = pu.get(part, {}), po.get(part, {})
        for key, label in ONE_LONG_ROWS:
            a, b = _metric(wu, key), _metric(wo, key)
            if key == "engine_start_error" and a is None and b is None:
                continue
            rows.append(Row(model, f"one_long {part}", label, a, b))
        rows.append(
            Row(model, f"one_long {part}", "wall s", wu.get("wall_s"), wo.get("wall_s"))
        )
    rows += _same_tokens_rows(model, up, ov)
    return rows


def run_failures(runs: Sequence[WorkerRun]) -> list[str]:
    """Problems that make the benchmark exit non-zero."""
    problems: list[str] = []
    for run in runs:
        where = f"{run.model}/{run.mode}"
        if run.report is None:
            problems.append(
                f"{where}: no result line (exit {run.returncode}, see {run.log_path})"
            )
            continue
        if run.returncode != 0:
            problems.append(f"{where}: worker exit code {run.returncode}")
        problems += [f"{where}: {err}" for err in run.report.get("errors", [])]
    return problems


def run_driver(args: argparse.Namespace, cfg: BenchConfig) -> int:
    """Spawn upstream and overlay workers per model, then print the table."""
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_pooled-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    jobs = worker_jobs(args.models, args.workloads, cfg)
    slots = CoreSlots(max(1, args.jobs))
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        runs = list(
            pool.map(lambda job: spawn_worker(job, args, cfg, log_dir, slots), jobs)
        )
    total = time.perf_counter() - start
    by_key = merge_runs(runs)
    rows: list[Row] = []
    for model in args.models:
        up = by_key[(model, "upstream")].report
        ov = by_key[(model, "overlay")].report
        rows += comparison_rows(model, up, ov)
        rows.append(
            Row(
                model,
                "worker",
                "process wall s",
                by_key[(model, "upstream")].wall_s,
                by_key[(model, "overlay")].wall_s,
            )
        )
    print()
    print(format_table(rows))
    notes = start_error_notes(runs)
    if notes:
        print("\nEngine start notes:")
        for note in notes:
            print(f"  {note}")
    problems = run_failures(runs)
    for run in runs:
        for where, text in ((run.report or {}).get("tracebacks") or {}).items():
            print(f"\n--- {run.model}/{run.mode} {where} ---\n{text}")
    if args.json:
        payload = {
            "config": asdict(cfg),
            "models": args.models,
            "workloads": args.workloads,
            "total_wall_s": total,
            "runs": [asdict(r) for r in by_key.values()],
            "worker_runs": [asdict(r) for r in runs],
            "table": [{**asdict(row), "ratio": row.ratio} for row in rows],
            "problems": problems,
        }
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str))
        _say(f"JSON written to {args.json}")
    _say(f"total {total:.0f} s, logs in {log_dir}")
    if problems:
        print("\nFAILURES:")
        for problem in problems:
            print(f"  {problem}")
        return 1
    return 0


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _csv(choices: Sequence[str] | None) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if choices is not None:
            bad = [item for item in items if item not in choices]
            if bad:
                raise argparse.ArgumentTypeError(
                    f"unknown {bad}; choose from {', '.join(choices)}"
                )
        return items

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Upstream vs vllm-hybrid overlay KV cache benchmark (CPU).",
    )
    parser.add_argument(
        "--models",
        type=_csv(None),
        default=list(DEFAULT_MODELS),
        help="tiny model kinds, comma separated (default: qwen3_5,qwen3_next)",
    )
    parser.add_argument(
        "--workloads",
        type=_csv(WORKLOADS),
        default=list(WORKLOADS),
        help="comma separated subset of " + ",".join(WORKLOADS),
    )
    parser.add_argument("--json", help="also write all results to this JSON file")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=REPO_ROOT / ".tiny-models",
        help="where tiny models are built/reused (default: .tiny-models)",
    )
    parser.add_argument("--log-dir", help="worker logs (default: a new temp dir)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="workers run at once; >1 overlaps runs and skews wall times",
    )
    parser.add_argument("--seed", type=int, default=BenchConfig.seed)
    parser.add_argument(
        "--one-long-block-size",
        type=int,
        default=BenchConfig.one_long_block_size,
        help="attention --block-size of the one_long engines, both modes "
        "(default: 32; 0 keeps the platform default)",
    )
    parser.add_argument(
        "--mamba-block-size",
        type=int,
        default=None,
        help="state checkpoint interval (align mode) of the prefix-caching "
        "engines other than one_long's, both modes (default: the attention block)",
    )
    parser.add_argument(
        "--budget-mib",
        type=float,
        default=BenchConfig.budget_bytes / MIB,
        help="KV budget of the many_short, multi_turn and same_tokens engines "
        "(default: 48)",
    )
    parser.add_argument(
        "--no-couple-prefix-caches",
        action="store_true",
        help="pooled mode without coordinated eviction across its pools "
        "(each pool evicts by its own LRU), to measure what coupling buys",
    )
    parser.add_argument(
        "--preempt-budget-mib",
        type=float,
        default=None,
        help="KV budget of the same_tokens forced-preemption run (default: 20 "
        "for qwen3_5, 12 for qwen3_next, 16 otherwise)",
    )
    parser.add_argument(
        "--same-tokens-threads",
        type=int,
        default=BenchConfig.same_tokens_threads,
        help="OpenMP threads of the same_tokens workers, both modes (default: 1, "
        "which makes CPU attention independent of batch composition; 0 runs "
        "same_tokens in the main workers with the platform's threads)",
    )
    parser.add_argument(
        "--same-tokens-cached-only",
        action="store_true",
        help="same_tokens runs only its prefix-caching passes (pc_on, "
        "pc_on_repeat), not pc_off, alone and the forced preemption",
    )
    parser.add_argument(
        "--mamba-ssm-cache-dtype",
        choices=("float32", "bfloat16", "auto"),
        default=BenchConfig.mamba_ssm_cache_dtype,
        help="SSM state dtype of every engine (default: float32, what vLLM "
        "forces on AVX512-BF16 CPUs, so figures match on any host; auto keeps "
        "this host's choice)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="use torch.compile (default: eager; compiling adds ~35 s per engine)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="shrunken workloads to check the harness (numbers not comparable)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config-json", help=argparse.SUPPRESS)
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if args.config_json:
        return BenchConfig(**json.loads(args.config_json))
    cores = os.cpu_count() or 1
    if not 0 <= args.same_tokens_threads <= cores:
        raise SystemExit(
            f"--same-tokens-threads {args.same_tokens_threads}: use 0 (the "
            f"platform's threads) or 1..{cores} (this machine's cores)"
        )
    cfg = BenchConfig(
        seed=args.seed,
        preempt_budget_bytes=(
            None
            if args.preempt_budget_mib is None
            else int(args.preempt_budget_mib * MIB)
        ),
        enforce_eager=not args.compile,
        one_long_block_size=args.one_long_block_size or None,
        mamba_block_size=args.mamba_block_size,
        budget_bytes=int(args.budget_mib * MIB),
        couple_prefix_caches=not args.no_couple_prefix_caches,
        same_tokens_threads=args.same_tokens_threads,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        same_tokens_uncached=not args.same_tokens_cached_only,
    )
    return quick_config(cfg) if args.quick else cfg


def quick_config(cfg: BenchConfig) -> BenchConfig:
    """A few-minute version of every workload, to check the harness itself."""
    return replace(
        cfg,
        many_short_requests=8,
        multi_turn_conversations=2,
        multi_turn_turns=2,
        one_long_search_cap=1024,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    if args.worker:
        if len(args.models) != 1:
            raise SystemExit("--worker runs exactly one model")
        report = run_worker(args.models[0], args.model_dir, args.workloads, cfg)
        return 1 if report.errors else 0
    return run_driver(args, cfg)


if __name__ == "__main__":
    sys.exit(main())
