"""Prefill checkpoints (``pooled/policy/positions.py``): where they lie,
the interval rule, the scheduler's cut and what retention keeps.

The fast tests use the qwen3_6 tiny model's per-layer shapes (2 KV heads x
256 bf16; GDN state of 2,146,304 B, fp32 SSM) and upstream's
``KVCacheManager``; the engine test runs that model's chat prefix.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from pooled_invariants import cached_ids, check_invariants
from test_eviction import BLOCK, Driver, use_pooled_manager
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.request import RequestStatus

from vllm_hybrid.config.hybrid_kv import HybridKVOptions
from vllm_hybrid.v1.core.pooled.layers import split_layers
from vllm_hybrid.v1.core.pooled.planner import PooledBudget, plan_pooled_kv_cache
from vllm_hybrid.v1.core.pooled.policy.eviction import Entry
from vllm_hybrid.v1.core.pooled.policy.positions import (
    CheckpointPolicy,
    is_prefill_anchor,
    keeps_a_turn_end_past_prompt,
    next_prefill_checkpoint,
    prefill_checkpoint_anchor,
    prefill_checkpoint_interval,
    prefill_checkpoints,
    state_page_tokens,
)
from vllm_hybrid.v1.core.pooled.policy.steps import (
    StepPlan,
    junction_worth_a_step,
    keeps_last_checkpoint,
    keeps_prompt_checkpoint,
)
from vllm_hybrid.v1.core.sched.scheduler import PooledSchedulerMixin

MiB = 2**20


def _qwen3_6_plan(block: int, mib: int, mode: str = "align"):
    specs = {}
    for i in range(8):
        if i % 4 == 3:
            specs[f"layers.{i}"] = FullAttentionSpec(
                block_size=block, num_kv_heads=2, head_size=256, dtype=torch.bfloat16
            )
        else:
            specs[f"layers.{i}"] = MambaSpec(
                block_size=block,
                shapes=((3, 8192), (32, 128, 128)),
                dtypes=(torch.bfloat16, torch.float32),
                mamba_cache_mode=mode,
            )
    budget = PooledBudget(mib * MiB, 4096, 64, null_blocks_overlap=True)
    return plan_pooled_kv_cache(split_layers(specs), budget)


def test_the_interval_is_the_state_page_in_tokens_or_the_budget_term():
    """One GDN layer's state weighs 2,146,304 / 2,048 = 1,048 tokens of one
    attention layer's KV; rounded up to the state block. At 48 MiB one
    4,096-token prompt's checkpoints every 1,048 tokens would hold more than
    a quarter of the arena (4 x 4,096 x 12,877,824 B / 48 MiB = 4,193 tokens
    apart, past max_model_len): none."""
    plan = _qwen3_6_plan(32, 512)
    assert state_page_tokens(plan) == 1048
    assert prefill_checkpoint_interval(plan, 4096, None) == 1056
    assert prefill_checkpoint_interval(_qwen3_6_plan(128, 512), 4096, None) == 1152
    assert prefill_checkpoint_interval(_qwen3_6_plan(32, 48), 4096, None) == 0
    assert prefill_checkpoint_interval(_qwen3_6_plan(32, 192), 4096, None) == 1056
    # asked for: rounded up to the state block; 0 is off
    assert prefill_checkpoint_interval(plan, 4096, 1000) == 1024
    assert prefill_checkpoint_interval(plan, 4096, 0) == 0
    # no checkpoints without align mode
    assert prefill_checkpoint_interval(_qwen3_6_plan(32, 512, "none"), 4096, None) == 0


def test_the_pacing_page_is_upstreams_state_block():
    """Qwen3.6's GDN state (2,146,304 B a layer) over one bf16 attention
    layer's 2,048 B a token, in 16-token blocks: 16 x ceil(1,048.02 / 16) =
    1,056 tokens, the block vLLM 0.32 gives this model with bf16 KV."""
    from vllm_hybrid.v1.core.pooled.policy.steps import pacing_page

    assert pacing_page(_qwen3_6_plan(16, 512), "align") == 1056
    assert pacing_page(_qwen3_6_plan(128, 512), "align") == 1152
    assert pacing_page(_qwen3_6_plan(16, 512, "none"), "none") is None
    assert pacing_page(object(), "align") is None  # not a pooled plan


def test_anchors_are_where_the_checkpoints_weigh_what_their_prefix_weighs():
    """The 6 GDN layers' state block (12,877,824 B) weighs 3,144 tokens of
    the 2 attention layers' KV (4,096 B per token): the nearest whole number
    of 1,056-token intervals is 3, so every third checkpoint is an anchor."""
    plan = _qwen3_6_plan(32, 512)
    assert plan.layout.state_block_bytes == 12_877_824
    assert prefill_checkpoint_anchor(plan, 1056) == 3168
    assert prefill_checkpoint_anchor(plan, 1024) == 3072
    # an anchor at every checkpoint (or none within reach) is no anchor
    assert prefill_checkpoint_anchor(plan, 2112) == 0  # 1.49 intervals
    assert prefill_checkpoint_anchor(plan, 1568) == 3136  # 2.01 intervals
    assert prefill_checkpoint_anchor(plan, 8192) == 0
    assert prefill_checkpoint_anchor(plan, 0) == 0
    assert [is_prefill_anchor(n, 3168) for n in (1056, 2112, 3168, 6336)] == [
        False,
        False,
        True,
        True,
    ]
    assert not is_prefill_anchor(3168, 0)


@pytest.mark.parametrize(
    ("value", "parsed"), [(None, None), (0, 0), (2048, 2048), (-1, ""), (True, "")]
)
def test_the_option_is_a_whole_number_of_tokens(value, parsed):
    options = {} if value is None else {"prefill_checkpoint_interval": value}
    config = type("V", (), {"additional_config": {"hybrid_kv": options}})()
    if parsed == "":
        with pytest.raises(ValueError, match="prefill_checkpoint_interval must be"):
            HybridKVOptions.from_vllm_config(config)
        return
    assert HybridKVOptions.from_vllm_config(config).prefill_checkpoint_interval == (
        parsed
    )


def test_the_last_checkpoint_a_chunk_passes():
    """A 1,300-token prompt's chunk from 0 to its own checkpoint (1,280)
    passes the one at 1,056; one from 1,056 passes none."""
    from vllm_hybrid.v1.core.pooled.policy.positions import last_prefill_checkpoint

    assert last_prefill_checkpoint(0, 1280, 1300, 1056, 32) == 1056
    assert last_prefill_checkpoint(1056, 1280, 1300, 1056, 32) is None
    # the last of several, never the prompt's own (2,112 is 5,000's last)
    assert last_prefill_checkpoint(0, 4992, 5000, 1056, 32) == 4224
    assert last_prefill_checkpoint(0, 2112, 2113, 1056, 32) == 1056
    assert last_prefill_checkpoint(0, 1000, 1300, 1056, 32) is None
    assert last_prefill_checkpoint(0, 1280, 1300, 0, 32) is None


def test_each_checkpoint_near_a_prompts_end_ranks_as_its_kind():
    """A 100-token prompt, 16-token blocks, prefill checkpoints every 32
    tokens: 32 is speculative, 64 the last prefill checkpoint (upstream's
    kept state), 96 the prompt's own; 48 is no checkpoint."""
    policy = CheckpointPolicy.of(True, prefill_interval=32, prefill_anchor=0)
    positions = policy.prefill_positions(100, BLOCK)
    assert list(positions) == [32, 64]
    kinds = {n: policy.prompt_entry(n, 100, BLOCK, positions) for n in (32, 48, 64, 96)}
    assert kinds == {
        32: Entry.PREFILL,
        48: None,
        64: Entry.PREFILL_LAST,
        96: Entry.PROMPT,
    }
    anchored = CheckpointPolicy.of(True, prefill_interval=32, prefill_anchor=64)
    assert anchored.prompt_entry(64, 100, BLOCK, positions) is Entry.PREFILL_ANCHOR


