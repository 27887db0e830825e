"""Pooled mode's checkpoint policy: which states are kept, how kept entries
rank, where prefill chunks end (``eviction`` < ``positions`` < ``steps``).
Retention, the scheduler and the pools ask it; docs/architecture.md maps the
modules and docs/decisions.md gives each default its reason and record.
"""
