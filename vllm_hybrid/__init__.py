"""vllm-hybrid: a vLLM 0.32 overlay for hybrid attention + Mamba/GDN models.

Importing this package has no side effects; the overlay is activated by the
``vllm.general_plugins`` entry point (see :mod:`vllm_hybrid.plugin`).
"""

__version__ = "0.1.0"

#: The only upstream vLLM version this overlay patches.
SUPPORTED_VLLM_VERSION = "0.32.0"
