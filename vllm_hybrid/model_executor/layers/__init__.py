"""Overlay modules at the matching vLLM path."""
