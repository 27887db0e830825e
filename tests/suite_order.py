"""Which test modules run first when the suite runs in several workers."""

from __future__ import annotations

from pathlib import Path

#: Test modules that take a minute or more (measured on an idle 2-core host),
#: longest first. They run first, so that in two workers (README, Tests) no
#: long module starts when the other worker is nearly done. An order hint
#: only: a module missing from the list runs after these, as collected.
LONGEST_FIRST = (
    "v1/pipeline/test_pipeline_parallel_cpu.py",
    "v1/spec_decode/test_spec_decode_hybrid_cpu.py",
    "plugins/test_activation.py",
    "test_kernel_tier.py",
    "entrypoints/test_load_edges.py",
    "tools/test_multi_turn_counts.py",
    "entrypoints/test_openai_server.py",
    "models/test_turboquant_engine.py",
    "entrypoints/test_multi_node.py",
    "entrypoints/test_soak.py",
    "gpu/test_modes_agree.py",
    "plugins/test_first_run.py",
    "tools/test_simulate_trust.py",
    "v1/core/pooled/test_skip_layers.py",
)


def longest_first(items) -> None:
    """Sort collected test items so that :data:`LONGEST_FIRST` modules come
    first, in that order (stable: the rest keep their collection order)."""
    root = Path(__file__).resolve().parent
    rank = {root / name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path, len(rank)))
