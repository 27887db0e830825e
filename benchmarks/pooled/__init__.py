"""A/B benchmark of the hybrid KV cache: upstream vLLM against the overlay.

The command line is ``benchmarks/bench_pooled.py``; this package is what it
runs, in layers:

* :mod:`.config`: the settings of a run (``BenchConfig``) and constants;
* :mod:`.pools`: bytes needed (layer specs) and bytes held (block pools);
* :mod:`.engine`: engines, driven by the simulator's ``Driver``;
* :mod:`.workloads`: what runs on the engines: the simulator's many_short
  and its counts, and the one_long search;
* :mod:`.admission`: the admission workload (many_short's requests at a
  block where upstream pads the state page), its byte limit and the probe
  that traces pooled admission step by step;
* :mod:`.worker`: one model in one mode, in its own process (the overlay
  reads its switch once per process);
* :mod:`.driver`: the worker processes, started as the simulator starts its
  own (``--jobs`` at once);
* :mod:`.report`: the table of overlay/upstream ratios;
* :mod:`.cli`: the options.

What each workload and metric means: ``docs/benchmarks.md``, "How
bench_pooled measures". The TurboQuant engine test reuses ``BenchConfig``.
"""

from .config import BenchConfig

__all__ = ["BenchConfig"]
