"""What to plan: the request, its command-line values and its model files.

Parsers for the option values (sizes, counts, fractions), the
:class:`PlanRequest` built from the parsed arguments, the KV budget estimate
from GPU memory, and the directory holding the model's ``config.json``
(a preset written to a temporary directory, a config file, or a model
directory). Nothing here imports vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hybrid.ops.tq_dtypes import TQ_CACHE_DTYPES
from vllm_hybrid.tools.plan.presets import PRESETS

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


#: KV cache dtypes vLLM 0.32 accepts (``vllm.config.cache.CacheDType``),
#: so that a typo is answered before vLLM is imported.
KV_CACHE_DTYPES = (
    "auto",
    "float16",
    "bfloat16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_ds_mla",
    "nvfp4_ds_mla",
    *TQ_CACHE_DTYPES,
    "ultraquant_4bit",
    "int4_per_token_head",
    "int8_per_token_head",
    "fp8_per_token_head",
    "nvfp4",
    "nvfp4_4over6",
)

#: vLLM 0.32's ``--gpu-memory-utilization`` default (``CacheConfig``; a test
#: checks it against the installed vLLM, which is not imported here).
VLLM_GPU_MEMORY_UTILIZATION = 0.92

#: How errors name the planner's options that set the KV budget.
KV_BUDGET_OPTIONS = "--kv-cache-memory"
GPU_BUDGET_OPTIONS = "--gpu-memory or --gpu-memory-utilization"


class PlanError(ValueError):
    """Bad input or a plan that cannot exist; one line, exit code 2."""


#: Longest error line printed (vLLM's messages can run to paragraphs).
MAX_ERROR_CHARS = 400


def unwrapped(exc: BaseException) -> str:
    """The message of ``exc`` on one line, without pydantic's wrapping."""
    text = str(exc).strip()
    # pydantic wraps the interesting line: "Value error, <message> [type=...".
    match = re.search(r"Value error, (.*?)(?: \[type=|$)", text, re.S)
    if match:
        text = match.group(1)
    return " ".join(text.split())


# ---------------------------------------------------------------------------
# Option values
# ---------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Bytes from ``48MiB``, ``10GiB``, ``1.5G`` (decimal), ``123`` (bytes)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (examples: 48MiB, 10GiB, 1.5G, 1048576)"
        )
    value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 bytes")
    return value


