"""Pooled mode's scheduler choice: prefill chunks end on state checkpoint edges.

The engine test (``pooled/test_engine.py``, ``mamba-block-256``) checks the
hits this gives; these tests pin down when the scheduler is swapped, that
nothing else is, and the upstream fact the swap relies on.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from types import SimpleNamespace

import pytest
from test_kv_cache_utils import attention_spec, gdn_spec
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheGroupSpec

from vllm_hybrid.v1.core.kv_cache_utils import select_scheduler
from vllm_hybrid.v1.core.pooled.policy.steps import state_checkpoint_block
from vllm_hybrid.v1.core.sched.async_scheduler import PooledAsyncScheduler
from vllm_hybrid.v1.core.sched.scheduler import PooledScheduler


def _kv_config(attention_block: int, state_block: int | None):
    groups = [KVCacheGroupSpec(["attn"], attention_spec(block_size=attention_block))]
    if state_block is not None:
        groups.append(KVCacheGroupSpec(["gdn"], gdn_spec(block_size=state_block)))
    return SimpleNamespace(kv_cache_groups=groups)


def _vllm_config(mode: str = "align", scheduler_cls=None, async_scheduling=False):
    return SimpleNamespace(
        cache_config=SimpleNamespace(mamba_cache_mode=mode, block_size=128),
        scheduler_config=SimpleNamespace(
            scheduler_cls=scheduler_cls, async_scheduling=async_scheduling
        ),
    )


@pytest.mark.parametrize(
    ("attention", "state", "mode", "expected"),
    [
        (128, 384, "align", 384),  # interval longer than the attention block
        (128, 128, "align", None),  # default interval: upstream's split is right
        (128, 384, "none", None),  # no checkpoints without prefix caching
        (128, None, "align", None),  # no state group (dense model)
    ],
)
def test_state_checkpoint_block(attention, state, mode, expected):
    assert state_checkpoint_block(_kv_config(attention, state), mode) == expected


def test_select_scheduler_picks_the_pooled_scheduler_for_every_pooled_plan():
    config = _vllm_config()
    select_scheduler(config, _kv_config(128, 128))
    assert config.scheduler_config.scheduler_cls is PooledScheduler
    config = _vllm_config()
    select_scheduler(config, _kv_config(128, 384))
    assert config.scheduler_config.scheduler_cls is PooledScheduler
    config = _vllm_config(async_scheduling=True)
    select_scheduler(config, _kv_config(128, 384))
    assert config.scheduler_config.scheduler_cls is PooledAsyncScheduler
    assert issubclass(PooledScheduler, Scheduler)
    assert issubclass(PooledAsyncScheduler, AsyncScheduler)


def test_select_scheduler_keeps_a_user_class_and_says_what_it_misses(caplog):
    user_cls = "my.module.MyScheduler"
    config = _vllm_config(scheduler_cls=user_cls)
    with caplog.at_level("WARNING"):
        select_scheduler(config, _kv_config(128, 384))
    assert config.scheduler_config.scheduler_cls == user_cls
    text = caplog.text
    assert "--scheduler-cls" in text and "--mamba-block-size" in text
    assert "every 384 tokens" in text


def _block_size_reads(cls: type) -> dict[str, int]:
    """Methods of ``cls`` (own, not inherited) reading
    ``self.cache_config.block_size``, with the number of reads."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    reads: dict[str, int] = {}
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(func):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "block_size"
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "cache_config"
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "self"
            ):
                reads[func.name] = reads.get(func.name, 0) + 1
    return reads


def test_upstream_scheduler_reads_the_block_only_for_the_mamba_split():
    """The scheduler's private cache-config copy changes exactly one thing:
    upstream reads ``self.cache_config.block_size`` after construction only
    in its Mamba alignment. If a new vLLM reads it elsewhere, this fails and
    the copy must be revisited."""
    assert _block_size_reads(Scheduler) == {"_mamba_block_aligned_split": 1}
    assert _block_size_reads(AsyncScheduler) == {}


def test_growth_reserve_counts_each_running_requests_next_tokens():
    """Admission's watermark: every running request's next ``horizon``
    tokens in token blocks, or what its budget has left if less."""
    from vllm_hybrid.v1.core.sched.scheduler import PooledSchedulerMixin

    def running(prompt: int, max_tokens: int, computed: int) -> SimpleNamespace:
        return SimpleNamespace(
            num_prompt_tokens=prompt,
            max_tokens=max_tokens,
            num_computed_tokens=computed,
        )

    scheduler = SimpleNamespace(
        _growth=(1056, 16, 1),
        running=[
            running(5000, 400, 1000),  # mid-prefill: the horizon, 66 blocks
            running(5000, 400, 5390),  # 9 tokens left: one block
            running(5000, 400, 5399),  # done growing
        ],
    )
    assert PooledSchedulerMixin.growth_reserve(scheduler) == 66 + 1
    scheduler._growth = (1056, 16, 2)  # two token groups
    assert PooledSchedulerMixin.growth_reserve(scheduler) == 2 * 67


def test_paced_step_budget_is_the_largest_multiple_of_the_page():
    """Upstream's chunk of one long prompt: 2 x 2,768 of 8,192 with
    turboquant_k8v4's block, 7 x 1,056 with bf16's; a budget of one page
    (1,056 of 2,048) or less (2,768 over 2,048) is not paced."""
    from vllm_hybrid.v1.core.pooled.policy.steps import paced_step_budget

    assert paced_step_budget(8192, 2768) == 5536
    assert paced_step_budget(8192, 1056) == 7392
    assert paced_step_budget(2112, 1056) == 2112
    assert paced_step_budget(2111, 1056) is None
    assert paced_step_budget(2048, 2768) is None
    assert paced_step_budget(8192, None) is None


