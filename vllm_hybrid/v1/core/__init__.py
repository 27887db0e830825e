"""Overlay counterparts of ``vllm.v1.core`` modules."""
