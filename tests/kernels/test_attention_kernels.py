"""Attention-layer kernels on pooled views agree with upstream's single pool.

For each case (KV cache dtype, block size, boundary position, arena budget,
eager or CUDA graphs) one arena is canary-filled and three steps run through
the backend impl a CUDA worker uses, once on the pooled views and once on
dense per-layer twins:

* store: every position of two requests (2 blocks and 1 block, at scattered
  ids from ``pick`` that include the ids next to the null region and next to
  the boundary) into both attention layers (TurboQuant: the read layer);
  with CUDA graphs the slot mapping carries padded slots (-1);
* decode: one query token per request (bf16: the split-softmax 3D kernel;
  TurboQuant: its split-KV decode kernel); with CUDA graphs the batch has a
  padded request (empty query, seq_len 0, null block-table row);
* prefill-ish (bf16): a chunked continuation over a cached block and a whole
  prompt (the 2D kernel); (TurboQuant): a continuation, which runs the
  decode kernel once per query token on an expanded (stride-0) block table;
  TurboQuant's whole prompts never read the cache.

The same computation runs on the same bytes, so outputs and pages must be
bitwise equal, and nothing outside the pages the requests own may change.
A float32 reference (over what the cache format keeps of the inputs) checks
that both runs computed attention, not garbage.
"""

from __future__ import annotations

import pytest
from arena_views import MiB
from attention_check import (
    Setup,
    reference,
    stored_kv_matches,
    turboquant_store_differences,
)
from attention_harness import BF16, TURBOQUANT, Batch, Case, worker_workspace
from interpreter_numerics import interpreter_fixes
from vllm.v1.attention.backends import turboquant_attn
from vllm.v1.kv_cache_layout import KVCacheLayout

#: numpy's warnings from the interpreter's masked lanes and padded rows
#: (0/0 for a request with seq_len 0), whose results no one reads.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

ODD = 48 * MiB + 3

BF16_CASES = [
    Case(BF16, 16, "min", layer=1, seed=1),
    Case(BF16, 32, "initial", arena_bytes=ODD, cuda_graphs=True, layer=0, seed=2),
    Case(BF16, 16, "max", layout=KVCacheLayout.LBHNC, cuda_graphs=True, seed=3),
]
#: TurboQuant's continuation runs its decode kernel per query token with 32
#: splits (the impl passes no split count there), hundreds of programs the
#: interpreter runs one by one: one case runs it, the others decode only.
TQ_CASES = [
    Case(TURBOQUANT, 16, "initial", ODD, cuda_graphs=True, seed=4, reads=("decode",)),
    Case(TURBOQUANT, 32, "min", layer=0, seed=5),
    Case(TURBOQUANT, 16, "max", cuda_graphs=True, seed=6, reads=("decode",)),
]
CASES = BF16_CASES + TQ_CASES

#: Max |output - reference|. Outputs reach ~3, where one bf16 step is 2**-6
#: (0.016); the interpreter truncates float32 to bf16 where a GPU rounds, and
#: the kernels cast softmax weights to bf16 for the P.V product. Measured:
#: 0.014-0.018. Reading the wrong bytes is off by O(1) or much more.
TOLERANCE = 5e-2


def seq_lens(block_size: int) -> tuple[int, ...]:
    """A request two tokens into its second block, and a short one."""
    return (block_size + 2, 3)


def store_batch(case: Case) -> Batch:
    lens = seq_lens(case.block_size)
    return Batch(query_lens=lens, pad_tokens=2 if case.cuda_graphs else 0)


def decode_batch(case: Case) -> Batch:
    return Batch(query_lens=(1, 1), pad_requests=1 if case.cuda_graphs else 0)


def prefill_batch(case: Case) -> Batch:
    if case.flavor is BF16:
        return Batch(query_lens=(4, 3))
    # decodes first (TurboQuant's batch reorder), then the continuation
    return Batch(query_lens=(1, 2))


@pytest.fixture(scope="module", autouse=True)
def _worker():
    with interpreter_fixes(), worker_workspace():
        yield


