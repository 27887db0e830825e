"""One engine (pipeline parallel, or its PP=1 reference) filled with one request.

Usage: ``python pp_fill.py MODEL_DIR PP BUDGET_MIB MAX_MODEL_LEN OUT.json``
(layer split in ``VLLM_PP_LAYER_PARTITION``, eager, prefix caching off;
``MAX_MODEL_LEN`` -1 lets one request use the whole token capacity). The
engine core runs in this process (multiprocessing off), the stages in worker
processes. One request of ``max_model_len`` tokens runs (its last output
token is not computed, so at -1 it needs every token block) while the
scheduler records, after every step, the token and state blocks in use and
checks the arena's invariants. Writes what the test checks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# tests/ (engine_utils) and the repository root (the benchmarks package)
sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (2, 3)]

from engine_utils import record_preemptions, scheduler  # noqa: E402
from pooled_invariants import check_invariants  # noqa: E402

MiB = 2**20
OUTPUT_TOKENS = 8


def main(model: str, pp: str, budget_mib: str, max_model_len: str, out: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        enforce_eager=True,
        mamba_ssm_cache_dtype="float32",
        kv_cache_memory_bytes=int(budget_mib) * MiB,
        max_model_len=int(max_model_len),
        max_num_seqs=4,
        enable_prefix_caching=False,
        pipeline_parallel_size=int(pp),
        distributed_executor_backend="mp",
    )
    from vllm_hybrid.v1.core.pooled.coordinator import arena_of

    sched = scheduler(llm)
    arena = arena_of(sched.kv_cache_manager)
    capacity = llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens
    fitted = llm.llm_engine.vllm_config.model_config.max_model_len
    token_group = sched.kv_cache_config.kv_cache_groups[0]
    peaks = {"token": 0, "state": 0, "steps": 0}
    preemptions = record_preemptions(sched)
    original_schedule = sched.schedule

    def schedule(*args, **kwargs):
        output = original_schedule(*args, **kwargs)
        check_invariants(arena)
        peaks["token"] = max(peaks["token"], arena.token_pool.get_num_used_blocks())
        peaks["state"] = max(peaks["state"], arena.state_pool.get_num_used_blocks())
        peaks["steps"] += 1
        return output

    sched.schedule = schedule
    prompt = [5 + i % 50 for i in range(fitted - OUTPUT_TOKENS)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    layout = arena.layout
    Path(out).write_text(
        json.dumps(
            {
                "capacity": capacity,
                "max_model_len": fitted,
                "block_size": token_group.kv_cache_spec.block_size,
                "tokens": list(output.outputs[0].token_ids),
                "peak_token_blocks": peaks["token"],
                "peak_state_blocks": peaks["state"],
                "steps": peaks["steps"],
                "preemptions": len(preemptions),
                "token_capacity_at_floor": layout.token_capacity_at(
                    layout.max_state_floor
                ),
                "token_used_after": arena.token_pool.get_num_used_blocks(),
                "state_used_after": arena.state_pool.get_num_used_blocks(),
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:6])