def test_positions_lie_below_the_prompts_own_checkpoint():
    # a 1,300-token prompt keeps its own at 1,280; 2,112 would pass it
    assert list(prefill_checkpoints(1300, 1056, 32)) == [1056]
    assert list(prefill_checkpoints(2113, 1056, 32)) == [1056]
    assert list(prefill_checkpoints(2114, 1056, 32)) == [1056]
    assert list(prefill_checkpoints(2145, 1056, 32)) == [1056, 2112]
    assert list(prefill_checkpoints(5000, 0, 32)) == []
    assert next_prefill_checkpoint(0, 1300, 1056, 32) == 1056
    assert next_prefill_checkpoint(1056, 1300, 1056, 32) is None
    assert next_prefill_checkpoint(1056, 5000, 1056, 32) == 2112
    assert next_prefill_checkpoint(0, 1300, 0, 32) is None


class _Upstream:
    """What the mixin's split calls through super(): upstream's result, with
    its stop at a shared-prefix junction floored to whole blocks from the
    chunk's start (vLLM's ``_mamba_block_aligned_split``)."""

    def _mamba_block_aligned_split(self, request, num_new_tokens, *args) -> int:
        start = request.num_computed_tokens + sum(args)
        junction = request.shared_prefix_boundary
        if start < junction < start + num_new_tokens:
            stop = start + (junction - start) // 32 * 32
            if stop > start:
                return stop - start
        return num_new_tokens


