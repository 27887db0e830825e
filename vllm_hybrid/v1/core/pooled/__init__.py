"""Pooled mode: per-group block pools at natural page sizes in one elastic
arena. docs/architecture.md is the map of its modules and their layers;
``tests/test_layering.py`` holds the import order.
"""
