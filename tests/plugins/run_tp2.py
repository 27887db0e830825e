"""Run a tiny model at tensor_parallel_size=2 over the multiprocessing executor.

Used by test_activation.py in a child process so that every vLLM process
(front end, engine core, two workers) writes its log to one captured stream.
"""

from __future__ import annotations

import json
import sys

from vllm import LLM, SamplingParams


def main(model_dir: str) -> None:
    llm = LLM(
        model=model_dir,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        kv_cache_memory_bytes=32 * 2**20,
        max_model_len=1024,
        max_num_seqs=8,
        enable_prefix_caching=False,
        seed=0,
        # compiling in both workers costs minutes on CPU and is not what
        # this run checks (activation in every process, TP=2 tokens)
        enforce_eager=True,
    )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(["The hybrid model says", "Once upon a time"], params)
    print("TP2_RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))


if __name__ == "__main__":
    main(sys.argv[1])
