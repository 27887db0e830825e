"""Benchmarks of vllm-hybrid against upstream vLLM (see README.md)."""
