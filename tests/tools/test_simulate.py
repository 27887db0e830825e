"""Fast checks of ``vllm-hybrid simulate``'s parts (no engine is started).

What a runner computes and copies is counted from scheduler outputs alone
(:class:`StepObserver`), so its rules are pinned here step by step with
vLLM's own output classes; the trace's token derivation, the workloads,
the cost model, the engine list and the report are pinned with numbers.
The engines themselves are compared with real CPU engines in
``test_simulate_trust.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_hybrid.tools.simulate import trace
from vllm_hybrid.tools.simulate.clock import (
    GPU_PROFILES,
    CostModel,
    ModelCosts,
    Runner,
    profile_for_memory,
)
from vllm_hybrid.tools.simulate.report import (
    SUMMARY_HEADER,
    render_summary,
    render_sweeps,
    render_table,
)
from vllm_hybrid.tools.simulate.runner import (
    best_key,
    engine_variants,
    run_json_worker,
    run_logged,
    worker_env,
)
from vllm_hybrid.tools.simulate.session import percentiles
from vllm_hybrid.tools.simulate.sources import (
    ChatServerShape,
    ChatServerWorkload,
    MultiTurnShape,
    MultiTurnWorkload,
    TraceWorkload,
)
from vllm_hybrid.tools.simulate.steps import StepObserver, StepRecord
from vllm_hybrid.tools.workloads import allowed_token_ids

VOCAB = allowed_token_ids(951, [0, 1, 2])

# ---------------------------------------------------------------------------
# Steps, from vLLM's SchedulerOutput
# ---------------------------------------------------------------------------


def _new(req_id: str, prompt: int, computed: int, state_blocks: list[int]):
    from vllm.v1.core.sched.output import NewRequestData

    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(range(prompt)),
        mm_features=[],
        sampling_params=None,
        pooling_params=None,
        block_ids=([0], state_blocks),
        num_computed_tokens=computed,
        lora_request=None,
    )


def _output(
    scheduled: dict[str, int],
    new=(),
    cached=(),
    resumed=(),
    preempted=(),
    finished=(),
):
    """A SchedulerOutput: ``cached`` is (req_id, computed, new state blocks)."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    data = CachedRequestData.make_empty()
    for req_id, computed, blocks in cached:
        data.req_ids.append(req_id)
        data.num_computed_tokens.append(computed)
        data.new_block_ids.append(None if blocks is None else ([], blocks))
        data.new_token_ids.append([])
        data.num_output_tokens.append(0)
    data.resumed_req_ids = set(resumed)
    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs = list(new)
    output.scheduled_cached_reqs = data
    output.num_scheduled_tokens = dict(scheduled)
    output.total_num_scheduled_tokens = sum(scheduled.values())
    output.preempted_req_ids = set(preempted)
    output.finished_req_ids = set(finished)
    return output


def test_prefill_decode_and_state_copies_follow_the_runner() -> None:
    """State block 4, prompt 10: the running state moves to a new column
    whenever a step ends in another block than the last one did."""
    observer = StepObserver(state_block=4, state_group=1)
    first = observer.observe(_output({"r": 8}, new=[_new("r", 10, 0, [10, 11])]))
    # no state before the first token: nothing to copy
    assert (first.prefill_tokens, first.decode_tokens, first.state_copies) == (8, 0, 0)
    assert (first.new_requests, first.new_prompt_tokens) == (1, 10)
    second = observer.observe(_output({"r": 2}, cached=[("r", 8, [12])]))
    # column 1 -> 2: one copy; the last two prompt tokens are prefill
    assert (second.prefill_tokens, second.decode_tokens, second.state_copies) == (
        2,
        0,
        1,
    )
    third = observer.observe(_output({"r": 1}, cached=[("r", 10, None)]))
    assert (third.prefill_tokens, third.decode_tokens, third.state_copies) == (0, 1, 0)
    assert third.decode_context == 11
    observer.observe(_output({"r": 1}, cached=[("r", 11, [13])]))
    crossing = observer.observe(_output({"r": 1}, cached=[("r", 12, None)]))
    assert (crossing.decode_tokens, crossing.state_copies) == (1, 1)
    assert observer.total.state_copies == 2
    assert observer.total.prefill_tokens == 10


