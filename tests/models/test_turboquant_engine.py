"""TurboQuant KV cache end to end on CPU: tiny qwen3_5 and qwen3_next.

One in-process engine per (model, mode) with ``--kv-cache-dtype
turboquant_k8v4`` and the 48 MiB budget of ``benchmarks/bench_pooled.py``,
whose workload generators are reused at a smaller scale (:func:`_config`):
the saturation workload (32 requests, prompts of 64-256 tokens, 16 output
tokens, more than the budget holds at once) runs twice with a prefix-cache
reset in between, then the multi-turn prefix-caching workload (4
conversations, 3 turns, the benchmark's 1200-token system prompt). Pooled and
single-pool mode must both finish, repeat themselves exactly, and produce
the same multi-turn conversations.

The saturation workload also runs with prefix caching off in a separate
engine per mode; there the two modes must agree on every request. With
prefix caching on they must agree on every request that was not preempted
mid-decode in either mode: such a request has its generated tokens recomputed
as prefill (from a checkpoint at a block boundary, 128 tokens in pooled mode,
768 in single-pool mode), which rounds differently from the decode steps that
first produced them (docs/turboquant-backend.md).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
from engine_utils import record_preemptions, scheduler, with_engine

pytestmark = pytest.mark.slow

MiB = 2**20
DTYPE = "turboquant_k8v4"
BENCH_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_pooled.py"
MODES = ("pooled", "single")


def _bench():
    name = "bench_pooled_for_tq"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH_PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _config():
    """bench_pooled's settings with fewer and shorter requests: still more
    than the 48 MiB budget runs at once (the saturation tests check that
    some waited) and still a long shared system prompt for the multi-turn
    hits, at a quarter of the tokens."""
    return dataclasses.replace(
        _bench().BenchConfig(),
        many_short_requests=32,
        many_short_max_len=256,
        many_short_output=16,
        multi_turn_conversations=4,
        multi_turn_turns=3,
        multi_turn_output=16,
    )


def _generate(llm, prompts, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs], [
        o.num_cached_tokens or 0 for o in outs
    ]


def _saturation(llm, cfg, prompts):
    """The saturation prompts once: outputs, preemptions, and the indices of
    the prompts preempted after they had produced a token."""
    preempted = record_preemptions(scheduler(llm))
    outs, _ = _generate(llm, prompts, cfg.many_short_output)
    # LLM.generate numbers requests 0, 1, ... in prompt order; the engine
    # appends a random suffix ("7-1a2b3c4d").
    mid_decode = {int(rid.split("-")[0]) for rid, tokens in preempted if tokens > 0}
    return outs, len(preempted), mid_decode


def _multi_turn(llm, cfg, vocab):
    bp = _bench()
    system = bp.multi_turn_system(cfg, vocab)
    histories = [list(system) for _ in range(cfg.multi_turn_conversations)]
    turns, cached, prompt_tokens = [], 0, 0
    for turn in range(cfg.multi_turn_turns):
        prompts = [
            h + bp.multi_turn_user(cfg, vocab, conv, turn)
            for conv, h in enumerate(histories)
        ]
        outs, hits = _generate(llm, prompts, cfg.multi_turn_output)
        turns.append(outs)
        cached += sum(hits)
        prompt_tokens += sum(len(p) for p in prompts)
        histories = [p + o for p, o in zip(prompts, outs, strict=True)]
    return turns, cached / prompt_tokens


def _kwargs(mode: str, prefix_caching: bool) -> dict:
    cfg = _config()
    return dict(
        kv_cache_dtype=DTYPE,
        kv_cache_memory_bytes=cfg.budget_bytes,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        enable_prefix_caching=prefix_caching,
        enforce_eager=True,
        seed=cfg.seed,
        additional_config={"hybrid_kv": {"pooled": mode == "pooled"}},
    )


def _run_no_prefix_caching(model: str, mode: str) -> dict:
    def work(llm) -> dict:
        cfg = _config()
        prompts = _bench().many_short_prompts(cfg, _bench().llm_vocab(llm))
        outs, preemptions, _ = _saturation(llm, cfg, prompts)
        return {"saturation": outs, "preemptions": preemptions}

    return with_engine(model, True, _kwargs(mode, False), work)


def _run(model: str, mode: str) -> dict:
    cfg = _config()
    kwargs = _kwargs(mode, True)

    def work(llm) -> dict:
        core = llm.llm_engine.engine_core.engine_core
        vocab = _bench().llm_vocab(llm)
        prompts = _bench().many_short_prompts(cfg, vocab)
        first, preemptions, mid_decode = _saturation(llm, cfg, prompts)
        llm.reset_prefix_cache()
        second, _ = _generate(llm, prompts, cfg.many_short_output)
        llm.reset_prefix_cache()
        turns, hit_rate = _multi_turn(llm, cfg, vocab)
        context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
        backends = {
            layer.attn_backend.get_name()
            for layer in context.values()
            if hasattr(layer, "attn_backend")
        }
        return {
            "saturation": first,
            "saturation_preemptions": preemptions,
            "saturation_mid_decode": mid_decode,
            "saturation_repeat": second,
            "multi_turn": turns,
            "hit_rate": hit_rate,
            "config": core.scheduler.kv_cache_config,
            "backends": backends,
            "coordinator": type(core.scheduler.kv_cache_manager.coordinator).__name__,
        }

    # the overlay is on in both modes; "single" turns pooled mode off
    return with_engine(model, True, kwargs, work)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def runs(request, tiny_model_dir):
    model = str(tiny_model_dir(request.param))
    runs = {"kind": request.param} | {mode: _run(model, mode) for mode in MODES}
    for mode in MODES:
        runs[f"{mode}_no_pc"] = _run_no_prefix_caching(model, mode)
    return runs


def _slot_bytes(kind: str) -> int:
    # k8v4: head_dim fp8 key bytes + head_dim/2 value bytes + 3 fp16 fields.
    return {"qwen3_5": 388, "qwen3_next": 196}[kind]


def test_both_modes_run_the_cpu_turboquant_backend(runs):
    for mode in MODES:
        assert runs[mode]["backends"] == {"CPU_TURBOQUANT"}
    assert runs["pooled"]["coordinator"].startswith("Pooled")
    assert not runs["single"]["coordinator"].startswith("Pooled")


def test_saturation_completes_and_repeats_exactly(runs):
    cfg = _config()
    for mode in MODES:
        first = runs[mode]["saturation"]
        assert len(first) == cfg.many_short_requests
        assert all(len(ids) == cfg.many_short_output for ids in first)
        assert runs[mode]["saturation_repeat"] == first, mode


def test_saturation_identical_between_modes_without_prefix_caching(runs):
    pooled, single = runs["pooled_no_pc"], runs["single_no_pc"]
    assert len(pooled["saturation"]) == _config().many_short_requests
    assert pooled["saturation"] == single["saturation"]
    # It is a saturation run: some requests had to wait for memory.
    assert pooled["preemptions"] + single["preemptions"] > 0


def test_saturation_with_prefix_caching_differs_only_where_recomputed(runs):
    pooled, single = runs["pooled"], runs["single"]
    differ = {
        i
        for i, (a, b) in enumerate(
            zip(pooled["saturation"], single["saturation"], strict=True)
        )
        if a != b
    }
    recomputed = pooled["saturation_mid_decode"] | single["saturation_mid_decode"]
    assert differ <= recomputed, (sorted(differ), sorted(recomputed))
    assert pooled["saturation_preemptions"] + single["saturation_preemptions"] > 0


def test_multi_turn_identical_between_pooled_and_single_pool(runs):
    pooled, single = runs["pooled"], runs["single"]
    assert pooled["multi_turn"] == single["multi_turn"]
    # The shared 1200-token system prompt and the histories hit the cache.
    for mode in MODES:
        assert runs[mode]["hit_rate"] > 0.5, (mode, runs[mode]["hit_rate"])


def test_pages_are_packed_slots_with_true_padding(runs):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    slot = _slot_bytes(runs["kind"])
    for mode in MODES:
        config = runs[mode]["config"]
        specs = [g.kv_cache_spec for g in config.kv_cache_groups]
        attn = [s for s in specs if isinstance(s, FullAttentionSpec)]
        state = [s for s in specs if isinstance(s, MambaSpec)]
        assert attn and state
        for spec in attn:
            assert spec.page_size_bytes == spec.block_size * 2 * slot, mode
            assert spec.state_content_bytes == slot
        for spec in state:
            padding = spec.page_size_bytes - spec.real_page_size_bytes
            if mode == "pooled":
                assert padding == 0
            else:
                # The state page is padded exactly to the packed attention page.
                assert spec.page_size_bytes == attn[0].page_size_bytes
                assert 0 <= padding < attn[0].page_size_bytes
    assert runs["pooled"]["config"].kv_cache_groups[0].kv_cache_spec.block_size == 128
