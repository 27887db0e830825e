"""Attention of the overlay, mirroring upstream's ``vllm/v1/attention``."""
