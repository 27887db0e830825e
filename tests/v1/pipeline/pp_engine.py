"""One engine of the pipeline-parallel test, in its own process.

Usage: ``python pp_engine.py MODEL_DIR PP OUT.json [prefix]`` (eager, 48 MiB,
prefix caching off unless ``prefix`` is given, multiprocessing executor).
Writes the greedy tokens of :data:`PROMPTS`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MiB = 2**20
BASE = list(range(5, 60)) * 6
PROMPTS = [{"prompt_token_ids": BASE[: 100 + 37 * i]} for i in range(4)]


def main(model: str, pp: str, out: str, prefix: str = "") -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        enforce_eager=True,
        mamba_ssm_cache_dtype="float32",
        kv_cache_memory_bytes=48 * MiB,
        max_model_len=1024,
        max_num_seqs=8,
        enable_prefix_caching=prefix == "prefix",
        pipeline_parallel_size=int(pp),
        distributed_executor_backend="mp",
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    Path(out).write_text(json.dumps({"tokens": tokens}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
