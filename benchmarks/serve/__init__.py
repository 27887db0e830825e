"""Serving benchmark over vLLM's OpenAI server: pooled mode against upstream
at the same KV byte budget, and TurboQuant against bf16.

``python benchmarks/serve`` drives one live ``vllm-hybrid serve`` per model x
KV dtype x mode with vLLM's own serving benchmark (docs/benchmarks.md,
"Serving benchmark").

* :mod:`.config`: the settings and the ``vllm bench serve`` arguments;
* :mod:`.run`: one server's life, every rate, the whole invocation;
* :mod:`.report`: tables, ratios and the JSON document;
* :mod:`.cli`: the options.
"""
