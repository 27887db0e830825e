"""``vllm-hybrid simulate``: vLLM's engine core on a request trace at a real
model's geometry, with the model's forward pass replaced.

Only the forward pass needs a GPU: vLLM's scheduler, KV cache managers,
block hashing, retention and align-mode copy planning are Python, and so is
all of pooled mode. Here they run as they would in ``vllm serve``'s engine
process, at the geometry the planner derives for the GPU asked, behind a
stand-in executor that reports the model's layer specs and KV budget and
returns deterministic tokens. Counts are what the engines did; times come
from a documented cost model and are labelled "modeled".

Modules: :mod:`.spec` (what one simulation is), :mod:`.trace` (timed-trace
lines as token ids), :mod:`.followups` (traces whose prompts quote earlier
replies), :mod:`.sources` (workloads: arrivals and closed-loop
conversations), :mod:`.floor` (prompt tokens no cache could serve),
:mod:`.steps` (what a step computes and copies, from the scheduler output),
:mod:`.executor` (the stand-in executor), :mod:`.engine` (an
``EngineCore`` over it), :mod:`.clock` (the cost model), :mod:`.drive`
(the loop), :mod:`.probes` (counts read from the block pools), :mod:`.host`
(the scheduler's CPU per step), :mod:`.metrics` (latencies as ``vllm bench
serve`` names them, per-request rows), :mod:`.session` (one engine variant,
summarized), :mod:`.worker` / :mod:`.runner` (one process per variant,
sweeps), :mod:`.preflight` (every check before an engine starts),
:mod:`.header`, :mod:`.report` (table, plot), :mod:`.verdict` (one line
per engine), :mod:`.cli`.
"""
