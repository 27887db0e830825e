"""The options that say what to plan, in vLLM's names, and the request
they make.

``plan`` and ``simulate`` take the model and every engine option they share
with ``vllm serve`` under ``vllm serve``'s spelling, so a served line's
flags can be pasted; the tools' earlier short spellings stay as aliases.
:func:`request_from_args` reads them back: the model first (an unknown model
is the first thing reported), then the budget, then the ``hybrid_kv``
options, then any pasted ``vllm serve`` flags (:mod:`.serve_flags`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from vllm_hybrid.tools.plan.errors import PlanError
from vllm_hybrid.tools.plan.models import resolve_model
from vllm_hybrid.tools.plan.request import (
    GPU_BUDGET_OPTIONS,
    KV_BUDGET_OPTIONS,
    KV_CACHE_DTYPES,
    MAMBA_CACHE_MODES,
    MAMBA_DTYPES,
    VLLM_GPU_MEMORY_UTILIZATION,
    PlanRequest,
    kv_budget_from_gpu,
    parse_fraction,
    parse_json_object,
    parse_positive_float,
    parse_positive_int,
    parse_size,
)
from vllm_hybrid.tools.plan.serve_flags import check_serve_flags, serve_command


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say what to plan: model, device, GPU and KV budget,
    engine limits, in ``vllm serve``'s names (earlier short names as
    aliases). Shared by ``plan`` and ``simulate``; :func:`request_from_args`
    reads them back."""
    parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="as for vllm serve: a local directory or config.json, a Hugging "
        "Face id of a preset's checkpoint or in the local hub cache (nothing is "
        "downloaded), or a built-in preset (see --list-presets)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        metavar="DTYPE",
        help="KV cache dtype as for vllm serve: auto, fp8, turboquant_k8v4, ... "
        "(vLLM 0.32's values; default auto)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=parse_positive_int,
        default=1,
        metavar="N",
        help="tensor parallel size; figures are per GPU (default 1)",
    )
    memory = parser.add_argument_group("KV cache memory")
    memory.add_argument(
        "--kv-cache-memory-bytes",
        "--kv-cache-memory",
        dest="kv_cache_memory",
        type=parse_size,
        metavar="SIZE",
        help="exact KV cache budget per GPU, as vllm serve reads it (30G is 30 "
        "GiB, 25.6g decimal; 48MiB, 10GiB also accepted)",
    )
    memory.add_argument(
        "--gpu-memory",
        type=parse_positive_float,
        metavar="GiB",
        help="memory of one GPU in GiB (not a vllm serve option: vLLM reads the "
        "card): picks vLLM's CUDA defaults (max_num_seqs, batch tokens, CUDA "
        "graph sizes) and, without --kv-cache-memory-bytes, the budget with "
        "--gpu-memory-utilization and --weights-memory",
    )
    memory.add_argument(
        "--gpu-memory-utilization",
        type=parse_fraction,
        default=None,
        metavar="F",
        help="fraction of --gpu-memory vLLM may use "
        f"(default {VLLM_GPU_MEMORY_UTILIZATION}, vLLM's)",
    )
    memory.add_argument(
        "--weights-memory",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="weights of the whole model, split evenly over TP ranks "
        "(default: the preset's; required with --gpu-memory otherwise)",
    )
    limits = parser.add_argument_group("engine options (as for vllm serve)")
    limits.add_argument(
        "--max-model-len",
        type=parse_positive_int,
        metavar="N",
        help="maximum sequence length (default: the model's)",
    )
    limits.add_argument(
        "--max-num-seqs",
        type=parse_positive_int,
        metavar="N",
        help="maximum concurrent sequences (default: vllm serve's for the "
        "device and --gpu-memory)",
    )
    limits.add_argument(
        "--max-num-batched-tokens",
        type=parse_positive_int,
        metavar="N",
        help="tokens per engine step (default: vllm serve's for the device "
        "and --gpu-memory)",
    )
    limits.add_argument(
        "--block-size",
        type=parse_positive_int,
        metavar="N",
        help="attention block size (upstream may still inflate it for hybrid "
        "models; pooled mode keeps it)",
    )
    limits.add_argument(
        "--enable-prefix-caching",
        "--prefix-caching",
        dest="prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefix caching on/off (default: vLLM's, on)",
    )
    limits.add_argument(
        "--mamba-cache-mode",
        choices=MAMBA_CACHE_MODES,
        default=None,
        help="state caching for prefix hits (default: the model's; align for "
        "these hybrids with prefix caching on)",
    )
    limits.add_argument(
        "--mamba-block-size",
        type=parse_positive_int,
        metavar="N",
        help="tokens between cached states in align mode (default: the "
        "attention block)",
    )
    limits.add_argument(
        "--mamba-ssm-cache-dtype",
        choices=MAMBA_DTYPES,
        default="auto",
        help="SSM state dtype (default auto: the model's choice; vLLM's CPU "
        "platform forces float32 on AVX512-BF16 hosts)",
    )
    limits.add_argument(
        "--additional-config",
        type=parse_json_object,
        default=None,
        metavar="JSON",
        help='e.g. \'{"hybrid_kv": {"pooled": false}}\' (the overlay\'s options)',
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="device to plan for (default cuda; not a vllm serve option)",
    )


