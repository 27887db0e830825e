"""Overlay counterparts of ``vllm.v1`` modules, at the same relative paths."""
