"""Build tiny random-weight models that vLLM's CPU backend can load.

Tests and benchmarks of the overlay need real model directories of each
architecture family it cares about (Gated DeltaNet hybrids, Mamba2 hybrids and
a plain transformer as control), but the machines they run on have no GPU and
may not reach the Hugging Face hub.  This module fabricates such directories
locally in a few seconds:

* a byte-level BPE tokenizer trained on a generated corpus, with ChatML
  special tokens and chat template so the OpenAI chat endpoint works;
* a ``transformers`` config shaped like the real family (layer pattern, head
  dimensions, KV heads) but with a tiny hidden size;
* weights drawn from the model's own initialiser under a fixed seed, stored
  as bfloat16 safetensors.

Every build is byte-for-byte reproducible for a given kind and seed, so
benchmark numbers can be compared across machines and runs.

Usage::

    python -m vllm_hybrid.tools.tiny_models OUT_DIR --kind qwen3_5 [--seed N] [--mtp]

``--mtp`` adds one multi-token-prediction layer (``mtp.*`` weights and the
``num_nextn_predict_layers`` config field, as the real Qwen3-Next/Qwen3.5
checkpoints ship it), for MTP speculative decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_hybrid.tools.tiny_tokenizer import (
    MAX_POSITION_EMBEDDINGS,
    TokenIds,
    padded_vocab_size,
    save_tokenizer,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: Bump whenever a change alters the produced files, so that cached builds
#: made by an older builder are not silently reused.
BUILDER_VERSION = 2  # 2: files 0644 (safetensors wrote 0600)

#: Model kinds this module can build. ``qwen3_5`` has Qwen3.5/3.6 attention
#: shapes on the Qwen3-Next architecture (see :func:`qwen3_5_config`);
#: ``qwen3_6`` has every per-layer KV shape of Qwen3.6-35B-A3B (see
#: :func:`qwen3_6_config`).
KINDS: tuple[str, ...] = ("qwen3_next", "qwen3_5", "qwen3_6", "nemotron_h", "dense")

#: Kinds that can carry an MTP layer (``--mtp``).
MTP_KINDS: tuple[str, ...] = ("qwen3_next", "qwen3_5", "qwen3_6")

#: Name of the file that marks a finished build (written last).
MARKER_NAME = "tiny_model_build.json"

#: Files every finished build must contain besides the marker.
REQUIRED_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True)
class BuildMarker:
    """Identity of a finished build; equal markers mean reusable output."""

    kind: str
    seed: int
    builder_version: int = BUILDER_VERSION
    mtp: bool = False


# Model configs
# ---------------------------------------------------------------------------


def interval_layer_types(num_layers: int, full_attention_interval: int) -> list[str]:
    """Qwen3-Next layer pattern: every Nth layer is full attention, rest GDN."""
    return [
        "full_attention"
        if (i + 1) % full_attention_interval == 0
        else "linear_attention"
        for i in range(num_layers)
    ]


def _common_token_fields(vocab_size: int, ids: TokenIds) -> dict:
    """Config fields shared by all kinds: vocabulary and special tokens."""
    return {
        "vocab_size": vocab_size,
        "bos_token_id": None,
        "eos_token_id": ids.im_end,
        "pad_token_id": ids.endoftext,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "tie_word_embeddings": False,
    }


def _qwen3_next_family(
    vocab_size: int,
    ids: TokenIds,
    head_dim: int,
    heads: int,
    gdn_key_heads: int = 2,
    gdn_value_heads: int = 4,
    hidden_size: int = 256,
    **extra: str,
) -> PretrainedConfig:
    """Tiny Qwen3-Next: 8 layers, 3 GDN : 1 attention, MoE MLP everywhere.

    GDN key/value head dims stay at 128 (vLLM's CPU GDN kernel requires it);
    everything that only scales cost (hidden, experts, heads) is shrunk.
    ``extra`` fields are written to ``config.json`` as they are.
    """
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **_common_token_fields(vocab_size, ids),
        **extra,
        hidden_size=hidden_size,
        intermediate_size=512,
        num_hidden_layers=8,
        layer_types=interval_layer_types(8, 4),
        num_attention_heads=heads,
        num_key_value_heads=2,
        head_dim=head_dim,
        linear_num_key_heads=gdn_key_heads,
        linear_num_value_heads=gdn_value_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
        },
    )


def qwen3_next_config(vocab_size: int, ids: TokenIds) -> PretrainedConfig:
    """Qwen3-Next-like: 128-dim attention heads, 4 query / 2 KV heads."""
    return _qwen3_next_family(vocab_size, ids, head_dim=128, heads=4)


def qwen3_5_config(vocab_size: int, ids: TokenIds) -> PretrainedConfig:
    """Qwen3.5/3.6-like attention shape (head_dim 256, 2 KV heads).

    Uses the Qwen3-Next architecture on purpose: vLLM's own Qwen3.5 classes
    import torchvision, which CPU installs often lack.  What the KV-cache
    layout sees (page sizes, layer mix, GDN state size) is the same.
    """
    return _qwen3_next_family(vocab_size, ids, head_dim=256, heads=8)


def qwen3_6_config(vocab_size: int, ids: TokenIds) -> PretrainedConfig:
    """Every per-layer KV shape of Qwen3.6-35B-A3B, at a tiny hidden size.

    2 KV heads x 256 per attention layer; GDN with 16 key and 32 value heads
    of 128 and a float32 SSM state (``mamba_ssm_dtype``, as the published
    config asks), so one GDN layer's state is 2,146,304 B like the real
    model's and the attention page to state page ratio is the real one. The
    CPU engine then pads and aligns as vLLM does at the real geometry, which
    the smaller GDN heads of ``qwen3_5`` do not reproduce. The Qwen3-Next
    class has no hook reading ``mamba_ssm_dtype``: engines pass
    ``mamba_ssm_cache_dtype="float32"`` to match it. Hidden size 128 keeps
    the GDN projections (to 2 x 2,048 key and 2 x 4,096 value features)
    small; no KV shape depends on it.
    """
    return _qwen3_next_family(
        vocab_size,
        ids,
        head_dim=256,
        heads=8,
        gdn_key_heads=16,
        gdn_value_heads=32,
        hidden_size=128,
        mamba_ssm_dtype="float32",
    )


#: Nemotron-H layer pattern: M = Mamba2, * = attention, - = MLP.
NEMOTRON_H_PATTERN = "M-M-M*-M-M-M*-"


def nemotron_h_config(vocab_size: int, ids: TokenIds) -> PretrainedConfig:
    """Tiny Nemotron-H: Mamba2 + attention + relu2 MLP layers, no MoE.

    Both vLLM and transformers size the Mamba2 inner dimension as heads x
    head dim (8 x 64 = 512); ``expand`` is kept consistent with it (2 x 256)
    so the config does not contradict itself.  One group keeps B/C small.
    """
    from transformers import NemotronHConfig

    return NemotronHConfig(
        **_common_token_fields(vocab_size, ids),
        hidden_size=256,
        hybrid_override_pattern=NEMOTRON_H_PATTERN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        mlp_hidden_act="relu2",
        mamba_num_heads=8,
        mamba_head_dim=64,
        expand=2,
        n_groups=1,
        ssm_state_size=64,
        conv_kernel=4,
        chunk_size=128,
    )


def dense_config(vocab_size: int, ids: TokenIds) -> PretrainedConfig:
    """Plain Qwen3 transformer, the no-state-layer control."""
    from transformers import Qwen3Config

    return Qwen3Config(
        **_common_token_fields(vocab_size, ids),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )


CONFIG_BUILDERS: dict[str, Callable[[int, TokenIds], PretrainedConfig]] = {
    "qwen3_next": qwen3_next_config,
    # Qwen3.5/3.6 shapes, Qwen3-Next architecture (Qwen3NextForCausalLM)
    "qwen3_5": qwen3_5_config,
    # Qwen3.6-35B-A3B's per-layer KV shapes, Qwen3-Next architecture
    "qwen3_6": qwen3_6_config,
    "nemotron_h": nemotron_h_config,
    "dense": dense_config,
}


# ---------------------------------------------------------------------------
# Weights and the build driver
# ---------------------------------------------------------------------------


def save_weights(
    config: PretrainedConfig, ids: TokenIds, out_dir: Path, seed: int
) -> None:
    """Initialise the model under ``seed`` and save bf16 safetensors.

    Initialisation runs in float32 and is cast afterwards, matching how real
    checkpoints are produced; the global torch RNG is forked so callers (for
    example a test session) see no change in their own random stream.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=[ids.im_end, ids.endoftext],
        pad_token_id=ids.endoftext,
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)


