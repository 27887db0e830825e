"""Greedy tokens of one engine, for the fork-versus-overlay comparison
(tests/tools/test_fork_wheel.py runs this file as a script).

It imports nothing of this repository: the same file runs in this
repository's environment (the overlay active) and in the fork's environment
(vLLM's tree with the fixes, no vllm-hybrid installed). One OpenMP thread,
pinned, so a request's bits do not depend on its batch-mates.

    python fork_greedy.py MODEL_DIR KV_CACHE_DTYPE PROMPTS_JSON OUT_JSON
"""

from __future__ import annotations

import json
import sys

#: Engine arguments both sides run with.
ENGINE = {
    "enforce_eager": True,
    "mamba_ssm_cache_dtype": "float32",
    "enable_prefix_caching": True,
    "kv_cache_memory_bytes": 48 * 2**20,
    "max_model_len": 4096,
    "max_num_seqs": 8,
    "seed": 0,
}
OUTPUT_TOKENS = 24


def main(model: str, kv_cache_dtype: str, prompts_json: str, out_json: str) -> None:
    from vllm import LLM, SamplingParams

    prompts = json.loads(prompts_json)
    llm = LLM(model=model, kv_cache_dtype=kv_cache_dtype, **ENGINE)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    batches = []
    # twice: cold, then with the prompts' prefixes cached
    for _ in range(2):
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        batches.append(
            {
                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "cached": [o.num_cached_tokens or 0 for o in outputs],
            }
        )
    config = llm.llm_engine.vllm_config.cache_config
    result = {
        "batches": batches,
        "kv_cache_size_tokens": config.kv_cache_size_tokens,
        "block_size": config.block_size,
    }
    with open(out_json, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