@pytest.mark.parametrize(("waiting", "paced"), [(0, True), (4, True), (5, False)])
def test_steps_are_paced_while_few_requests_wait(waiting, paced):
    from vllm_hybrid.v1.core.pooled.policy.steps import PACING_MAX_WAITING
    from vllm_hybrid.v1.core.sched.scheduler import PooledSchedulerMixin

    assert PACING_MAX_WAITING == 4
    scheduler = SimpleNamespace(_paced_budget=5536, waiting=[object()] * waiting)
    assert PooledSchedulerMixin.paces_next_step(scheduler) is paced
    scheduler._paced_budget = None  # never paced
    assert PooledSchedulerMixin.paces_next_step(scheduler) is False


def test_a_paced_chunk_ends_on_a_page_multiple_unless_it_finishes_the_prompt():
    """Upstream's align split with a 1,056-token block: the chunk a budget
    allows is cut back to the last block edge it reaches, or to nothing."""
    from vllm_hybrid.v1.core.pooled.policy.steps import paced_chunk

    def chunk(prompt: int, start: int, tokens: int, output: int = 0) -> int:
        request = SimpleNamespace(num_prompt_tokens=prompt, num_tokens=prompt + output)
        return paced_chunk(request, start, tokens, 1056)

    assert chunk(10_000, 0, 7392) == 7392
    assert chunk(10_000, 0, 7380) == 6336  # 12 decodes took their tokens
    assert chunk(10_000, 7392, 2608) == 2608  # the last chunk
    assert chunk(3_000, 0, 3000) == 3000
    # a hit 500 tokens in: the last multiple the chunk reaches...
    assert chunk(5_000, 500, 2000) == 2112 - 500
    # ...or none, and the request waits for a step with room
    assert chunk(5_000, 500, 400) == 0
    # a preempted request replaying its output is still prefilling
    assert chunk(4_000, 0, 4100, output=200) == 3 * 1056


def test_a_deep_chunk_ends_on_the_next_page_unless_it_finishes_the_prompt():
    """Past ``deep`` tokens an unfinished chunk ends on the next multiple of
    the page (at most one page), as upstream's align split ends it on its
    block; shallower chunks and last chunks keep the budget's length."""
    from vllm_hybrid.v1.core.pooled.policy.steps import deep_chunk

    def chunk(prompt: int, start: int, tokens: int, output: int = 0) -> int:
        request = SimpleNamespace(num_prompt_tokens=prompt, num_tokens=prompt + output)
        return deep_chunk(request, start, tokens, 1056, 4096)

    assert chunk(100_000, 0, 2048) == 2048  # shallow: the whole budget
    assert chunk(100_000, 4095, 2048) == 2048
    assert chunk(100_000, 4224, 2048) == 1056  # on a page: one page
    assert chunk(100_000, 5000, 2032) == 5280 - 5000  # to the next page
    assert chunk(100_000, 5280, 500) == 500  # the budget cut it shorter
    assert chunk(6_000, 5280, 720) == 720  # the last chunk
    # a preempted request replaying its output is still prefilling
    assert chunk(4_000, 4224, 2048, output=3000) == 1056
    request = SimpleNamespace(num_prompt_tokens=100_000, num_tokens=100_000)
    assert deep_chunk(request, 50_000, 2048, 1056, 0) == 2048  # off


def test_a_step_that_cut_a_deep_chunk_admits_only_prompts_it_finishes():
    from vllm.v1.request import RequestStatus

    from vllm_hybrid.v1.core.pooled.policy.steps import StepPlan
    from vllm_hybrid.v1.core.sched.scheduler import PooledSchedulerMixin

    scheduler = SimpleNamespace(
        _pace_page=1056, _deep_chunk=4096, _step=StepPlan(deep=True), _full_budget=2048
    )

    def cut(prompt: int, start: int, tokens: int, status=RequestStatus.RUNNING):
        request = SimpleNamespace(
            num_prompt_tokens=prompt, num_tokens=prompt, status=status
        )
        return PooledSchedulerMixin._deep_cut(scheduler, request, start, tokens)

    waiting = RequestStatus.WAITING
    assert cut(30_000, 0, 2048, waiting) == 2048  # nothing cut yet
    assert not scheduler._step.cut_deep
    assert cut(100_000, 8448, 2048) == 1056
    assert scheduler._step.cut_deep
    assert cut(30_000, 0, 992, waiting) == 0  # would not finish: not admitted
    assert cut(900, 0, 900, waiting) == 900  # finishes in this step
    assert cut(30_000, 0, 992, RequestStatus.PREEMPTED) == 0
    assert cut(50_000, 9504, 992) == 992  # a running prompt keeps its chunk
    # a page longer than the budget: upstream's split starts a prompt short
    # of its block, and so does this step
    scheduler._pace_page = 2768
    assert cut(30_000, 0, 1328, waiting) == 1328


def test_where_deep_chunks_are_cut():
    from vllm_hybrid.v1.core.pooled.policy.steps import (
        DEEP_CHUNK_TOKENS,
        cuts_deep_chunks,
        deep_chunk_start,
    )

    # where steps are never paced but the budget holds a page (bf16 at
    # 2,048 tokens), while more than four requests wait
    assert deep_chunk_start(1056, 2048) == DEEP_CHUNK_TOKENS == 4096
    assert deep_chunk_start(1056, 8192) == 0  # paced while few wait
    assert deep_chunk_start(2768, 2048) == 0  # the page exceeds the budget
    assert deep_chunk_start(None, 2048) == 0  # no state pool
    assert not cuts_deep_chunks(4)
    assert cuts_deep_chunks(5)
