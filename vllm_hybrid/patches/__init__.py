"""The patch registry: every upstream vLLM symbol the overlay replaces."""

from vllm_hybrid.patches.registry import (
    PATCHES,
    PatchEntry,
    applied,
    apply_all,
    revert_all,
)

__all__ = ["PATCHES", "PatchEntry", "apply_all", "applied", "revert_all"]
