"""What a simulation ran, said before its figures.

A table of figures means little without what produced it: the model as it
would be served, the GPU profile the modeled clock used and why, the KV
budget and where it came from, the workload and how much of it ran, the
engines. The same facts title the plot and go into the JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_hybrid.tools.plan.compute import Plan
from vllm_hybrid.tools.plan.request import GPU_BUDGET_OPTIONS
from vllm_hybrid.tools.simulate.clock import (
    GPU_PROFILES,
    GpuProfile,
    cuda_runner,
    profile_for_memory,
)
from vllm_hybrid.tools.simulate.preflight import WorkloadFacts
from vllm_hybrid.tools.simulate.spec import SimulationSpec

#: What each engine is, in a few words.
ENGINE_WORDS = {
    "upstream": "vLLM 0.32 as installed, its defaults",
    "upstream-best": "upstream with --prefix-match-unit at the kernel block and "
    "the best retention interval",
    "single-pool": "the overlay with pooled mode off",
    "pooled": "the overlay's default, pooled mode",
    "pooled-best": "pooled mode with the best prefill checkpoint interval",
}

GiB = 2**30


def gpu_profile(spec: SimulationSpec) -> tuple[GpuProfile, str]:
    """The clock's GPU profile and why it was chosen."""
    if spec.gpu_profile:
        return GPU_PROFILES[spec.gpu_profile], f"--gpu-profile {spec.gpu_profile}"
    memory = spec.request.gpu_memory_gib
    if memory is None:
        return profile_for_memory(None), "no --gpu-memory given; --gpu-profile picks"
    return (
        profile_for_memory(memory),
        f"the profile closest to --gpu-memory {memory:g}; --gpu-profile picks another",
    )


def _budget(spec: SimulationSpec) -> str:
    request = spec.request
    text = f"{request.kv_cache_memory / 2**20:,.2f} MiB per GPU"
    weights = request.weights_bytes
    if request.budget_options == GPU_BUDGET_OPTIONS and weights is not None:
        return (
            f"{text} (--gpu-memory {request.gpu_memory_gib:g} GiB x "
            f"{request.gpu_memory_utilization:g} - {weights / GiB:,.2f} GiB of "
            f"weights / TP {request.tensor_parallel_size}; an estimate: "
            "--kv-cache-memory-bytes gives the server's own figure)"
        )
    return f"{text} (--kv-cache-memory-bytes)"


def _workload(spec: SimulationSpec, facts: WorkloadFacts) -> str:
    if facts.total is None:
        return facts.description
    text = f"{facts.description}: {facts.selected:,} of its {facts.total:,} requests"
    if facts.span_s is not None:
        text += f", arriving over {facts.span_s:,.0f} s"
    if facts.cut_vendored:
        text += (
            f"; the whole hour: --requests all ({facts.total / facts.selected:.0f} "
            "times the requests, minutes an engine)"
        )
    return text


def header_facts(
    spec: SimulationSpec, plan: Plan, facts: WorkloadFacts, engines: Sequence[str]
) -> dict[str, Any]:
    """The header's facts, for the JSON."""
    profile, why = gpu_profile(spec)
    return {
        "model": plan.preset or plan.model,
        "architecture": plan.architecture,
        "serve_command": plan.serve_command,
        "gpu_profile": profile.name,
        "gpu_profile_why": why,
        "model_runner": cuda_runner().value,
        "kv_cache_memory": spec.request.kv_cache_memory,
        "max_model_len": plan.max_model_len,
        "max_num_seqs": plan.max_num_seqs,
        "max_num_batched_tokens": plan.max_num_batched_tokens,
        "workload": facts.description,
        "trace_requests": facts.total,
        "requests": facts.selected,
        "engines": list(engines),
    }


def render_header(
    spec: SimulationSpec, plan: Plan, facts: WorkloadFacts, engines: Sequence[str]
) -> str:
    """The lines above the table."""
    request = spec.request
    profile, why = gpu_profile(spec)
    lines = [
        f"Model: {plan.preset or plan.model} ({plan.architecture}, "
        f"{plan.attention_layers} attention + {plan.state_layers} state layers), "
        f"TP {request.tensor_parallel_size}, kv_cache_dtype {request.kv_cache_dtype}",
    ]
    if plan.serve_command:
        lines.append(f"As served: {plan.serve_command}")
    lines += [
        f"KV budget: {_budget(spec)}; max_model_len {plan.max_model_len:,}, "
        f"max_num_seqs {plan.max_num_seqs:,}, max_num_batched_tokens "
        f"{plan.max_num_batched_tokens:,}",
        f"Clock: {profile.name} data sheet ({why}); copies priced as "
        f"Model Runner {cuda_runner().value.upper()}",
        f"Workload: {_workload(spec, facts)}",
        "Engines: "
        + "; ".join(f"{e} ({ENGINE_WORDS.get(e, e)})" for e in engines)
        + ", each in its own process",
        "Counted figures are what the engines did; modeled ones come from the "
        "cost model (docs/simulation.md).",
    ]
    return "\n".join(lines)


def plot_title(spec: SimulationSpec, plan: Plan, facts: WorkloadFacts) -> str:
    """The plot's title: model, KV dtype, GPU, workload."""
    profile, _ = gpu_profile(spec)
    requests = f", {facts.selected:,} requests" if facts.selected else ""
    return (
        f"{plan.preset or plan.model}, {spec.request.kv_cache_dtype} KV, "
        f"TP {spec.request.tensor_parallel_size}, {profile.name} (modeled)"
        f"\n{facts.description}{requests}"
    )
