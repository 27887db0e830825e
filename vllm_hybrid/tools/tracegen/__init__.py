"""Request traces with follow-ups, written for ``vllm-hybrid simulate``.

``vllm-hybrid make-trace KIND OUT.jsonl`` writes one of the workloads
below in the form :mod:`vllm_hybrid.tools.simulate.followups` reads: each
request's prompt as hash segments (content no other request has, or a
shared prompt) and reply segments (what the engine generated for an earlier
request). Same kind, shape and seed give the same file.

Modules: :mod:`.common` (random draws, lengths, the JSONL writer),
:mod:`.reasoning_chat` (multi-turn chats with a reasoning model),
:mod:`.agent` (coding-agent tasks), :mod:`.cli`.
"""
