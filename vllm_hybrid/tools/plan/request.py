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
from vllm_hybrid.tools.plan.errors import PlanError
from vllm_hybrid.tools.plan.presets import PRESETS

#: Size suffixes of two letters or more, in any case.
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "kib": 2**10,
    "mb": 10**6,
    "mib": 2**20,
    "gb": 10**9,
    "gib": 2**30,
    "tb": 10**12,
    "tib": 2**40,
}
#: One-letter suffixes as vLLM reads them (``human_readable_int``, e.g. its
#: ``--kv-cache-memory-bytes``): lower case decimal, upper case binary.
_LETTER_UNITS = {
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
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

#: How errors name the options that set the KV budget (vLLM's names).
KV_BUDGET_OPTIONS = "--kv-cache-memory-bytes"
GPU_BUDGET_OPTIONS = "--gpu-memory or --gpu-memory-utilization"

#: vLLM 0.32's ``--mamba-cache-mode`` values (``MambaCacheMode``; a test
#: checks them against the installed vLLM).
MAMBA_CACHE_MODES = ("align", "none")
#: vLLM 0.32's ``--mamba-ssm-cache-dtype`` values (``MambaDType``).
MAMBA_DTYPES = ("auto", "float32", "float16", "bfloat16")


# ---------------------------------------------------------------------------
# Option values
# ---------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Bytes from ``48MiB``, ``10GiB``, ``30G`` (GiB, as vLLM reads it),
    ``25.6g`` (decimal), ``123`` (bytes)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    suffix = match.group(2) if match else ""
    unit = _LETTER_UNITS.get(suffix) or _SIZE_UNITS.get(suffix.lower())
    if match is None or unit is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (examples: 48MiB, 10GiB, 30G, 1048576)"
        )
    value = int(float(match.group(1)) * unit)
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
    #: vLLM's ``--mamba-cache-mode`` and ``--mamba-block-size`` (None: the
    #: model's and vLLM's choice).
    mamba_cache_mode: str | None = None
    mamba_block_size: int | None = None
    #: vLLM's ``--additional-config`` (the overlay reads ``hybrid_kv``).
    additional_config: dict[str, Any] | None = None
    #: The ``vllm serve`` command line this request stands for, when it came
    #: from a command line (:mod:`.serve_flags`), and the pasted flags of it
    #: that change nothing planned.
    serve_command: str | None = None
    ignored_serve_flags: tuple[str, ...] = ()
    #: Weights of the whole model (the preset's or ``--weights-memory``) and
    #: the utilization the budget was computed with, where known.
    weights_bytes: int | None = None
    gpu_memory_utilization: float | None = None


def kv_budget_from_gpu(
    gpu_memory_gib: float, utilization: float, weights_bytes: int, tp: int
) -> int:
    """Per-GPU KV bytes: ``gpu x utilization - weights / TP``.

    An estimate: activation peaks, CUDA graphs and the CUDA context, which
    vLLM measures at start-up, are not subtracted;
    ``--kv-cache-memory-bytes`` is exact.
    """
    budget = int(gpu_memory_gib * 2**30 * utilization) - weights_bytes // tp
    if budget <= 0:
        raise PlanError(
            f"--gpu-memory {gpu_memory_gib} GiB x --gpu-memory-utilization "
            f"{utilization} leaves no KV cache memory after --weights-memory "
            f"{weights_bytes / 2**30:.2f} GiB / TP {tp}"
        )
    return budget


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
