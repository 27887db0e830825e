"""Settings of a benchmark run, shared by the driver and its workers."""

from __future__ import annotations

from dataclasses import dataclass, replace

from benchmarks.harness import MIB, REPO_ROOT

#: Modes a run compares when ``--modes`` is not given, and every mode it
#: accepts: the overlay's switch (``VLLM_HYBRID_KV``) of its workers off and
#: on. A mode may name a KV cache dtype of its own after a colon
#: (``overlay:turboquant_k8v4``). Other engines (upstream's tuning flags, the
#: overlay's single pool and hybrid_kv options) are ``vllm-hybrid simulate``'s
#: (``--engines``, ``--hybrid-kv``; docs/simulation.md).
MODES: tuple[str, ...] = ("upstream", "overlay")


def overlay_mode(mode: str) -> bool:
    """Whether a worker in ``mode`` runs with the overlay's switch on."""
    return mode.partition(":")[0] == "overlay"


#: Every workload ``--workloads`` accepts.
WORKLOADS: tuple[str, ...] = ("many_short", "one_long", "admission")
#: The workloads that run when ``--workloads`` is not given (admission is
#: asked for by name: it is one model's measurement, ``docs/benchmarks.md``).
DEFAULT_WORKLOADS: tuple[str, ...] = ("many_short", "one_long")
#: Kinds whose CPU kernels fail with prefix caching (see the tiny model tests).
NO_PREFIX_CACHING_KINDS: frozenset[str] = frozenset({"nemotron_h"})
#: The command line entry; workers are this script started with ``--worker``.
BENCH_SCRIPT = REPO_ROOT / "benchmarks" / "bench_pooled.py"


@dataclass(frozen=True)
class BenchConfig:
    """Every knob of a run; the driver hands it to workers as JSON.

    Defaults are the acceptance settings of pooled mode, so runs of different
    people compare. What each workload and option does: docs/benchmarks.md,
    "How bench_pooled measures". Engine settings apply to both modes.
    """

    seed: int = 0
    budget_bytes: int = 48 * MIB
    one_long_budget_bytes: int = 5 * MIB
    max_num_seqs: int = 64
    max_model_len: int = 4096
    #: a 5 MiB budget holds a handful of the CPU default's 128-token blocks;
    #: 32 is the smallest block the CPU attention kernel takes (None: default)
    one_long_block_size: int | None = 32
    #: None: the attention block (upstream overrides it with its inflated one)
    mamba_block_size: int | None = None
    #: every engine but one_long's and admission's; None: the platform's
    #: (128 CPU, 16 CUDA)
    block_size: int | None = None
    #: attention block of the admission engine (None: ``block_size``); at 32
    #: upstream pads the tiny qwen3_5's state page by 22% (a 160-token block)
    admission_block_size: int | None = 32
    kv_cache_dtype: str = "auto"
    kv_cache_dtype_skip_layers: tuple[str, ...] = ()
    many_short_requests: int = 64
    many_short_min_len: int = 64
    many_short_max_len: int = 512
    many_short_output: int = 32
    one_long_output: int = 16
    #: upper bound of the one_long search, besides ``max_model_len``
    one_long_search_cap: int = 16384
    #: wall-clock cap of one engine drive ("time_limit")
    drive_time_limit_s: float = 1800.0
    #: steps without any token progress after which a drive is "stalled"
    stall_steps: int = 64
    enforce_eager: bool = True
    #: vLLM's CPU platform forces float32 on AVX512-BF16 hosts only; pinned,
    #: the memory rows are the same on any host ("auto": the host's choice)
    mamba_ssm_cache_dtype: str = "float32"
    #: the first is the reference of every ratio
    modes: tuple[str, ...] = MODES


def quick_config(cfg: BenchConfig) -> BenchConfig:
    """A few-minute version of every workload, to check the harness itself."""
    return replace(
        cfg,
        many_short_requests=8,
        one_long_search_cap=1024,
    )
