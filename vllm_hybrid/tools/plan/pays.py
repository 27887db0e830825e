"""Where pooled mode pays: the published hybrids on the GPUs users run them on.

``vllm-hybrid plan --where-it-pays`` plans every case below in both modes
(the same :func:`~vllm_hybrid.tools.plan.compute.build_plan` as a single
plan, with the GPU's budget and ``vllm serve``'s defaults) and prints one row
per case: upstream's block and state padding, the requests each mode holds
at 2,048 and 32,768 tokens, and how the full CUDA graphs start. The verdict
reads the ratio at 32,768 tokens (Mooncake's chat prompts average 12k): a
gain under 2% is a tie, under 10% small. Memory only: hit rates and
preemptions under load are the simulator's (docs/simulation.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from vllm_hybrid.tools.plan.compute import Plan, build_plan
from vllm_hybrid.tools.plan.presets import PRESETS
from vllm_hybrid.tools.plan.request import (
    VLLM_GPU_MEMORY_UTILIZATION,
    PlanError,
    PlanRequest,
    kv_budget_from_gpu,
)

#: The request lengths of the table's two concurrency columns.
SHORT, LONG = 2048, 32768
#: KV cache dtypes of every case.
DTYPES = ("auto", "turboquant_k8v4")


@dataclass(frozen=True)
class PaysCase:
    """One model on one GPU size (GiB) at one tensor-parallel size."""

    preset: str
    gpu_gib: float
    tp: int = 1

    @property
    def gpu(self) -> str:
        return f"{self.gpu_gib:g} GiB" + (f" x {self.tp}" if self.tp > 1 else "")


#: Each model on the GPUs its weights leave KV cache room on.
CASES = (
    PaysCase("qwen3.6-35b-a3b-fp8", 24, 2),
    PaysCase("qwen3.6-35b-a3b-fp8", 48),
    PaysCase("qwen3.6-35b-a3b-fp8", 80),
    PaysCase("qwen3.6-35b-a3b-fp8", 141),
    PaysCase("qwen3.5-9b", 24),
    PaysCase("qwen3.5-27b", 80),
    PaysCase("nemotron-3-nano-30b-a3b", 80),
    PaysCase("granite-4.0-h-small", 80),
)


def _request(case: PaysCase, kv_cache_dtype: str) -> PlanRequest:
    budget = kv_budget_from_gpu(
        case.gpu_gib,
        VLLM_GPU_MEMORY_UTILIZATION,
        PRESETS[case.preset].weights_bytes,
        case.tp,
    )
    return PlanRequest(
        model=case.preset,
        kv_cache_memory=budget,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=case.tp,
        max_model_len=LONG,
        prompt_lens=(SHORT, LONG),
        gpu_memory_gib=case.gpu_gib,
    )


def verdict(ratio: float) -> str:
    """Plain words for pooled / upstream requests held."""
    if ratio >= 1.10:
        return "pays"
    if ratio >= 1.02:
        return "small gain"
    if ratio > 0.98:
        return "tie"
    return "loses"


def _graphs(plan: Plan) -> str:
    up, pooled = plan.upstream.cuda_graphs, plan.pooled.cuda_graphs
    if up is None or pooled is None:
        return "-"
    upstream = "refuses" if up["refused"] else "starts"
    cap = pooled["cap"]
    return upstream + (f"; pooled caps at {cap}" if cap is not None else "")


def _row(case: PaysCase, kv_cache_dtype: str, plan: Plan) -> list[str]:
    up, pooled = plan.upstream, plan.pooled

    def held(n: int) -> tuple[float, float]:
        return (
            up.at_prompt_len[n]["max_concurrency"],
            pooled.at_prompt_len[n]["max_concurrency"],
        )

    short, long = held(SHORT), held(LONG)
    dtype = "tq k8v4" if kv_cache_dtype.startswith("turboquant") else "bf16"
    return [
        case.preset,
        case.gpu,
        dtype,
        f"{plan.kv_cache_memory / 2**30:.1f}",
        f"{up.attention_block_size:,}",
        f"{up.state_padding_pct:.2f}%",
        f"{short[0]:.0f} / {short[1]:.0f}",
        f"{long[0]:.1f} / {long[1]:.1f}",
        f"{long[1] / long[0]:.3f}",
        verdict(long[1] / long[0]),
        _graphs(plan),
    ]


HEADER = [
    "model",
    "GPU",
    "KV",
    "KV GiB",
    "upstream block",
    "state padding",
    f"requests @ {SHORT // 1024}k up / pooled",
    f"requests @ {LONG // 1024}k up / pooled",
    "ratio",
    "verdict",
    "full CUDA graphs (upstream; pooled)",
]


def rows(
    plan_one: Callable[[PlanRequest], Plan] = build_plan,
) -> Iterator[list[str]]:
    """The table's rows, one plan per case and dtype."""
    for case in CASES:
        for dtype in DTYPES:
            try:
                plan = plan_one(_request(case, dtype))
            except PlanError as exc:
                yield [case.preset, case.gpu, dtype, f"not planned: {exc}"]
                continue
            yield _row(case, dtype, plan)


def render_pays_table() -> str:
    """The markdown table ``--where-it-pays`` prints."""
    lines = [
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows()]
    return "\n".join(lines)
