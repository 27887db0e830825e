"""Built-in model shapes for ``vllm-hybrid plan``.

Each preset is the default configuration of a ``transformers`` config class
whose docstring names a published checkpoint, checked field by field against
that checkpoint's known shape (layers, heads, KV heads, head and state
dimensions). Defaults that do *not* describe the checkpoint their docstring
names are left out: ``NemotronHConfig()`` is a 4-layer toy pattern, not
Nemotron-3-Nano-30B; ``Qwen3Config()`` has 32 KV heads, not Qwen3-8B's 8;
``Qwen3_5TextConfig()`` (4096 hidden, 32 layers) is not Qwen3.5-27B;
``GraniteMoeHybridConfig()`` has no attention layer at all.

Nothing is downloaded: a preset becomes a ``config.json`` in a temporary
directory, which vLLM reads like any local model directory. The JSON of each
preset ships with the package (``preset_configs/``), so that ``plan`` answers
bad input without importing ``transformers`` (seconds on a small machine);
:func:`regenerate` rewrites the files from the installed ``transformers``, and
a test checks that they still agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: Where the presets' ``config.json`` files ship.
CONFIG_DIR = Path(__file__).with_name("preset_configs")


@dataclass(frozen=True)
class Preset:
    """One built-in model shape."""

    name: str
    #: The published checkpoint whose shape the config class defaults give.
    checkpoint: str
    #: ``transformers`` config class whose defaults are used unchanged.
    config_class: str
    #: vLLM architecture written to ``config.json``.
    architecture: str
    #: "hybrid" or "dense" (a control: both columns of the plan agree).
    kind: str
    description: str

    @property
    def shipped_path(self) -> Path:
        """The packaged ``config.json`` text of this preset."""
        return CONFIG_DIR / f"{self.name}.json"

    def config_text(self) -> str:
        """``config.json`` from the installed ``transformers``: the config
        class defaults, this preset's architecture, bf16."""
        import transformers

        config = getattr(transformers, self.config_class)()
        data = config.to_dict()
        data["architectures"] = [self.architecture]
        # Published checkpoints of all presets are bf16.
        data["dtype"] = "bfloat16"
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def write_config(self, directory: Path) -> Path:
        """Write the packaged ``config.json`` into ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(self.shipped_path.read_text())
        return directory


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="qwen3.5-35b-a3b",
            checkpoint="Qwen/Qwen3.5-35B-A3B",
            config_class="Qwen3_5MoeTextConfig",
            architecture="Qwen3_5MoeForCausalLM",
            kind="hybrid",
            description=(
                "40 layers (30 gated DeltaNet + 10 attention), 2 KV heads x 256, "
                "GDN 16 key / 32 value heads x 128"
            ),
        ),
        Preset(
            name="qwen3-next-80b-a3b",
            checkpoint="Qwen/Qwen3-Next-80B-A3B-Instruct",
            config_class="Qwen3NextConfig",
            architecture="Qwen3NextForCausalLM",
            kind="hybrid",
            description=(
                "48 layers (36 gated DeltaNet + 12 attention), 2 KV heads x 256, "
                "GDN 16 key / 32 value heads x 128"
            ),
        ),
        Preset(
            name="jamba-v0.1",
            checkpoint="ai21labs/Jamba-v0.1",
            config_class="JambaConfig",
            architecture="JambaForCausalLM",
            kind="hybrid",
            description=(
                "32 layers (28 Mamba + 4 attention), 8 KV heads x 128, "
                "Mamba d_state 16, expand 2"
            ),
        ),
        Preset(
            name="llama-2-7b",
            checkpoint="meta-llama/Llama-2-7b-hf",
            config_class="LlamaConfig",
            architecture="LlamaForCausalLM",
            kind="dense",
            description="dense control: 32 attention layers, 32 KV heads x 128",
        ),
    )
}


def describe_presets() -> str:
    """The ``--list-presets`` text: one line per preset."""
    width = max(len(name) for name in PRESETS)
    return "\n".join(
        f"{p.name:<{width}}  {p.kind:<6}  {p.checkpoint} "
        f"({p.config_class}() defaults): {p.description}"
        for p in PRESETS.values()
    )


def regenerate() -> None:
    """Write every preset's ``config.json`` from the installed ``transformers``."""
    CONFIG_DIR.mkdir(exist_ok=True)
    for preset in PRESETS.values():
        preset.shipped_path.write_text(preset.config_text())
        print(f"wrote {preset.shipped_path}")
