"""One engine of the n-gram test, in its own process (see the test module).

Usage: ``python ngram_engine.py MODEL_DIR {plain,spec} {pc,no-pc} OUT.json``.
Writes the greedy tokens and top-2 gaps of two passes over the prompts and
how often the host copy kernels ran.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine_utils import generate_greedy, with_engine  # noqa: E402

MiB = 2**20
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
# Repeating token patterns give the n-gram proposer matches of every length.
BASE = list(range(5, 60)) * 6
PROMPTS = [{"prompt_token_ids": BASE[: 100 + 37 * i]} for i in range(4)]
MAX_TOKENS = 24


def main(model: str, mode: str, caching: str, out: str) -> None:
    from vllm.v1.worker import mamba_utils

    kwargs = {
        "kv_cache_memory_bytes": 48 * MiB,
        "max_model_len": 1024,
        "max_num_seqs": 8,
        "enable_prefix_caching": caching == "pc",
    }
    if mode == "spec":
        kwargs["speculative_config"] = dict(NGRAM)
    calls = {"precopy_mamba_align_fused_kernel": 0, "postprocess_mamba_fused_kernel": 0}

    def work(llm):
        for name in calls:
            launcher = getattr(mamba_utils, name)
            host = launcher.host

            def counted(*args, _host=host, _name=name, **kw):
                calls[_name] += 1
                return _host(*args, **kw)

            launcher.host = counted
        return [generate_greedy(llm, PROMPTS, MAX_TOKENS) for _ in range(2)]

    passes = with_engine(model, True, kwargs, work)
    result = {
        "passes": [{"tokens": p.tokens, "gaps": p.gaps} for p in passes],
        "calls": calls,
    }
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:5])
