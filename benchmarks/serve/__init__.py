"""Serving benchmark over vLLM's OpenAI server: pooled mode against upstream
at the same KV byte budget, and TurboQuant against bf16.

``python benchmarks/serve`` starts one live ``vllm-hybrid serve`` per model x
KV dtype x mode and drives each with vLLM's own serving benchmark
(``vllm bench serve``'s library: seeded random prompts with a shared prefix,
Poisson arrivals, TTFT/TPOT percentiles). What it adds: the server's
``/metrics`` counters before and after each rate (prefix-cache hit rate,
preemptions), peak running requests and pool bytes read while the load runs,
and the pooled/upstream and dtype/auto ratios.

* :mod:`.config`: the settings and the ``vllm bench serve`` arguments;
* :mod:`.run`: one server's life, every rate, the whole invocation;
* :mod:`.report`: tables, ratios and the JSON document;
* :mod:`.cli`: the options.
"""
