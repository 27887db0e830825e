"""Timed-trace lines as ``vllm bench serve --dataset-name timed_trace`` reads
them: the tokens a hash id stands for and the unit of the timestamps are
options, and a trace written with 16-token hash ids, read with the matching
option, gives the same engine the same work as the same prompts written
with Mooncake's 512-token ids."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from vllm_hybrid.tools.simulate.trace import (
    MOONCAKE_TRACE,
    TraceFormat,
    read_trace,
)

#: 512-token ids as 16-token ones: each id stands for 32 new ones.
SPLIT = 512 // 16


def _write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_the_time_unit_is_an_option(tmp_path: Path) -> None:
    line = {"timestamp": 1500, "input_length": 10, "output_length": 2, "hash_ids": [7]}
    path = _write(tmp_path / "t.jsonl", [line])
    assert read_trace(path)[0].arrival_s == 1.5  # Mooncake's milliseconds
    seconds = read_trace(path, fmt=TraceFormat(seconds_per_unit=1.0))
    assert seconds[0].arrival_s == 1500.0


def _as_16_token_ids(line: dict) -> dict:
    """The same prompt in 16-token hash ids: id h's block becomes the 32 ids
    h * 32 + k, cut to the line's length."""
    ids = [h * SPLIT + k for h in line["hash_ids"] for k in range(SPLIT)]
    return dict(line, hash_ids=ids[: math.ceil(line["input_length"] / 16)])


def _first_lines(count: int, longest: int) -> list[dict]:
    """The first ``count`` Mooncake lines of at most ``longest`` tokens."""
    import gzip

    lines = []
    with gzip.open(MOONCAKE_TRACE, "rt") as source:
        for text in source:
            line = json.loads(text)
            if line["input_length"] <= longest:
                lines.append(line)
            if len(lines) == count:
                return lines
    raise AssertionError("the trace is shorter than asked")


def _run(path: Path, block: int, model: Path) -> dict:
    from vllm_hybrid.tools.plan.geometry import EngineOptions
    from vllm_hybrid.tools.plan.request import PlanRequest
    from vllm_hybrid.tools.simulate.drive import Driver
    from vllm_hybrid.tools.simulate.engine import open_engine
    from vllm_hybrid.tools.simulate.session import make_workload
    from vllm_hybrid.tools.simulate.spec import WorkloadSpec

    request = PlanRequest(
        model=str(model),
        kv_cache_memory=512 * 2**20,
        device="cpu",
        mamba_ssm_cache_dtype="float32",
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        max_model_len=16384,
    )
    spec = WorkloadSpec(trace=str(path), hash_block_tokens=block)
    with open_engine(request, model, EngineOptions()) as engine:
        workload = make_workload(spec, engine.vocab_size())
        result = Driver(
            engine.core, workload, engine.executor.take_records, lambda _: 0.01
        ).run()
    timings = result.timings.values()
    return {
        "outcome": result.outcome,
        "requests": len(result.timings),
        "prompt": sum(t.prompt_tokens for t in timings),
        "hits": sum(t.cached_tokens for t in timings),
        "prefill": result.steps.prefill_tokens,
        "preemptions": result.steps.preemptions,
    }


@pytest.mark.slow
def test_16_token_hash_ids_read_with_the_option_give_the_same_prefill(
    tiny_model_dir, tmp_path: Path
) -> None:
    """30 Mooncake requests (shared prefixes among them), written in 512- and
    in 16-token hash ids; the 16-token file read with
    --timed-trace-chunk-hash-size 16. Prompts, hits and prefill tokens are
    equal, and there are hits to compare; read with the wrong size, the file
    is refused."""
    lines = _first_lines(30, longest=12_000)
    wide = _write(tmp_path / "512.jsonl", lines)
    narrow = _write(tmp_path / "16.jsonl", [_as_16_token_ids(x) for x in lines])
    model = Path(tiny_model_dir("qwen3_5"))
    at_512 = _run(wide, 512, model)
    at_16 = _run(narrow, 16, model)
    assert at_512 == at_16
    assert at_512["outcome"] == "finished" and at_512["requests"] == 30
    assert at_512["hits"] > 0
    with pytest.raises(ValueError, match="blocks of 512 tokens need"):
        read_trace(narrow)
