"""The modeled clock: how long a GPU would take for one engine step.

Counts (running requests, prefix hits, preemptions, copies) come from the
engine's own decisions; time does not exist in a simulation, so every
time-derived figure is **modeled** by this cost model, and labelled so.

One step takes ``overhead + max(compute, memory) + copies + communication``:

* compute: ``2 x active parameters`` FLOPs per token scheduled (prefill and
  decode alike; the LM head included), plus attention (``4 x query heads x
  head dim`` per token and context token, per attention layer) and the
  recurrent layers' state update (``4 x value heads x key dim x value dim``
  per token per gated DeltaNet layer, ``6 x heads x head dim x state`` per
  Mamba2 layer); at ``compute_efficiency`` of the GPU's dense peak for the
  weights' dtype (FP8 tensor cores for FP8 checkpoints);
* memory: weights read once per step (all dense weights; each expert with
  the probability that one of the step's tokens routes to it), the KV cache
  read by decode tokens and written by every token, every scheduled
  request's recurrent state read and written; at ``memory_efficiency`` of
  the GPU's bandwidth;
* copies: align mode's state copies, read and written before the forward
  (so not overlapped with it), priced per model runner (:class:`Runner`):
  the V1 runner builds a copy list on the host (a fixed time per copied
  request) and runs ``batch_memcpy`` at ``copy`` of the bandwidth; Model
  Runner V2 runs one fused pre-copy kernel at ``fused_copy`` of it, with no
  host list. An H200 measured all three (:class:`Efficiency`). A request
  that crossed its edge in place (one block in both columns) costs nothing
  on either runner: the overlay drops that copy of a block onto itself from
  V1's host list and from V2's pre-copy (``StepRecord.copies_moved``,
  :mod:`vllm_hybrid.v1.worker.mamba_copies`);
* communication (TP > 1): two all-reduces of the hidden state per layer and
  token, over the GPU's link;
* overhead: a fixed per-step cost (scheduling, launches).

All figures are per GPU. The GPUs' constants are public data sheet figures
(:data:`GPU_PROFILES`); the shares of them an engine reaches
(:class:`Efficiency`) are estimates, except the copies' share, measured on an
H200 (docs/cuda.md, "Real GPU"). There the model's state traffic also
matched the measured gated-DeltaNet decode step of Qwen3.6-35B-A3B at batch
256 (30 layers, float32 state: 8.58 ms measured, 8.59 ms modeled); at batch
64 the eager step took 3.44 ms against 2.15 ms modeled, kernel launches that
CUDA graphs and the per-step overhead stand for.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_hybrid.tools.simulate.steps import StepRecord


@dataclass(frozen=True)
class GpuProfile:
    """Data sheet figures of one GPU (dense tensor-core peaks)."""

    name: str
    memory_gib: float
    bf16_tflops: float
    fp8_tflops: float
    hbm_tb_s: float
    #: per-direction GPU-to-GPU bandwidth used by all-reduce
    link_gb_s: float


#: H100 SXM5 and H200 SXM (NVIDIA data sheets: 989 / 1,979 dense TFLOPS,
#: 3.35 / 4.8 TB/s, NVLink 450 GB/s per direction); L40S (362 / 733 dense
#: TFLOPS, 864 GB/s, PCIe 4.0 x16) and L4 (121 / 242.5, 300 GB/s, PCIe 4.0)
#: stand for the 48 GB and 24 GB cards.
GPU_PROFILES: dict[str, GpuProfile] = {
    "h100": GpuProfile("H100 SXM5 80GB", 80, 989.0, 1979.0, 3.35, 450.0),
    "h200": GpuProfile("H200 SXM 141GB", 141, 989.0, 1979.0, 4.8, 450.0),
    "l40s": GpuProfile("L40S 48GB", 48, 362.0, 733.0, 0.864, 32.0),
    "l4": GpuProfile("L4 24GB", 24, 121.0, 242.5, 0.3, 32.0),
}


def profile_for_memory(gpu_memory_gib: float | None) -> GpuProfile:
    """The profile whose memory is closest to ``gpu_memory_gib`` (H100 when
    unknown)."""
    if gpu_memory_gib is None:
        return GPU_PROFILES["h100"]
    return min(GPU_PROFILES.values(), key=lambda p: abs(p.memory_gib - gpu_memory_gib))


@dataclass(frozen=True)
class Efficiency:
    """Share of the data sheet figures a serving engine reaches."""

    compute: float = 0.5
    memory: float = 0.8
    #: Align mode's ``batch_memcpy`` of whole state pages, read plus write:
    #: 2,330 / 2,550 GB/s for 64 / 256 Qwen3.6-35B-A3B float32 states
    #: (61.41 MiB each) on an H200, 0.49 / 0.53 of its 4.8 TB/s (2026-11-27,
    #: benchmarks/results/gpu-20261127/copies.json); taken for every GPU.
    copy: float = 0.5
    #: Model Runner V2's fused align pre-copy, read plus write: 3,947 /
    #: 3,961 GB/s for 64 / 256 of the same states (0.0326 / 0.0325 ms per
    #: request), 0.82 of the H200's bandwidth (same run).
    fused_copy: float = 0.82
    #: V1 runner: host time to collect one copied request's copy list (one
    #: entry per state tensor of every state layer): 23.3 / 88.1 ms for 64 /
    #: 256 requests, 0.36 / 0.34 ms each (same run, ``host_collect_ms``).
    host_copy_list_s: float = 0.00035
    link: float = 0.7
    step_overhead_s: float = 0.002


def _get(config: Any, *names: str, default: int = 0) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value:
            return int(value)
    return default


@dataclass(frozen=True)
class ModelCosts:
    """Per-GPU sizes of a model, from its config (approximate: projections
    and experts; norms, biases and routers' small matrices left out)."""

    hidden: int
    attention_layers: int
    state_layers: int
    query_heads: int
    head_dim: int
    #: FLOPs per token of every layer's state update
    state_flops_per_token: float
    #: parameters every token uses / all parameters (whole model)
    active_params: float
    total_params: float
    #: parameters in routed experts (whole model), experts and top-k
    expert_params: float
    experts: int
    experts_per_token: int
    weights_bytes: int
    fp8: bool
    tp: int
    #: attention KV bytes per token on one GPU (all attention layers)
    kv_bytes_per_token: int
    #: one request's recurrent state on one GPU (all state layers)
    state_bytes: int
    vocab: int

    @classmethod
    def from_config(
        cls,
        vllm_config: Any,
        kv_bytes_per_token: int,
        state_bytes: int,
        weights_bytes: int | None,
        attention_layers: int,
        state_layers: int,
    ) -> ModelCosts:
        text = vllm_config.model_config.hf_text_config
        tp = vllm_config.parallel_config.tensor_parallel_size
        hidden = _get(text, "hidden_size")
        heads = _get(text, "num_attention_heads")
        head_dim = _get(text, "head_dim", default=hidden // max(1, heads))
        kv_heads = _get(text, "num_key_value_heads", default=heads)
        gated = str(getattr(text, "model_type", "")).startswith(
            ("qwen3_next", "qwen3_5")
        )
        q_width = heads * head_dim * (2 if gated else 1)
        attention = (
            hidden * (q_width + 2 * kv_heads * head_dim) + heads * head_dim * hidden
        )
        state, state_flops = _state_layer(text, hidden)
        experts = _get(text, "num_experts", "n_routed_experts", "num_local_experts")
        top_k = _get(text, "num_experts_per_tok", default=1)
        shared = (
            3
            * hidden
            * _get(
                text,
                "shared_expert_intermediate_size",
                "moe_shared_expert_intermediate_size",
                "shared_intermediate_size",
            )
        )
        layers = attention_layers + state_layers
        if experts:
            expert = (
                3 * hidden * _get(text, "moe_intermediate_size", "intermediate_size")
            )
            mlp_active = top_k * expert + shared + hidden * experts
            expert_total = layers * experts * expert
        else:
            mlp_active = 3 * hidden * _get(text, "intermediate_size")
            expert_total = 0
        vocab = _get(text, "vocab_size")
        body = attention_layers * attention + state_layers * state
        dense = body + layers * (mlp_active - (top_k * expert if experts else 0))
        active = body + layers * mlp_active + hidden * vocab
        total = dense + expert_total + 2 * hidden * vocab
        fp8 = "fp8" in str(getattr(vllm_config.model_config, "quantization", "") or "")
        if weights_bytes is None:
            weights_bytes = int(total * (1 if fp8 else 2))
        return cls(
            hidden=hidden,
            attention_layers=attention_layers,
            state_layers=state_layers,
            query_heads=heads,
            head_dim=head_dim,
            state_flops_per_token=state_layers * state_flops,
            active_params=active,
            total_params=total,
            expert_params=expert_total,
            experts=experts,
            experts_per_token=top_k,
            weights_bytes=weights_bytes,
            fp8=fp8,
            tp=tp,
            kv_bytes_per_token=kv_bytes_per_token,
            state_bytes=state_bytes,
            vocab=vocab,
        )


def _state_layer(text: Any, hidden: int) -> tuple[int, float]:
    """(parameters, state-update FLOPs per token) of one recurrent layer."""
    key_heads = _get(text, "linear_num_key_heads")
    if key_heads:
        dk = _get(text, "linear_key_head_dim")
        value_heads = _get(text, "linear_num_value_heads")
        dv = _get(text, "linear_value_head_dim")
        inner = value_heads * dv
        params = hidden * (2 * key_heads * dk + 2 * inner + 2 * value_heads)
        return params + inner * hidden, 4.0 * value_heads * dk * dv
    heads = _get(text, "mamba_num_heads", "mamba_n_heads")
    head_dim = _get(text, "mamba_head_dim", "mamba_d_head")
    d_state = _get(text, "ssm_state_size", "mamba_d_state", "state_size")
    groups = _get(text, "n_groups", "mamba_n_groups", default=1)
    inner = heads * head_dim or 2 * hidden
    params = hidden * (2 * inner + 2 * groups * d_state + heads) + inner * hidden
    return params, 6.0 * inner * d_state


class Runner(Enum):
    """The model runner an engine runs on a GPU; it decides what a state
    copy costs (module docstring). vLLM 0.32 runs Model Runner V2 on CUDA,
    pooled mode included; ``VLLM_USE_V2_MODEL_RUNNER=0`` selects V1."""

    V1 = "v1"
    V2 = "v2"


@dataclass(frozen=True)
class CostModel:
    """Step time of one model on one GPU profile (module docstring)."""

    model: ModelCosts
    gpu: GpuProfile
    efficiency: Efficiency = Efficiency()
    runner: Runner = Runner.V2

    def step_seconds(
        self, record: StepRecord, copy_bytes: float, copied_requests: int = 0
    ) -> float:
        """Modeled seconds of one step; its copies moved ``copy_bytes`` for
        ``copied_requests`` requests."""
        m, gpu, eff = self.model, self.gpu, self.efficiency
        tokens = record.prefill_tokens + record.decode_tokens
        if tokens <= 0:
            return 0.0
        context = record.prefill_context + record.decode_context
        flops = (
            2.0 * m.active_params * tokens
            + 4.0 * m.query_heads * m.head_dim * m.attention_layers * context
            + m.state_flops_per_token * tokens
        ) / m.tp
        tflops = gpu.fp8_tflops if m.fp8 else gpu.bf16_tflops
        compute = flops / (tflops * 1e12 * eff.compute)
        memory_bytes = (
            self.weights_read(tokens)
            + m.kv_bytes_per_token * (record.decode_context + tokens)
            + 2 * m.state_bytes * record.requests
        )
        memory = memory_bytes / (gpu.hbm_tb_s * 1e12 * eff.memory)
        copies = self.copy_seconds(copy_bytes, copied_requests)
        comm = 0.0
        if m.tp > 1:
            layers = m.attention_layers + m.state_layers
            volume = 2 * layers * tokens * m.hidden * 2 * (m.tp - 1) / m.tp
            comm = volume / (gpu.link_gb_s * 1e9 * eff.link)
        return eff.step_overhead_s + max(compute, memory) + copies + comm

    def copy_seconds(self, copy_bytes: float, copied_requests: int) -> float:
        """Modeled seconds of one step's state copies on this runner."""
        eff = self.efficiency
        if self.runner is Runner.V2:
            return 2 * copy_bytes / (self.gpu.hbm_tb_s * 1e12 * eff.fused_copy)
        kernel = 2 * copy_bytes / (self.gpu.hbm_tb_s * 1e12 * eff.copy)
        return kernel + eff.host_copy_list_s * copied_requests

    def weights_read(self, tokens: int) -> float:
        """Weight bytes one step reads on one GPU: dense weights whole, each
        expert with the chance that one of ``tokens`` routes to it."""
        m = self.model
        if m.total_params <= 0:
            return 0.0
        per_param = m.weights_bytes / m.total_params / m.tp
        if not m.experts:
            return m.total_params * per_param
        touched = 1.0 - (1.0 - m.experts_per_token / m.experts) ** tokens
        dense = m.total_params - m.expert_params
        return (dense + m.expert_params * touched) * per_param


def cuda_runner() -> Runner:
    """The model runner an engine would run on CUDA: Model Runner V2,
    vLLM 0.32's default, for every engine (pooled mode included); V1 where
    the simulation runs with ``VLLM_USE_V2_MODEL_RUNNER=0``, as a CUDA
    engine would. The one place the simulator picks a runner."""
    import vllm.envs as envs

    return Runner.V1 if envs.VLLM_USE_V2_MODEL_RUNNER is False else Runner.V2