def stored_layers(setup: Setup) -> tuple[str, ...] | None:
    """bf16 stores every attention layer, as a model step does. TurboQuant's
    store runs one program per (token, head) in the interpreter, so it stores
    the read layer only (the cases alternate between the two layers)."""
    return None if setup.flavor is BF16 else (setup.read_layer,)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.id)
def stored(request) -> Setup:
    """The case's arena after the store step ran on pooled views and twins."""
    case = request.param
    setup = Setup.build(case, seq_lens(case.block_size))
    for pooled in (True, False):
        setup.store(store_batch(case), pooled, layers=stored_layers(setup))
    setup.store_verdict = setup.compare()
    return setup


def test_store_writes_the_same_pages_and_nothing_else(stored):
    assert stored.store_verdict.problems() == []
    if stored.flavor is BF16:
        assert stored_kv_matches(stored)


STEPS = {"decode": decode_batch, "prefill": prefill_batch}


@pytest.mark.parametrize("read", STEPS)
def test_attention_reads_the_same_pages(stored, read):
    if read not in stored.case.reads:
        pytest.skip(f"{read} not run for this case (see TQ_CASES)")
    batch = STEPS[read](stored.case)
    pooled = stored.attend(batch, pooled=True)
    twin = stored.attend(batch, pooled=False)
    assert stored.compare(pooled, twin).problems() == []
    # TurboQuant: over the bytes its store wrote, which
    # test_turboquant_store_writes_the_modeled_format checks against the
    # format (a level at a rounding tie may go either way, and one level of
    # one value moves a short request's output by up to ~0.4)
    expected = reference(stored, batch, from_store=stored.flavor is not BF16)
    error = (pooled.float().cpu() - expected).abs().max().item()
    assert error < TOLERANCE, error


def test_turboquant_store_writes_the_modeled_format(stored):
    """The bytes TurboQuant's store wrote are what the reference models:
    fp8 e4m3 keys rounded to nearest, 4-bit value levels (either one at a
    rounding tie), fp16 scale and zero (counts of differing elements over
    every stored position)."""
    if stored.flavor is BF16:
        pytest.skip("bf16 is checked bytewise by the store test")
    assert turboquant_store_differences(stored) == {
        "keys": 0,
        "levels": 0,
        "scale_zero": 0,
    }


#: A continuation chunk longer than TurboQuant's decode-kernel threshold.
CHUNK = turboquant_attn._CONTINUATION_DECODE_THRESHOLD + 1


def flash_attention_missing() -> bool:
    """On CUDA the continuation calls vLLM's compiled flash attention; a
    Python-only vLLM tree (the prepared device run) has a stand-in for it."""
    import torch

    return turboquant_attn._HAS_FLASH_ATTN and not (
        hasattr(torch.ops._vllm_fa2_C, "varlen_fwd")
        or hasattr(torch.ops._vllm_fa3_C, "fwd")
    )


@pytest.mark.skipif(
    flash_attention_missing(), reason="vLLM's flash attention ops are not built"
)
def test_turboquant_long_continuation_dequantizes_the_same_pages():
    """Past 128 chunk tokens TurboQuant dequantizes the cached prefix with
    its third kernel (``_tq_full_dequant_kv``, over whole blocks) and runs
    flash-attn (SDPA here) on prefix + the chunk's own K/V. The chunk is not
    stored first: the kernel reads only the prefix (its store is covered
    above, and 129 tokens cost seconds in the interpreter)."""
    case = Case(TURBOQUANT, 32, "initial", seed=7)
    cached = seq_lens(case.block_size)[0]
    setup = Setup.build(case, (cached + CHUNK,))
    prefix = Batch(query_lens=(cached,), lengths=(cached,))
    for pooled in (True, False):
        setup.store(prefix, pooled, layers=(setup.read_layer,))
    chunk = Batch(query_lens=(CHUNK,))
    pooled = setup.attend(chunk, pooled=True)
    twin = setup.attend(chunk, pooled=False)
    assert setup.compare(pooled, twin).problems() == []
    expected = reference(setup, chunk, cached=cached)
    error = (pooled.float().cpu() - expected).abs().max().item()
    assert error < TOLERANCE, error