def test_preemption_recomputes_as_prefill_and_resumes_from_the_hit() -> None:
    observer = StepObserver(state_block=4, state_group=1)
    observer.observe(_output({"r": 10}, new=[_new("r", 10, 0, [1, 2, 3])]))
    observer.observe(_output({"r": 1}, cached=[("r", 10, None)]))
    observer.observe(_output({"r": 1}, cached=[("r", 11, [4])]))
    preempt = observer.observe(_output({}, preempted=["r"]))
    assert preempt.preemptions == 1
    # resumed from a cached checkpoint at 8: tokens 8..11 were computed
    # before (recomputed: prefill), token 12 is new (the next decode)
    resumed = observer.observe(
        _output({"r": 5}, cached=[("r", 8, [5, 6, 7])], resumed=["r"])
    )
    assert (resumed.prefill_tokens, resumed.decode_tokens) == (4, 1)
    # the resumed request starts from the checkpoint's column 1, ends in 3
    assert resumed.state_copies == 1
    assert observer.total.preemptions == 1


def test_a_prefix_hit_copies_the_checkpoint_and_in_place_crossing_is_a_self_copy() -> (
    None
):
    observer = StepObserver(state_block=4, state_group=1)
    hit = observer.observe(_output({"h": 3}, new=[_new("h", 11, 8, [5, 5, 9])]))
    # hit at 8 (column 1), runs to 11 (column 2): the checkpoint is copied
    assert (hit.prefill_tokens, hit.state_copies, hit.state_self_copies) == (3, 1, 0)
    same = StepObserver(state_block=4, state_group=1)
    same.observe(_output({"p": 4}, new=[_new("p", 6, 0, [7])]))
    # the pool lets the request cross its edge in its own block
    crossing = same.observe(_output({"p": 2}, cached=[("p", 4, [7])]))
    assert (crossing.state_copies, crossing.state_self_copies) == (1, 1)


def test_chunks_and_decode_only_steps_that_read_out_of_place_move_no_state() -> None:
    """On an engine whose prefill chunks of 3 tokens or more, and the decodes
    of a step of decodes only, read their state out of place, the copies
    before them move nothing; a shorter chunk's and a decode crossing's next
    to a prefill still do."""
    observer = StepObserver(state_block=4, state_group=1, copy_free_tokens=3)
    hit = observer.observe(_output({"h": 3}, new=[_new("h", 13, 8, [5, 5, 9, 10])]))
    # hit at 8 (column 1), a 3-token chunk to 11 (column 2): read in place 5
    assert (hit.state_copies, hit.state_reads_elsewhere, hit.copies_moved) == (1, 1, 0)
    short = observer.observe(_output({"h": 2}, cached=[("h", 11, None)]))
    # 2 tokens from column 2 into column 3: copied
    assert (short.state_copies, short.state_reads_elsewhere, short.copies_moved) == (
        1,
        0,
        1,
    )
    for computed in (13, 14, 15):
        observer.observe(_output({"h": 1}, cached=[("h", computed, None)]))
    decode = observer.observe(_output({"h": 1}, cached=[("h", 16, [11])]))
    # a decode crossing into column 4 in a step of decodes only: read there
    assert (decode.decode_tokens, decode.state_reads_elsewhere) == (1, 1)
    assert decode.copies_moved == 0
    # the same crossing beside a prefill chunk is copied
    for computed in (17, 18, 19):
        observer.observe(_output({"h": 1}, cached=[("h", computed, None)]))
    both = observer.observe(
        _output(
            {"h": 1, "p": 8}, cached=[("h", 20, [12])], new=[_new("p", 8, 0, [20, 21])]
        )
    )
    assert (both.decode_tokens, both.prefill_tokens, both.copies_moved) == (1, 8, 1)
    assert observer.total.copies_moved == 2
    plain = StepObserver(state_block=4, state_group=1)
    again = plain.observe(_output({"h": 3}, new=[_new("h", 13, 8, [5, 5, 9, 10])]))
    assert (again.state_reads_elsewhere, again.copies_moved) == (0, 1)