class _Scheduler(PooledSchedulerMixin, _Upstream):
    def __init__(self, interval: int) -> None:  # no engine behind it
        self.prefill_checkpoint_interval = interval
        self.prefill_checkpoint_cuts = 0
        self.cache_config = type("C", (), {"block_size": 32})()
        # not paced, no decodes, no deep chunks (test_pooled_scheduler.py,
        # test_decode_room.py)
        self._step = StepPlan()


def _request(
    computed: int, prompt: int, junction: int = 0, status=RequestStatus.WAITING
):
    return type(
        "R",
        (),
        {
            "request_id": "r",
            "num_computed_tokens": computed,
            "num_prompt_tokens": prompt,
            "num_tokens": prompt,
            "shared_prefix_boundary": junction,
            "status": status,
        },
    )


def test_the_scheduler_ends_a_chunk_at_the_next_checkpoint():
    sched = _Scheduler(1056)
    assert sched._mamba_block_aligned_split(_request(0, 1300), 1300) == 1056
    assert sched._mamba_block_aligned_split(_request(1056, 1300), 244) == 244
    # a hit of 512 tokens: the chunk from there ends at 1,056
    assert sched._mamba_block_aligned_split(_request(0, 1300), 1300, 512) == 544
    # a chunk that ends before the checkpoint anyway is left alone
    assert sched._mamba_block_aligned_split(_request(0, 5000), 512) == 512
    assert sched._mamba_block_aligned_split(_request(2000, 5000), 3000) == 112
    assert sched.prefill_checkpoint_cuts == 3
    off = _Scheduler(0)
    assert off._mamba_block_aligned_split(_request(0, 1300), 1300) == 1300
    assert off.prefill_checkpoint_cuts == 0


def test_a_junction_one_block_past_the_chunks_start_ends_no_chunk():
    assert not junction_worth_a_step(1520, 1552, 32)
    assert not junction_worth_a_step(1520, 1583, 32)  # floored to 1,552
    assert junction_worth_a_step(1520, 1584, 32)
    sched = _Scheduler(0)
    # a hit at 1,520 whose attention blocks match one block further: the
    # whole rest in one step, where upstream's split stops at 1,552
    request = _request(1520, 2419, junction=1552)
    assert sched._mamba_block_aligned_split(request, 899) == 899
    assert request.shared_prefix_boundary == 1552
    assert sched._mamba_block_aligned_split(_request(1520, 2419, 1583), 899) == 899
    # two blocks past the start: the junction's state is worth the step
    assert sched._mamba_block_aligned_split(_request(1520, 2419, 1584), 899) == 64
    assert sched._mamba_block_aligned_split(_request(0, 1444, 400), 1444) == 384


def test_a_paced_chunk_stops_before_the_prompts_end_unless_prompts_hit_more():
    assert keeps_last_checkpoint({Entry.PREFILL_LAST: 3.0, Entry.PROMPT: 2.0})
    # no hits yet: a prefix's first reuse finds the last prefill checkpoint
    assert keeps_last_checkpoint({Entry.PREFILL_LAST: 0.0, Entry.PROMPT: 0.0})
    assert not keeps_last_checkpoint({Entry.PREFILL_LAST: 2.0, Entry.PROMPT: 2.5})
    sched = _Scheduler(1056)
    sched._checkpoints_on_pace = True
    sched._pace_page = 1056  # the checkpoints lie on pages
    # a 2,200-token prompt in one paced chunk: its own checkpoint is 2,176
    # (upstream's split stops there: one step more for the last 24 tokens);
    # stopping at 2,112 as well would cost one more
    sched._step = StepPlan(paced=True, keep_last=True)
    assert sched._mamba_block_aligned_split(_request(0, 2200), 2200) == 2112
    sched._step = StepPlan(paced=True, keep_last=False)
    assert sched._mamba_block_aligned_split(_request(0, 2200), 2200) == 2200
    # unpaced, a chunk still ends at each checkpoint
    sched._step = StepPlan(keep_last=False)
    assert sched._mamba_block_aligned_split(_request(0, 2200), 2200) == 1056


