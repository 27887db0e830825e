"""Attention backends the overlay adds through vLLM's backend registry."""