def test_no_state_block_means_no_copies_and_finished_requests_are_dropped() -> None:
    observer = StepObserver(state_block=None, state_group=None)
    observer.observe(_output({"a": 16}, new=[_new("a", 16, 0, [1])]))
    step = observer.observe(_output({"a": 1}, cached=[("a", 16, None)]))
    assert (step.decode_tokens, step.state_copies) == (1, 0)
    observer.observe(_output({}, finished=["a"]))
    assert observer.requests == {}


def test_token_blocks_moved_are_counted_and_charged_as_block_copies() -> None:
    """A step whose output moves token blocks (pooled mode's boundary) counts
    each, and its copy bytes add one token block apiece."""
    from vllm_hybrid.tools.simulate.session import _copy_bytes

    observer = StepObserver(state_block=None, state_group=None)
    output = _output({"a": 16}, new=[_new("a", 16, 0, [1])])
    output.hybrid_token_moves = {10: 3, 11: 4}
    step = observer.observe(output)
    assert step.token_moves == 2
    assert (
        observer.observe(_output({"a": 1}, cached=[("a", 16, None)])).token_moves == 0
    )
    clock = SimpleNamespace(model=SimpleNamespace(state_bytes=1000))
    assert _copy_bytes(step, clock, (500, 64)) == 2 * 64
    step.cow_copies, step.state_copies = 1, 3
    assert _copy_bytes(step, clock, (500, 64)) == 3 * 1000 + 500 + 2 * 64


def test_prefill_tokens_are_counted_per_request_too() -> None:
    """Per-request prefill tokens (``--per-request``) add up to the run's,
    recomputation after a preemption included."""
    observer = StepObserver(state_block=None, state_group=None)
    observer.observe(_output({"r": 10}, new=[_new("r", 10, 0, [1])]))
    observer.observe(
        _output({"r": 1, "s": 4}, cached=[("r", 10, None)], new=[_new("s", 4, 0, [2])])
    )
    observer.observe(_output({}, preempted=["r"]))
    observer.observe(_output({"r": 11}, cached=[("r", 0, None)], resumed=["r"]))
    # r: its 10 prompt tokens, then 11 recomputed (the decode's too); s: 4
    assert observer.prefill_by_request == {"r": 10 + 11, "s": 4}
    assert sum(observer.prefill_by_request.values()) == observer.total.prefill_tokens


def test_records_add_up() -> None:
    total = StepRecord()
    total.add(StepRecord(steps=1, prefill_tokens=3, state_copies=1))
    total.add(StepRecord(steps=1, decode_tokens=2, preemptions=1))
    assert (total.steps, total.prefill_tokens, total.decode_tokens) == (2, 3, 2)
    assert (total.state_copies, total.preemptions) == (1, 1)


# ---------------------------------------------------------------------------
# The trace
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def records() -> list[trace.TraceRecord]:
    return trace.read_trace()


def test_vendored_trace_is_the_mooncake_conversation_trace(records) -> None:
    assert len(records) == 12_031
    assert sum(r.input_length for r in records) == 144_793_823
    first = records[0]
    assert (first.arrival_s, first.input_length, first.output_length) == (0, 6758, 500)
    assert first.hash_ids[:3] == (0, 1, 2)
    assert records[-1].arrival_s == pytest.approx(3536.999)
    readme = (trace.MOONCAKE_TRACE.parent / "README.md").read_text()
    assert "Apache License 2.0" in readme and "kvcache-ai/Mooncake" in readme


def test_window_and_request_cap(records) -> None:
    window = trace.read_trace(start_s=60, end_s=120)
    assert window and all(0 <= r.arrival_s < 60 for r in window)
    assert len(window) == sum(60 <= r.arrival_s < 120 for r in records)
    assert len(trace.read_trace(max_requests=7)) == 7
    stats = trace.trace_stats(window)
    assert stats["requests"] == len(window)


def test_equal_hash_ids_give_equal_token_blocks(records) -> None:
    vocab = 248_320
    a, b = (trace.prompt_tokens(r, vocab) for r in records[:2])
    assert (len(a), len(b)) == (6758, 7322)
    # both start with hash id 0: the same 512 tokens, then different blocks
    assert a[:512] == b[:512]
    assert a[512:1024] != b[512:1024]
    assert a == trace.prompt_tokens(records[0], vocab)
    assert min(a) >= trace.FIRST_ORDINARY_ID and max(a) < vocab
    assert trace.block_tokens(5, 1000, 8) == trace.block_tokens(5, 1000, 8)
    assert trace.block_tokens(5, 1000, 8) != trace.block_tokens(6, 1000, 8)