def _replying(request, max_tokens: int, ignore_eos: bool = True, stop=None):
    """``request`` with a reply of at most ``max_tokens``; with ``ignore_eos``
    and no stop it runs to that budget."""
    request.max_tokens = max_tokens
    request.sampling_params = SimpleNamespace(
        ignore_eos=ignore_eos, stop=stop, stop_token_ids=None, repetition_detection=None
    )
    return request


def test_a_turn_end_past_the_prompt_needs_a_reply_that_runs_to_its_budget():
    # 2,200 + 63 - 1 reaches 2,240 (32-token blocks), past the prompt
    assert keeps_a_turn_end_past_prompt(_replying(_request(0, 2200), 63), 32)
    # 2,200 + 40 - 1 stops short of 2,240: the last edge is 2,208 = 69 x 32
    assert keeps_a_turn_end_past_prompt(_replying(_request(0, 2200), 40), 32)
    assert not keeps_a_turn_end_past_prompt(_replying(_request(0, 2200), 8), 32)
    # a prompt ending on an edge: 32 more tokens, all but the last computed,
    # reach no further edge
    assert not keeps_a_turn_end_past_prompt(_replying(_request(0, 1696), 32), 32)
    # end of sequence or a stop string may end the reply before its budget
    reply = _replying(_request(0, 2200), 63, ignore_eos=False)
    assert not keeps_a_turn_end_past_prompt(reply, 32)
    reply = _replying(_request(0, 2200), 63, stop=["\n"])
    assert not keeps_a_turn_end_past_prompt(reply, 32)


def test_a_chunk_finishes_its_prompt_where_turn_ends_hit_more():
    """Follow-ups that repeat the reply resume at the turn end decoding
    keeps, so where turn ends served more hits than prompts' own checkpoints
    the last tokens of a prompt whose reply keeps one need no step of their
    own; with no hits yet, where prompts' own hit as much, or where the reply
    may keep no turn end, the chunk stops at the prompt's checkpoint."""
    assert keeps_prompt_checkpoint({})
    assert keeps_prompt_checkpoint({Entry.TURN_END: 2.0, Entry.PROMPT: 2.0})
    assert not keeps_prompt_checkpoint({Entry.TURN_END: 2.5, Entry.PROMPT: 2.0})
    sched = _PromptStopScheduler(0)

    def split(computed: int, prompt: int, chunk: int, max_tokens: int = 64) -> int:
        request = _replying(_request(computed, prompt), max_tokens)
        return sched._mamba_block_aligned_split(request, chunk)

    # a 2,200-token prompt: its own checkpoint is 2,176 (32-token blocks)
    assert split(0, 2200, 2200) == 2176
    assert split(1520, 2419, 899) == 880
    sched._step = StepPlan(keep_prompt=False)
    assert split(0, 2200, 2200) == 2200
    assert split(1520, 2419, 899) == 899
    # a reply that keeps no turn end past the prompt: the stop stays
    assert split(0, 2200, 2200, max_tokens=8) == 2176
    # a chunk that does not finish the prompt keeps upstream's stop
    assert split(0, 2200, 2190) == 2176
    # so does a junction before the prompt's checkpoint
    junction = _replying(_request(0, 2200, junction=1600), 64)
    assert sched._mamba_block_aligned_split(junction, 2200) == 1600


class _Arena:
    """A coordinator whose admission serves chunks up to ``room`` tokens,
    recording the slots each count asked for."""

    def __init__(self, room: int) -> None:
        self.room, self.asked = room, []

    def admit(self, request_id, num_tokens, hits, encoder, total, local, *a, **k):
        self.asked.append(num_tokens)
        return object() if num_tokens - total <= self.room else None


