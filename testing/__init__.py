"""Fixtures the tests, benchmarks and ``scripts/`` share; not part of the
installed package.

The wheel holds ``vllm_hybrid`` only (pyproject's package list), so nothing
here ships, and no module of ``vllm_hybrid`` may import from here
(``tests/test_wheel_contents.py`` checks both). Import it from the
repository root, where pytest, ``python benchmarks/...`` and the scripts
put it on ``sys.path``:

- :mod:`.loopback`: a served ``vllm-hybrid serve`` on loopback for the
  server tests, the serving benchmark, the soak, the demo and the GPU run;
- :mod:`.inproc`: an in-process ``vllm.LLM`` for the engine tests and the
  benchmarks;
- :mod:`.tiny_eagle`: a one-layer random-weight EAGLE draft for a tiny
  model (speculative decoding tests);
- :mod:`.shaped_models`: weightless model directories with a published
  checkpoint's layer shapes (the GPU run's serving measurement).

A runtime need of the product (``vllm-hybrid verify``, the tiny models it
builds, the simulator's workloads) belongs in ``vllm_hybrid.tools``.
"""