def test_trace_workload_arrives_at_the_timestamps(records) -> None:
    workload = TraceWorkload(records[:20], 1000)
    due = workload.due(0.0)
    assert [r.request_id for r in due] == [
        f"trace-{r.index}" for r in records[:20] if r.arrival_s <= 0
    ]
    upcoming = workload.next_arrival()
    assert upcoming is not None and upcoming > 0
    assert workload.due(upcoming)[0].arrival_s == upcoming


def test_short_hash_list_is_refused() -> None:
    record = trace.TraceRecord(0, 0.0, 600, 1, (1,))
    with pytest.raises(ValueError, match="cover 512 of its 600"):
        trace.prompt_tokens(record, 1000)


# ---------------------------------------------------------------------------
# The project's workloads, closed loop
# ---------------------------------------------------------------------------


def test_chat_server_sends_the_next_turn_with_the_reply() -> None:
    shape = ChatServerShape(conversations=3, turns=2, system_len=20, concurrency=2)
    workload = ChatServerWorkload(shape, VOCAB)
    sent = workload.due(0.0)
    assert 1 <= len(sent) <= 2
    assert workload.due(0.0) == []  # nothing frees a slot yet
    first = sent[0]
    conv = int(first.request_id.removeprefix("chat").split("-")[0])
    workload.finished(first.request_id, [7, 8, 9], 1.0)
    assert workload.histories[conv][-3:] == [7, 8, 9]
    later = [r for r in workload.due(1.0) if r.request_id == f"chat{conv}-turn1"]
    for request in later:
        assert request.prompt[: len(first.prompt) + 3] == first.prompt + [7, 8, 9]
        assert request.arrival_s == 1.0


def test_multi_turn_waits_for_the_whole_turn() -> None:
    workload = MultiTurnWorkload(MultiTurnShape(conversations=2, turns=2), VOCAB)
    turn0 = workload.due(0.0)
    assert [r.request_id for r in turn0] == ["conv0-turn0", "conv1-turn0"]
    workload.finished("conv0-turn0", [5], 1.0)
    assert workload.due(1.0) == []
    workload.finished("conv1-turn0", [6], 2.0)
    turn1 = workload.due(2.0)
    assert turn1[1].prompt[: len(turn0[1].prompt) + 1] == turn0[1].prompt + [6]


# ---------------------------------------------------------------------------
# The modeled clock
# ---------------------------------------------------------------------------