def _parse_number(
    text: str, cast: type, valid: Callable[[Any], bool], expected: str
) -> Any:
    """``cast(text)`` if ``valid`` says yes, else argparse's error naming
    what was expected."""
    try:
        value = cast(text)
    except ValueError:
        value = None
    if value is None or not valid(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {expected}")
    return value


def parse_positive_int(text: str) -> int:
    return _parse_number(text, int, lambda v: v > 0, "a positive integer")


def parse_fraction(text: str) -> float:
    return _parse_number(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def parse_positive_float(text: str) -> float:
    return _parse_number(text, float, lambda v: v > 0, "a positive number")


def load_json_object(text: str) -> dict:
    """``text`` as a JSON object; :class:`ValueError` saying why it is not
    one (the caller names where the text came from)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def parse_json_object(text: str) -> dict:
    """A command-line JSON object (shapes, additional configs)."""
    try:
        return load_json_object(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_prompt_lens(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of positive token counts"
        )
    return sorted(set(values))


# ---------------------------------------------------------------------------
# The request
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: one model, one device, one budget."""

    model: str
    kv_cache_memory: int
    device: str = "cuda"
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    #: None: what ``vllm serve`` picks for the device (on CUDA, for the GPU
    #: size ``gpu_memory_gib``).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    #: None: vLLM's default for the model (on for these hybrids).
    prefix_caching: bool | None = None
    prompt_lens: tuple[int, ...] = (512, 2048, 8192)
    #: vLLM's ``--mamba-ssm-cache-dtype``; "auto" lets the model's hooks and
    #: the platform choose (the CPU platform forces float32 on AVX512-BF16
    #: hosts only), anything else is what vLLM then uses on every host.
    mamba_ssm_cache_dtype: str = "auto"
    #: The options that set the budget, named where an error advises to
    #: raise it.
    budget_options: str = KV_BUDGET_OPTIONS
    #: The GPU's memory (GiB), which picks vLLM's CUDA defaults; None: a GPU
    #: vLLM cannot read the size of (its small defaults).
    gpu_memory_gib: float | None = None


def kv_budget_from_gpu(
    gpu_memory_gib: float, utilization: float, weights_bytes: int, tp: int
) -> int:
    """Per-GPU KV bytes: ``gpu x utilization - weights / TP``.

    An estimate: activation peaks, CUDA graphs and the CUDA context, which
    vLLM measures at start-up, are not subtracted; ``--kv-cache-memory``
    (vLLM's ``--kv-cache-memory-bytes``) is exact.
    """
    budget = int(gpu_memory_gib * 2**30 * utilization) - weights_bytes // tp
    if budget <= 0:
        raise PlanError(
            f"--gpu-memory {gpu_memory_gib} GiB x --gpu-memory-utilization "
            f"{utilization} leaves no KV cache memory after --weights-memory "
            f"{weights_bytes / 2**30:.2f} GiB / TP {tp}"
        )
    return budget


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    """The request of parsed ``vllm-hybrid plan`` arguments."""
    if args.model is None:
        raise PlanError("MODEL is required (a directory, config.json or preset)")
    if args.kv_cache_memory is not None:
        budget, options = args.kv_cache_memory, KV_BUDGET_OPTIONS
    elif args.gpu_memory is not None:
        weights = args.weights_memory
        if weights is None and args.model in PRESETS:
            weights = PRESETS[args.model].weights_bytes
        if weights is None:
            raise PlanError("--gpu-memory needs --weights-memory SIZE")
        budget = kv_budget_from_gpu(
            args.gpu_memory,
            args.gpu_memory_utilization,
            weights,
            args.tensor_parallel_size,
        )
        options = GPU_BUDGET_OPTIONS
    else:
        raise PlanError("give --kv-cache-memory SIZE or --gpu-memory GiB")
    return PlanRequest(
        model=args.model,
        kv_cache_memory=budget,
        device=args.device,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        prefix_caching=args.prefix_caching,
        prompt_lens=tuple(args.prompt_lens),
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        budget_options=options,
        gpu_memory_gib=args.gpu_memory,
    )


# ---------------------------------------------------------------------------
# The model's config.json
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def model_dir(model: str) -> Iterator[tuple[Path, str | None]]:
    """A directory with ``config.json`` for ``model``, and the preset name."""
    preset = PRESETS.get(model)
    if preset is not None:
        with tempfile.TemporaryDirectory(prefix="vllm-hybrid-plan-") as tmp:
            yield preset.write_config(Path(tmp)), preset.name
        return
    path = Path(model)
    if path.is_file() and path.name.endswith(".json"):
        with tempfile.TemporaryDirectory(prefix="vllm-hybrid-plan-") as tmp:
            target = Path(tmp) / "config.json"
            target.write_bytes(path.read_bytes())
            yield Path(tmp), None
        return
    if path.is_dir() and (path / "config.json").is_file():
        yield path, None
        return
    raise PlanError(
        f"{model!r} is neither a built-in preset ({', '.join(PRESETS)}) nor a "
        "directory or file with a Hugging Face config.json"
    )


def read_config(directory: Path) -> dict[str, Any]:
    """``directory/config.json`` as a dict; one-line error if unreadable."""
    path = directory / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise PlanError(f"{path} holds no JSON object")
    return data


def checkpoint_architecture(directory: Path) -> str | None:
    """The first architecture ``config.json`` in ``directory`` names."""
    architectures = read_config(directory).get("architectures") or [None]
    return architectures[0]
