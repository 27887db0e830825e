"""``vllm-hybrid plan``: KV cache plan of a model, offline, without weights.

Answers "will it fit, and what does pooled mode buy" before any download: the
attention block size vLLM 0.32 would pick, state page padding, block pools,
token capacity and concurrency, side by side for upstream's single shared
pool and for this project's pooled mode.

Everything is computed by vLLM's own code on configs alone: ``EngineArgs``
builds the ``VllmConfig`` from ``config.json``; the platform's block size
alignment (``update_block_size_for_backend`` with the attention backend the
chosen device would use), the model class's state shape and dtype methods,
the backend's ``customize_spec`` (TurboQuant packing) and
``vllm.v1.core.kv_cache_utils`` produce the upstream plan; this project's
pooled planner produces the pooled plan from the same layer specs at natural
sizes. No model is instantiated, so no GPU, no weights, seconds.

Modules: :mod:`.request` (the request, option values, model files),
:mod:`.models` (MODEL as ``vllm serve`` takes it), :mod:`.options` (the
options in vLLM's names, read back into a request), :mod:`.serve_flags`
(a pasted ``vllm serve`` line's flags, the line a plan stands for),
:mod:`.errors` (one-line errors), :mod:`.outputs` (output paths checked
first), :mod:`.precheck` (what ``config.json`` settles before vLLM is
imported), :mod:`.config` (vLLM config, stand-in platform, layer specs),
:mod:`.geometry` (the config a plan request gives, shared with the
simulator; KV bytes per token and per request), :mod:`.compute` (the two
plans), :mod:`.limits` (the longest max_model_len each engine holds,
upstream's graph refusal), :mod:`.messages` (vLLM's errors in the tools'
option names), :mod:`.render` (table, PNG), :mod:`.cli` (:func:`main`),
:mod:`.presets`.
"""

from vllm_hybrid.tools.plan.cli import EXIT_BAD_INPUT, build_parser, main
from vllm_hybrid.tools.plan.compute import (
    ModePlan,
    Plan,
    build_plan,
    plan_pooled,
    plan_upstream,
)
from vllm_hybrid.tools.plan.config import (
    as_cuda_config,
    engine_config,
    kv_torch_dtype,
    overlay_off,
    upstream_align,
)
from vllm_hybrid.tools.plan.presets import PRESETS, Preset, describe_presets
from vllm_hybrid.tools.plan.render import plot_concurrency, render_table
from vllm_hybrid.tools.plan.request import (
    PlanError,
    PlanRequest,
    kv_budget_from_gpu,
    model_dir,
    parse_size,
)

__all__ = [
    "EXIT_BAD_INPUT",
    "PRESETS",
    "ModePlan",
    "Plan",
    "PlanError",
    "PlanRequest",
    "Preset",
    "as_cuda_config",
    "build_parser",
    "build_plan",
    "describe_presets",
    "engine_config",
    "kv_budget_from_gpu",
    "kv_torch_dtype",
    "main",
    "model_dir",
    "overlay_off",
    "parse_size",
    "plan_pooled",
    "plan_upstream",
    "plot_concurrency",
    "render_table",
    "upstream_align",
]
