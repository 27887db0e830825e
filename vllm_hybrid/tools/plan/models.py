"""MODEL as ``vllm serve`` takes it, resolved without a download.

``vllm serve`` takes a local directory or a Hugging Face id; the planner and
the simulator take the same, plus their built-in presets. A Hugging Face id
is answered from a preset that stands for that checkpoint, else from the
local hub cache (``config.json`` only; nothing is fetched). Anything else is
refused with the presets it comes closest to, before anything else is read,
so that a mistyped model is never reported as a missing option.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from vllm_hybrid.tools.plan.errors import PlanError
from vllm_hybrid.tools.plan.presets import PRESETS, Preset


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model's ``config.json`` comes from."""

    #: What ``model_dir`` reads: a preset's name, a directory or a file.
    source: str
    #: What ``vllm serve`` is given for the same model: the checkpoint's id
    #: for a preset, the id or path the user gave otherwise.
    serve_name: str
    preset: Preset | None = None


def _preset_by_checkpoint(name: str) -> Preset | None:
    """The preset standing for the Hugging Face id ``name`` (ids compare
    case-insensitively, as the Hub does)."""
    wanted = name.lower()
    return next((p for p in PRESETS.values() if p.checkpoint.lower() == wanted), None)


def _cached_config(repo_id: str) -> Path | None:
    """``config.json`` of ``repo_id`` in the local Hugging Face cache, if a
    download put it there (``HF_HUB_CACHE`` / ``HF_HOME`` are honoured)."""
    if repo_id.count("/") != 1:
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repository id
        return None
    return Path(found) if isinstance(found, str) else None


def close_matches(name: str) -> list[str]:
    """Preset names and checkpoints that look like ``name``."""
    lowered = name.lower()
    names = [*PRESETS, *(p.checkpoint for p in PRESETS.values())]
    starting = [n for n in PRESETS if n.startswith(lowered)]
    similar = difflib.get_close_matches(lowered, [n.lower() for n in names], n=3)
    by_lower = {n.lower(): n for n in names}
    return list(dict.fromkeys([*starting, *(by_lower[s] for s in similar)]))


def resolve_model(name: str) -> ResolvedModel:
    """``name`` as a preset, a local ``config.json`` or directory, or a
    Hugging Face id (a preset's checkpoint or in the local cache);
    :class:`PlanError` naming the closest presets otherwise."""
    preset = PRESETS.get(name) or _preset_by_checkpoint(name)
    if preset is not None:
        serve_name = name if name != preset.name else preset.checkpoint
        return ResolvedModel(preset.name, serve_name, preset)
    path = Path(name)
    if path.is_file() and path.name.endswith(".json"):
        return ResolvedModel(str(path), str(path.parent))
    if path.is_dir() and (path / "config.json").is_file():
        return ResolvedModel(str(path), name)
    if path.is_dir():
        raise PlanError(
            f"MODEL {name}: the directory holds no config.json; give a model "
            "directory, its config.json, a preset or a Hugging Face id"
        )
    cached = _cached_config(name)
    if cached is not None:
        return ResolvedModel(str(cached.parent), name)
    guesses = close_matches(name)
    hint = f"; did you mean {' or '.join(guesses)}?" if guesses else ""
    raise PlanError(
        f"MODEL {name!r} is not a built-in preset (--list-presets), a local "
        "directory or config.json, or a Hugging Face id of a preset's checkpoint "
        f"or in the local hub cache (nothing is downloaded){hint}"
    )