def _qwen36_costs(tp: int = 1) -> ModelCosts:
    """ModelCosts of the packaged Qwen3.6-35B-A3B-FP8 config."""
    from vllm_hybrid.tools.plan.presets import PRESETS

    data = json.loads(PRESETS["qwen3.6-35b-a3b-fp8"].shipped_path.read_text())
    config = SimpleNamespace(
        model_config=SimpleNamespace(
            hf_text_config=SimpleNamespace(**data), quantization="fp8"
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
    )
    return ModelCosts.from_config(
        config,
        kv_bytes_per_token=10 * 776,
        state_bytes=30 * 2_146_304 // tp,
        weights_bytes=35 * 2**30,
        attention_layers=10,
        state_layers=30,
    )


def test_qwen36_is_a3b_of_35b() -> None:
    costs = _qwen36_costs()
    assert 2.7e9 < costs.active_params < 3.3e9
    assert 33e9 < costs.total_params < 37e9
    assert (costs.experts, costs.experts_per_token, costs.fp8) == (256, 8, True)


def test_decode_is_memory_bound_and_prefill_compute_bound() -> None:
    clock = CostModel(_qwen36_costs(), GPU_PROFILES["h100"])
    weights = 35 * 2**30
    # one token routes to 8 of 256 experts: dense weights and 1/32 of the
    # experts are read; 64 tokens touch 87% of the experts
    assert 0.08 < clock.weights_read(1) / weights < 0.15
    assert 0.85 < clock.weights_read(64) / weights < 0.9
    one = clock.step_seconds(StepRecord(requests=1, decode_tokens=1), 0.0)
    assert 0.003 < one < 0.005
    batch = clock.step_seconds(StepRecord(requests=64, decode_tokens=64), 0.0)
    # weights (about 31 GiB) plus every request's 64 MB state read and
    # written, at 80% of 3.35 TB/s, plus the 2 ms step overhead
    states = 64 * 2 * 30 * 2_146_304
    expected = 0.002 + (clock.weights_read(64) + states) / 2.68e12
    assert batch == pytest.approx(expected, rel=0.01)
    assert 0.015 < batch < 0.019
    prefill = clock.step_seconds(StepRecord(requests=1, prefill_tokens=8192), 0.0)
    flops = 2 * clock.model.active_params * 8192
    assert prefill > flops / (1979e12 * 0.5)
    h200 = CostModel(_qwen36_costs(), GPU_PROFILES["h200"])
    assert h200.step_seconds(StepRecord(requests=64, decode_tokens=64), 0.0) < batch
    # state copies run before the forward, at the share of the bandwidth an
    # H200 measured for them: Model Runner V2's fused pre-copy at 0.82 of
    # 3.35 TB/s here, no host time
    copies = clock.step_seconds(StepRecord(requests=64, decode_tokens=64), 64e9, 1000)
    assert copies - batch == pytest.approx(2 * 64e9 / (0.82 * 3.35e12), rel=1e-6)
    # the V1 runner: batch_memcpy at half of it, plus 0.35 ms of host time to
    # collect each copied request's copy list
    v1 = CostModel(_qwen36_costs(), GPU_PROFILES["h100"], runner=Runner.V1)
    copies = v1.step_seconds(StepRecord(requests=64, decode_tokens=64), 64e9, 1000)
    assert copies - batch == pytest.approx(2 * 64e9 / 1.675e12 + 0.35, rel=1e-6)
    # on an H200 the V2 pre-copy of one 61.4 MiB state takes what it measured
    one_state = h200.copy_seconds(64_389_120, 1)
    assert one_state == pytest.approx(32.6e-6, rel=0.02)


def test_an_edge_crossed_in_place_costs_nothing_on_either_runner(monkeypatch) -> None:
    """Where pooled mode crossed an edge in place, the overlay skips the copy
    of the block onto itself on the V1 runner (host list) and on Model
    Runner V2 (fused pre-copy): of 5 copies with 3 in place, 2 are paid on
    both, at each runner's price. Every engine is priced as V2 unless the
    simulation runs with upstream's switch to V1."""
    from vllm_hybrid.tools.simulate.clock import cuda_runner

    record = StepRecord(requests=64, decode_tokens=64)
    record.state_copies, record.state_self_copies = 5, 3
    v2 = CostModel(_qwen36_costs(), GPU_PROFILES["h200"])
    v1 = CostModel(_qwen36_costs(), GPU_PROFILES["h200"], runner=Runner.V1)
    assert record.copies_moved == 2
    state = v2.model.state_bytes
    # V2: two states through the fused pre-copy, 0.0326 ms each on an H200
    assert v2.copy_seconds(2 * state, 2) == pytest.approx(2 * 32.6e-6, rel=0.02)
    # V1: batch_memcpy of the same two plus 0.35 ms of host list each
    v1_copies = 2 * 2 * state / (4.8e12 * 0.5) + 2 * 0.00035
    assert v1.copy_seconds(2 * state, 2) == pytest.approx(v1_copies, rel=1e-6)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert cuda_runner() is Runner.V2
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert cuda_runner() is Runner.V1


def test_tensor_parallel_splits_work_and_adds_all_reduce() -> None:
    record = StepRecord(requests=1, prefill_tokens=4096)
    one = CostModel(_qwen36_costs(1), GPU_PROFILES["l4"]).step_seconds(record, 0)
    two = CostModel(_qwen36_costs(2), GPU_PROFILES["l4"]).step_seconds(record, 0)
    assert two < one
    assert profile_for_memory(48).name.startswith("L40S")
    assert profile_for_memory(141).name.startswith("H200")
    assert profile_for_memory(None).name.startswith("H100")


# ---------------------------------------------------------------------------
# Engines, sweeps and the report
# ---------------------------------------------------------------------------


def test_engine_variants_set_what_a_user_would() -> None:
    variants = engine_variants(
        ["upstream", "upstream-best", "single-pool", "pooled", "pooled-best"],
        retention_sweep=["0", "dense", "4x"],
        checkpoint_sweep=["0", "1024"],
        hybrid_kv={"retain_turn_ends": True},
        state_block_sweep=["512"],
    )
    assert [v.overlay for v in variants["upstream"]] == [False]
    best = variants["upstream-best"]
    assert [v.cache["prefix_cache_retention_interval"] for v in best] == [0, None, "4x"]
    assert {v.cache["prefix_match_unit"] for v in best} == {"kernel"}
    assert variants["single-pool"][0].hybrid_kv == {
        "retain_turn_ends": True,
        "pooled": False,
    }
    pooled_best = variants["pooled-best"]
    assert [v.hybrid_kv.get("prefill_checkpoint_interval") for v in pooled_best] == [
        0,
        1024,
        None,
    ]
    # the state block sweep sets vLLM's own option, the default interval
    assert [v.cache for v in pooled_best] == [{}, {}, {"mamba_block_size": 512}]
    assert pooled_best[2].name == "pooled-best[mamba_block_size=512]"
    assert all(v.hybrid_kv["retain_turn_ends"] for v in variants["pooled-best"])
    with pytest.raises(ValueError, match="unknown engine"):
        engine_variants(["fastest"])


def _summary(prefill: int, hits: int, outcome: str = "finished") -> dict:
    return {
        "counted": {
            "prefill_tokens": prefill,
            "hit_tokens": hits,
            "hit_rate": hits / (hits + prefill),
            "outcome": outcome,
            "peak_running": 10,
            "preemptions": 0,
            "copy_bytes": 2e9,
        },
        "modeled": {"ttft_s": {"p50": 0.5, "p99": 2.0}, "tpot_s": {"p50": 0.01}},
    }


def test_best_is_fewest_prefill_tokens_and_failed_runs_lose() -> None:
    runs = {
        "a": _summary(100, 50),
        "b": _summary(80, 70),
        "c": _summary(10, 140, "stalled"),
    }
    assert min(runs, key=lambda n: best_key(runs[n])) == "b"
    assert best_key({"error": "x"}) > best_key(runs["a"])


def test_worker_env_sets_the_switch_and_keeps_the_callers_log_level(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    on, off = worker_env(True), worker_env(False, log_level=None)
    assert (on["VLLM_HYBRID_KV"], off["VLLM_HYBRID_KV"]) == ("1", "0")
    assert on["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert on["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert "VLLM_LOGGING_LEVEL" not in off
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert worker_env(True)["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_run_logged_keeps_the_output_and_returns_the_status(tmp_path: Path) -> None:
    code = (
        "import os, sys; print(os.environ['VLLM_HYBRID_KV']); "
        "print('oops', file=sys.stderr); sys.exit(3)"
    )
    log = tmp_path / "w.log"
    assert run_logged([sys.executable, "-c", code], worker_env(True), log) == 3
    assert log.read_text().split() == ["1", "oops"]
    run_logged([sys.executable, "-c", code], worker_env(False), log, stderr=False)
    assert log.read_text().split() == ["0"]


def test_a_json_worker_gets_its_payload_and_returns_its_report(tmp_path: Path) -> None:
    """A worker reads ``IN.json`` and writes ``OUT.json`` (the switch set
    for it); one that writes nothing is an error entry with its log's tail."""
    code = (
        "import json, os, sys; job = json.load(open(sys.argv[1])); "
        "json.dump({'n': job['n'] + 1, 'kv': os.environ['VLLM_HYBRID_KV']}, "
        "open(sys.argv[2], 'w'))"
    )
    argv = [sys.executable, "-c", code]
    assert run_json_worker(argv, {"n": 41}, True, tmp_path, "w") == {
        "n": 42,
        "kv": "1",
    }
    crash = [sys.executable, "-c", "print('before'); raise SystemExit(5)"]
    failed = run_json_worker(crash, {}, False, tmp_path, "c")
    assert failed["error"] == "worker exited with 5"
    assert failed["traceback"].split() == ["before"]


def test_table_gives_ratios_to_upstream_best() -> None:
    engines = {
        "upstream-best": {"best": "ub", "runs": {"ub": _summary(100, 100)}},
        "pooled": {"best": "pooled", "runs": {"pooled": _summary(50, 150)}},
    }
    table = render_table(engines)
    assert "| prefill tokens computed (counted) ↓ | 100 | 50 (0.50x) |" in table
    assert "| prefix hit rate, tokens (counted) ↑ | 0.500 | 0.750 (1.50x) |" in table
    assert "| peak running (counted) | 10 | 10 (1.00x) |" in table
    assert "TTFT p50, s (modeled) ↓" in table
    assert table.endswith(
        "↓ lower is better, ↑ higher is better; ratios to upstream-best."
    )
    engines["upstream-best"]["runs"]["ub2"] = _summary(120, 80)
    assert "ub (best): prefill tokens 100" in render_sweeps(engines)


def test_token_blocks_moved_show_beside_the_copies_once_a_run_counts_them() -> None:
    engines = {
        "upstream-best": {"best": "ub", "runs": {"ub": _summary(100, 100)}},
        "pooled": {"best": "pooled", "runs": {"pooled": _summary(50, 150)}},
    }
    assert "token blocks moved" not in render_table(engines)
    engines["pooled"]["runs"]["pooled"]["counted"]["token_moves"] = 19056
    assert "| token blocks moved (counted) | - | 19,056 |" in render_table(engines)


def test_summary_rows_give_prefill_ratio_to_upstream_best() -> None:
    engines = {
        "upstream-best": {"best": "ub", "runs": {"ub": _summary(100, 100)}},
        "pooled": {"best": "pooled", "runs": {"pooled": _summary(80, 120)}},
        "single-pool": {"best": "single-pool", "runs": {"single-pool": {"error": "x"}}},
    }
    rows = render_summary(engines, "80 GB tq").splitlines()
    assert rows == [
        "| 80 GB tq | upstream-best (ub) | 0.500 | 100 | 10 | 0 | 2 "
        "| 0.50 / 2.00 | - |",
        "| 80 GB tq | pooled | 0.600 | 80 (0.800x) | 10 | 0 | 2 | 0.50 / 2.00 | - |",
        "| 80 GB tq | single-pool | failed | | | | | | |",
    ]
    # the scheduler's CPU per step, with its ratio where both runs recorded it
    for name, mean in (("upstream-best", 0.5), ("pooled", 0.6)):
        run = engines[name]["runs"][engines[name]["best"]]
        run["host"] = {"scheduler_cpu_ms_per_step": {"mean": mean, "p99": 1.0}}
    rows = render_summary(engines, "80 GB tq").splitlines()
    assert rows[0].endswith("| 0.50 / 2.00 | 0.50 |")
    assert rows[1].endswith("| 0.50 / 2.00 | 0.60 (1.20x) |")
    assert SUMMARY_HEADER.count("|") == 2 * (rows[0].count("|"))


def test_percentiles_are_numpys_as_vllm_bench_serve_takes_them() -> None:
    """Linear interpolation between ranks (numpy's default, what ``vllm
    bench serve`` reports), and the count they rest on."""
    values = list(range(1, 101))
    assert percentiles(values) == pytest.approx(
        {"mean": 50.5, "n": 100, "p50": 50.5, "p90": 90.1, "p99": 99.01}
    )
    assert percentiles([3.0]) == {
        "mean": 3.0,
        "n": 1,
        "p50": 3.0,
        "p90": 3.0,
        "p99": 3.0,
    }
    assert percentiles([]) == {}


def test_cli_refuses_bad_input_with_exit_2(capsys: pytest.CaptureFixture) -> None:
    from vllm_hybrid.tools.simulate.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["qwen3.6-35b-a3b-fp8", "--gpu-memory", "80", "--window", "x:y"])
    assert exc.value.code == 2
    assert "START:END" in capsys.readouterr().err
    code = main(["qwen3.6-35b-a3b-fp8", "--gpu-memory", "80", "--engines", "fast"])
    assert code == 2
    assert "unknown engine 'fast'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["qwen3.6-35b-a3b-fp8", "--checkpoint-sweep", "0,many"])
    assert exc.value.code == 2
    assert "many: not a whole number of tokens" in capsys.readouterr().err


def test_package_data_ships_the_trace() -> None:
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert (
        '"vllm_hybrid.tools.simulate" = ["data/*.jsonl.gz", "data/README.md"]' in text
    )