def _weights(args: argparse.Namespace, preset_weights: int | None) -> int:
    weights = args.weights_memory if args.weights_memory else preset_weights
    if weights is None:
        raise PlanError(
            f"--gpu-memory needs --weights-memory SIZE for {args.model} (not a "
            "preset: its weights as vLLM loads them), or give "
            "--kv-cache-memory-bytes SIZE"
        )
    return weights


def _additional_config_error(additional: dict | None) -> str | None:
    from vllm_hybrid.config.hybrid_kv import options_error

    if not additional:
        return None
    problem = options_error(additional)
    return f"--additional-config: {problem}" if problem else None


def request_from_args(
    args: argparse.Namespace, extra: Sequence[str] = (), tool: str = "plan"
) -> PlanRequest:
    """The request of parsed arguments (:func:`add_model_arguments`) and of
    the flags argparse left (``extra``: a pasted ``vllm serve`` line's)."""
    if args.model is None:
        raise PlanError(
            "MODEL is required (a preset, a directory or config.json, or a "
            "Hugging Face id)"
        )
    model = resolve_model(args.model)
    utilization = args.gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION
    if args.kv_cache_memory is not None:
        budget, options = args.kv_cache_memory, KV_BUDGET_OPTIONS
    elif args.gpu_memory is not None:
        weights = _weights(args, model.preset.weights_bytes if model.preset else None)
        budget = kv_budget_from_gpu(
            args.gpu_memory, utilization, weights, args.tensor_parallel_size
        )
        options = GPU_BUDGET_OPTIONS
    else:
        raise PlanError("give --kv-cache-memory-bytes SIZE or --gpu-memory GiB")
    problem = _additional_config_error(args.additional_config)
    if problem is not None:
        raise PlanError(problem)
    ignored = check_serve_flags(extra, tool)
    preset_weights = model.preset.weights_bytes if model.preset else None
    return PlanRequest(
        model=model.source,
        kv_cache_memory=budget,
        device=args.device,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        prefix_caching=args.prefix_caching,
        prompt_lens=tuple(getattr(args, "prompt_lens", ()) or ()),
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        budget_options=options,
        gpu_memory_gib=args.gpu_memory,
        mamba_cache_mode=args.mamba_cache_mode,
        mamba_block_size=args.mamba_block_size,
        additional_config=args.additional_config,
        serve_command=serve_command(args, model.serve_name, extra),
        ignored_serve_flags=tuple(ignored),
        weights_bytes=args.weights_memory or preset_weights,
        gpu_memory_utilization=utilization,
    )