def add_mtp_layer(config: PretrainedConfig, out_dir: Path, seed: int) -> None:
    """Add one MTP layer to a saved Qwen3-Next-family model.

    vLLM's ``Qwen3NextMTP`` reads ``mtp.fc`` (hidden x 2 hidden), three
    RMSNorms (``mtp.norm``, ``mtp.pre_fc_norm_hidden``,
    ``mtp.pre_fc_norm_embedding``) and ``mtp.layers.0.*``, a full-attention
    decoder layer named like the model's own, and shares the embedding and
    the LM head. Matrices are drawn like the model's initialiser (normal,
    std ``initializer_range``) from their own seeded stream; norms copy the
    model's initial values.
    """
    import torch
    from safetensors.torch import load_file, save_file

    path = out_dir / "model.safetensors"
    weights = load_file(str(path))
    source = config.layer_types.index("full_attention")
    prefix = f"model.layers.{source}."
    gen = torch.Generator().manual_seed(seed + 1)
    std = config.initializer_range

    def drawn(shape: torch.Size) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)

    for name in sorted(n for n in weights if n.startswith(prefix)):
        tensor = weights[name]
        new = "mtp.layers.0." + name[len(prefix) :]
        weights[new] = tensor.clone() if "norm" in name else drawn(tensor.shape)
    hidden = config.hidden_size
    weights["mtp.fc.weight"] = drawn(torch.Size((hidden, 2 * hidden)))
    norm = weights["model.norm.weight"]
    for name in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        weights[f"mtp.{name}.weight"] = norm.clone()
    save_file(weights, str(path), metadata={"format": "pt"})
    config_path = out_dir / "config.json"
    data = json.loads(config_path.read_text())
    data["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_marker(out_dir: Path) -> BuildMarker | None:
    """The marker of a finished build in ``out_dir``, or None."""
    try:
        data = json.loads((out_dir / MARKER_NAME).read_text())
        return BuildMarker(**data)
    except (OSError, ValueError, TypeError):
        return None


def is_complete_build(out_dir: Path, kind: str, seed: int, mtp: bool = False) -> bool:
    """Whether ``out_dir`` already holds this exact build (so skip work)."""
    if read_marker(out_dir) != BuildMarker(kind, seed, mtp=mtp):
        return False
    return all((out_dir / name).is_file() for name in REQUIRED_FILES)


def _write_build(out_dir: Path, kind: str, seed: int, mtp: bool) -> None:
    """Write every file of a build into the (empty) directory ``out_dir``."""
    tokenizer_size, ids = save_tokenizer(out_dir)
    config = CONFIG_BUILDERS[kind](padded_vocab_size(tokenizer_size), ids)
    save_weights(config, ids, out_dir, seed)
    if mtp:
        add_mtp_layer(config, out_dir, seed)
    marker = asdict(BuildMarker(kind, seed, mtp=mtp))
    (out_dir / MARKER_NAME).write_text(
        json.dumps(marker, indent=2, sort_keys=True) + "\n"
    )


def clear_previous_build(out_dir: Path, marker_name: str = MARKER_NAME) -> None:
    """Remove an outdated build, refusing to delete anything else.

    A directory is only deleted when it carries the builder's marker
    ``marker_name`` (it was made by this tool, or :mod:`.tiny_eagle`) or is
    empty, so a wrong OUT_DIR cannot wipe user data.
    """
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory")
    if (out_dir / marker_name).exists() or not any(out_dir.iterdir()):
        shutil.rmtree(out_dir)
        return
    raise FileExistsError(
        f"{out_dir} is not empty and was not made by tiny_models; refusing to "
        "overwrite it"
    )


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    kind: str,
    seed: int = 0,
    force: bool = False,
    mtp: bool = False,
) -> Path:
    """Build (or reuse) a tiny model of ``kind`` in ``out_dir``.

    The files are written to a sibling temporary directory and renamed into
    place, so an interrupted build never looks complete.  Returns the
    resolved output path.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    if mtp and kind not in MTP_KINDS:
        raise ValueError(
            f"--mtp: kind {kind!r} has no MTP layer; "
            f"choose one of {', '.join(MTP_KINDS)}"
        )
    out_path = Path(out_dir).expanduser().resolve()
    if not force and is_complete_build(out_path, kind, seed, mtp):
        return out_path
    out_path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", dir=out_path.parent))
    try:
        _write_build(staging, kind, seed, mtp)
        _publish(staging, out_path, kind, seed, mtp)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_path


def _publish(staging: Path, out_path: Path, kind: str, seed: int, mtp: bool) -> None:
    """Move a finished staging directory to ``out_path``.

    If a concurrent builder (another test worker, say) published the same
    build first, its result is kept: both are byte-identical anyway.
    """
    # mkdtemp creates mode 0700 and safetensors writes 0600; give the result
    # the usual umask-based modes, so that other users (or a container with
    # another uid) can load the model.
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    for path in staging.iterdir():
        path.chmod(0o666 & ~umask)
    clear_previous_build(out_path)
    try:
        staging.rename(out_path)
    except OSError:
        if not is_complete_build(out_path, kind, seed, mtp):
            raise


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_hybrid.tools.tiny_models",
        description="Build a tiny random-weight bf16 model directory for vLLM CPU.",
    )
    parser.add_argument("out_dir", type=Path, help="directory to create")
    parser.add_argument("--kind", required=True, choices=KINDS)
    parser.add_argument("--seed", type=int, default=0, help="weight seed")
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if up to date"
    )
    parser.add_argument(
        "--mtp",
        action="store_true",
        help=f"add one MTP layer (kinds {', '.join(MTP_KINDS)})",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; prints the output directory."""
    args = _parse_args(argv)
    # The build itself never needs the hub; make sure nothing can reach it.
    # (Set only here: importing the module must not change the environment.)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    # Keep stdout/stderr to the one useful line: scripts capture the path.
    hf_logging.disable_progress_bar()
    path = build_tiny_model(
        args.out_dir, args.kind, seed=args.seed, force=args.force, mtp=args.mtp
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
