"""Serving benchmark through vLLM's OpenAI server: pooled mode against
upstream at the same KV byte budget, and TurboQuant against bf16.

The command line is ``python benchmarks/serve`` (this folder's
``__main__``). Each model x KV dtype x mode gets its own live
``vllm-hybrid serve`` on 127.0.0.1; every server gets the same seeded
streaming ``/v1/completions`` load at each fixed Poisson rate and at
saturation. In layers:

* :mod:`.config`: the settings (``BenchConfig``, ``LoadShape``);
* :mod:`.workload`: seeded token-id prompts with shared prefixes, arrivals;
* :mod:`.client`: the asyncio load generator and ``/metrics`` reads;
* :mod:`.metrics`: per-request records, percentiles, summaries, ratios;
* :mod:`.probe`: whether upstream's CPU attention can store a quantized
  cache dtype (asked before an upstream TurboQuant server is started);
* :mod:`.runner`: one server's life, and the whole invocation;
* :mod:`.report`, :mod:`.plot`: tables, JSON, the PNG;
* :mod:`.cli`: the options.
"""