def test_a_running_chunk_the_arena_cannot_serve_waits_while_others_decode():
    """Upstream preempts a request (often the one prefilling) when a running
    request's chunk does not fit; pooled mode's split gives that chunk no
    tokens this step while another running request decodes, and leaves the
    chunk whole where it fits or nothing else makes progress."""
    sched = _Scheduler(0)
    arena = _Arena(room=1000)
    sched.kv_cache_manager = SimpleNamespace(
        coordinator=arena,
        max_model_len=10_000,
        empty_kv_cache_blocks=SimpleNamespace(blocks=((), ())),
    )
    sched.num_lookahead_tokens = 0
    running = RequestStatus.RUNNING
    prefilling = _request(2000, 5000, status=running)
    decoding = _request(3001, 3000, status=running)
    sched.running = [decoding, prefilling]
    split = sched._mamba_block_aligned_split
    assert split(prefilling, 800) == 800
    assert split(prefilling, 2000) == 0  # 2,000 do not fit: it waits a step
    assert arena.asked == [2800, 4000]
    sched.running = [prefilling]  # none decodes: upstream's preemption runs
    assert split(prefilling, 2000) == 2000
    # a waiting prompt's chunk is admitted (or not) by upstream's path
    assert split(_request(0, 5000), 2000) == 2000
    assert len(arena.asked) == 3


class _UpstreamWithPromptStop(_Upstream):
    """:class:`_Upstream` with upstream's stop at the prompt's own
    checkpoint: a chunk never runs past the last block edge before the
    prompt's last token (vLLM's ``get_mamba_prefill_checkpoint_position``)."""

    def _mamba_block_aligned_split(self, request, num_new_tokens, *args) -> int:
        num_new_tokens = super()._mamba_block_aligned_split(
            request, num_new_tokens, *args
        )
        start = request.num_computed_tokens + sum(args)
        own = (request.num_tokens - 1) // 32 * 32
        if start < own < start + num_new_tokens:
            return own - start
        return num_new_tokens


class _PromptStopScheduler(_Scheduler, _UpstreamWithPromptStop):
    pass


