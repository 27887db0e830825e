"""CPU worker fix (a registry entry on upstream's ``CPUWorker``): the
pipeline-parallel buffer eager CPU workers never allocated."""

from __future__ import annotations


def compile_or_warm_up_model(self):
    """Upstream's warm-up, then the buffer a later pipeline stage receives
    activations in.

    On GPU the first dummy run allocates ``intermediate_tensors`` on every
    stage but the first. The CPU worker skips that run when it has nothing
    to compile (eager mode with an explicit KV budget), so a second stage
    stopped at its first step (``assert self.intermediate_tensors is not
    None``) and the engine core with a ``KeyError``.
    """
    from vllm.distributed.parallel_state import get_pp_group

    from vllm_hybrid.patches.registry import upstream_of

    times = upstream_of(__name__, "compile_or_warm_up_model")(self)
    runner = self.model_runner
    if not get_pp_group().is_first_rank and runner.intermediate_tensors is None:
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens,
            dtype=runner.model_config.dtype,
            device=runner.device,
        )
    return times
