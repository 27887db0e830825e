"""Numerical kernels owned by the overlay (torch references and native code)."""