@pytest.mark.parametrize(
    ("interval", "anchor"), [(2 * BLOCK, 0), (2 * BLOCK, 4 * BLOCK), (0, 0)]
)
def test_retention_keeps_the_state_a_chunk_ended_at(monkeypatch, interval, anchor):
    """A 100-token prompt in chunks ending at 32, 64 and 96 (16-token
    blocks): with prefill checkpoints every 32 tokens the states at 32 and 64
    stay cached next to the prompt's own at 96; 32 first in the eviction
    order, 64 (the prompt's last prefill checkpoint, or an anchor with anchors
    every 64 tokens) in LRU order, and a request sharing its first 70 tokens
    hits 64; without them it hits nothing."""
    use_pooled_manager(monkeypatch)
    driver = Driver(
        arena_blocks=40,
        max_num_seqs=2,
        prefill_interval=interval,
        prefill_anchor=anchor,
    )
    rng = random.Random(3)
    tokens = [rng.randrange(200, 900) for _ in range(100)]
    first = driver.request("first", tokens)
    states = driver.coordinator.single_type_managers[1].req_to_blocks
    at = {}  # state block of the state at each chunk's end
    for chunk in (32, 32, 32, 4):
        assert driver.step(first, chunk)
        end = first.num_computed_tokens
        at[end] = states["first"][(end - 1) // BLOCK].block_id
    driver.manager.free(first)
    state = driver.arena.state_pool
    assert len(state.cached_keys()) == (3 if interval else 1)
    # 32 is evicted before the prompt's own checkpoint; 64, the last one
    # (upstream keeps its state there) or an anchor, keeps its LRU place
    # (freed when the request moved past it, before the prompt's own at the
    # request's end)
    expected = [at[32], at[64], at[96]] if interval else [at[96]]
    assert cached_ids(state.free_block_queue) == expected
    counts = driver.coordinator.turn_end_counts
    assert counts.prefill_cached == (2 if interval else 0)
    assert counts.prefill_by_request == {}
    shared = driver.request("shared", tokens[:70] + [5, 6])
    assert driver.admit(shared) == (64 if interval else 0)
    check_invariants(driver.arena)


@pytest.mark.slow
def test_a_shared_prefix_hits_on_its_first_reuse(tiny_model_dir):
    """qwen3_6 at 32-token blocks and 512 MiB: three prompts share a
    1,200-token prefix. The first is cut at its prefill checkpoint (1,056),
    the second hits there and caches the junction (1,184), the third hits
    the junction. Without prefill checkpoints the second hits nothing."""
    from engine_utils import generate_greedy, scheduler, with_engine

    rng = random.Random(0)
    system = [rng.randrange(10, 900) for _ in range(1200)]
    prompts = [
        {"prompt_token_ids": system + [rng.randrange(10, 900) for _ in range(100)]}
        for _ in range(3)
    ]

    def run(llm):
        hits = [generate_greedy(llm, [p], 4).cached[0] for p in prompts]
        sched = scheduler(llm)
        return hits, sched.prefill_checkpoint_interval, sched.prefill_checkpoint_cuts

    kwargs = dict(
        block_size=32,
        kv_cache_memory_bytes=512 * MiB,
        max_model_len=4096,
        enable_prefix_caching=True,
    )
    model = str(tiny_model_dir("qwen3_6"))
    assert with_engine(model, True, kwargs, run) == ([0, 1056, 1184], 1056, 1)


def test_a_junction_seen_twice_is_kept(monkeypatch):
    """Without prefill checkpoints a 100-token prompt keeps one state, at
    96. A second prompt sharing its first 70 tokens finds the attention KV of
    64 of them but no state there: it hits nothing, and upstream names 64
    the junction its prefix shares, where its first chunk ends. The state
    there stays cached, so a third prompt of that prefix hits 64 tokens."""
    use_pooled_manager(monkeypatch)
    driver = Driver(arena_blocks=40, max_num_seqs=2)
    rng = random.Random(5)
    shared = [rng.randrange(200, 900) for _ in range(70)]

    def serve(name: str, tail: int) -> tuple[int, int]:
        """Serve a prompt as the scheduler does: a first chunk ends at the
        junction, if any; the tokens it hit and the junction."""
        request = driver.request(name, shared + [tail] * 30)
        driver.manager.new_step_starts()
        blocks, hit, junction = driver.manager.get_computed_blocks(request)
        request.shared_prefix_boundary = junction
        chunk = (junction or 96) - hit
        assert driver.manager.allocate_slots(request, chunk, hit, blocks)
        request.num_computed_tokens = hit + chunk
        assert driver.step(request)
        driver.manager.free(request)
        return hit, junction

    assert serve("first", 1) == (0, 0)
    assert serve("second", 2) == (0, 64)
    assert serve("third", 3)[0] == 64
    check_invariants(driver.arena)


def test_the_call_at_the_prompts_end_takes_retentions_full_path():
    """Retention's fast path (no group filled a block, so no kept position
    is new) skips the policy; the call at the prompt's end takes the full
    path even so, since the prompt's own checkpoint, cached by an earlier
    call, may have its key only by then and must be noted as the prompt's."""
    from vllm_hybrid.v1.core.pooled.retention import TurnEndRetentionMixin

    asked: list[int] = []
    policy = SimpleNamespace(adds_positions=True, prefill_interval=0)

    def state_positions(request, num_tokens, *args):
        asked.append(num_tokens)
        return SimpleNamespace(boundaries=(), turn_end=False, prefill=range(0))

    policy.state_positions = state_positions
    manager = SimpleNamespace(enable_caching=True, block_size=16)
    manager.cache_blocks = lambda *args, **kwargs: None
    retention = SimpleNamespace(
        _requests={},
        checkpoint_policy=policy,
        single_type_managers=(manager,),
        eagle_group_ids=set(),
        get_num_cacheable_tokens=lambda n, group_id: n // 16 * 16,
        _fills_a_block=lambda rid, cacheable: False,
        _caching=((0, manager, 0, False),),
        scheduler_block_size=16,
        retention_interval=0,
    )
    request = SimpleNamespace(
        request_id="r",
        num_prompt_tokens=100,
        num_tokens=100,
        num_computed_tokens=96,
        spec_token_ids=[],
    )
    TurnEndRetentionMixin.cache_blocks(retention, request, 99)
    assert asked == []  # nothing new: the fast path
    TurnEndRetentionMixin.cache_blocks(retention, request, 100)
    assert asked == [96]  # the prompt's end: the policy is asked
