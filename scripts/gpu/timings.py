"""Part ``timings`` of the device run: upstream's kernels on pooled-mode views
against the same kernels on upstream's contiguous layout, same inputs, one
ratio (pooled / contiguous median time) per kernel.

The arenas, views, twins and kernel calls are the kernel tier's
(``tests/kernels``): the overlay's planner and upstream's
``allocate_kv_cache`` build the pooled views for Qwen3.6-35B-A3B's per-layer
shapes; a twin is a dense per-layer copy, as upstream's single pool lays a
layer out. Kernels, as a CUDA worker calls them:

* attention (2 KV heads x 256, 16-token blocks): bf16 store
  (``triton_reshape_and_cache_flash``) and unified attention, decode and a
  chunked-prefill read; ``turboquant_k8v4`` store and decode (16 query heads,
  32 KV splits, as served);
* GDN (16/32 heads x 128, float32 SSM state): ``causal_conv1d_update`` and
  the packed recurrent decode at batch 64 and 256, and the FLA chunked
  prefill on states gathered from the views.

Only the cache or state tensor differs between the two runs of a pair, with
one exception: the pooled engine's decode path, where a batch of decodes
only reads its states out of place (conv update in its prefix-caching form,
the unpacked recurrent update), is timed against upstream's packed decode
path (conv update and packed recurrent decode), both on the pooled views;
its row names both paths, and its "pooled" and "contiguous" columns are the
overlay's path and upstream's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial

from tier_env import prepare, write_json

KERNELS = prepare()

import torch  # noqa: E402
from arena_views import MiB, attention_spec, build_arena, contiguous_twin, gdn_spec  # noqa: E402
from attention_check import Setup  # noqa: E402
from attention_harness import (  # noqa: E402
    BF16,
    TURBOQUANT,
    Batch,
    Case,
    Flavor,
    metadata,
    queries,
    worker_workspace,
)
from bench import ROUNDS, Results, compare, environment, on_gpu  # noqa: E402
from gdn_ops import (  # noqa: E402
    HV,
    GDNBatch,
    V,
    chunked_prefill,
    conv_update,
    decode_batch,
    gdn_weights,
    out_of_place_decode,
    packed_decode,
)
from interpreter_numerics import interpreter_fixes  # noqa: E402

from vllm_hybrid.v1.core.pooled.spec import PoolKind  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    #: Attention: requests, tokens each, query tokens per request in the
    #: chunked-prefill read, query heads of the TurboQuant runs.
    requests: int
    context: int
    chunk: int
    tq_heads: int
    tq_splits: int
    #: GDN decode batches, and the chunked prefill's requests x tokens.
    gdn_batches: tuple[int, ...]
    prefill: tuple[int, int]
    attention_arena: int
    state_arena: int


DEVICE_SIZES = Sizes(
    requests=64,
    context=1024,
    chunk=64,
    tq_heads=16,
    tq_splits=32,
    gdn_batches=(64, 256),
    prefill=(8, 512),
    attention_arena=1024 * MiB,
    state_arena=1280 * MiB,
)
#: The rehearsal's: every call of the device run, at sizes Triton's
#: interpreter gets through in minutes on two cores.
CPU_SIZES = Sizes(
    requests=2,
    context=20,
    chunk=3,
    tq_heads=4,
    tq_splits=2,
    gdn_batches=(2,),
    prefill=(1, 16),
    attention_arena=48 * MiB,
    state_arena=64 * MiB,
)


def attention_setup(flavor: Flavor, sizes: Sizes) -> Setup:
    """An arena with the token pool at its largest (boundary at its
    highest), every request's blocks scattered over it, and twins."""
    case = Case(flavor, 16, "max", arena_bytes=sizes.attention_arena, seed=3)
    return Setup.build(case, (sizes.context,) * sizes.requests)


def store_pair(setup: Setup) -> tuple:
    """Every position of every request into the read layer, as one prefill
    step stores them."""
    batch = Batch(query_lens=setup.requests.seq_lens)
    slots = batch.slot_mapping(setup.requests)
    key, value = setup.inputs.step_kv(setup.read_layer, setup.requests, batch)

    def run(pooled: bool):
        view = setup.views(pooled)[setup.read_layer]
        return lambda: setup.impl.do_kv_cache_update(
            setup.layer, key, value, view, slots
        )

    return run(True), run(False)


def read_pair(setup: Setup, batch: Batch) -> tuple:
    """``forward`` on the read layer for ``batch``, metadata and queries
    built once (as a worker builds them once per step)."""
    meta = metadata(setup.flavor, setup.requests, batch)
    query = queries(setup.flavor, batch, seed=setup.case.seed + 1)
    key, value = setup.inputs.step_kv(setup.read_layer, setup.requests, batch)
    heads = setup.flavor.num_q_heads
    out = torch.zeros(
        (batch.num_tokens, heads, 256), dtype=torch.bfloat16, device=query.device
    )
    if setup.flavor.cache_dtype != "auto":
        out = out.flatten(1)

    def run(pooled: bool):
        view = setup.views(pooled)[setup.read_layer]
        return lambda: setup.impl.forward(
            setup.layer, query, key, value, view, meta, out
        )

    return run(True), run(False)


def timed(pair: Callable[[], tuple], rounds: int, shape: str) -> dict:
    """``compare`` of the two calls ``pair()`` builds (pooled, contiguous)."""
    return {"shape": shape, **compare(*pair(), rounds)}


def served_turboquant(sizes: Sizes) -> Flavor:
    """``turboquant_k8v4`` as served: Qwen3.6's query heads and KV splits
    (the tier uses fewer to keep the interpreter fast)."""
    import attention_harness

    attention_harness.TQ_KV_SPLITS = sizes.tq_splits
    return Flavor(
        TURBOQUANT.cache_dtype,
        TURBOQUANT.backend,
        TURBOQUANT.spec_dtype,
        sizes.tq_heads,
    )


def attention(results: Results, sizes: Sizes, rounds: int) -> None:
    n, ctx = sizes.requests, sizes.context
    shape = f"{n} requests x {ctx} tokens, 16-token blocks"
    decode = Batch(query_lens=(1,) * n)
    chunk = Batch(query_lens=(sizes.chunk,) * n)
    for label, flavor in (
        ("bf16", BF16),
        ("turboquant_k8v4", served_turboquant(sizes)),
    ):
        setup = attention_setup(flavor, sizes)
        steps = {"store": partial(store_pair, setup)}
        steps["decode"] = partial(read_pair, setup, decode)
        if flavor is BF16:
            steps[f"prefill read ({sizes.chunk} new tokens each)"] = partial(
                read_pair, setup, chunk
            )
        for step, pair in steps.items():
            results.measure(f"{label} {step}", partial(timed, pair, rounds, shape), 20)
        del setup
        if on_gpu():
            torch.cuda.empty_cache()


def state_arena(sizes: Sizes):
    """One GDN layer's state pool at its largest (boundary at its lowest)
    and the dense twins of its conv and SSM state tensors."""
    arena = build_arena(
        attention_spec(16),
        gdn_spec(16),
        num_token_layers=1,
        num_state_layers=1,
        arena_bytes=sizes.state_arena,
    )
    arena.state_floor = arena.config.layout.min_state_floor
    pooled = arena.states[arena.state_layers[0]]
    twin = tuple(contiguous_twin(t) for t in pooled)
    return arena, pooled, twin


def conv_pair(states: tuple, state_ids: torch.Tensor, batch: GDNBatch, w) -> tuple:
    x = batch.mixed_qkv.clone()
    return tuple(partial(conv_update, s, state_ids, x, w) for s in states)


def decode_pair(states: tuple, state_ids: torch.Tensor, batch: GDNBatch, w) -> tuple:
    mixed = batch.mixed_qkv.clone()
    rows = state_ids.shape[0]
    out = torch.zeros((rows, 1, HV, V), dtype=mixed.dtype, device=mixed.device)
    return tuple(
        partial(packed_decode, s, state_ids, mixed, batch, w, out) for s in states
    )


def decode_paths_pair(
    states: tuple, state_ids: torch.Tensor, batch: GDNBatch, w
) -> tuple:
    """The overlay's decode-only path (every row reading a block of its own
    elsewhere: the second half of the ids) and upstream's packed path (conv
    update and packed decode, in place), both on the pooled views."""
    pooled = states[0]
    half = state_ids.shape[0] // 2
    read, write = state_ids[:half], state_ids[half:]
    rows = GDNBatch(lens=[1] * half, has_initial_state=[True] * half, seed=21)
    mixed = rows.mixed_qkv.clone()
    out = torch.zeros((half, 1, HV, V), dtype=mixed.dtype, device=mixed.device)

    def upstream() -> None:
        packed_decode(
            pooled, write, conv_update(pooled, write, mixed.clone(), w), rows, w, out
        )

    return partial(out_of_place_decode, pooled, read, write, rows, w), upstream


def prefill_pair(states: tuple, state_ids: torch.Tensor, batch: GDNBatch, w) -> tuple:
    return tuple(
        partial(chunked_prefill, batch.mixed_qkv, s[1], state_ids, batch, w)
        for s in states
    )


def gdn(results: Results, sizes: Sizes, rounds: int) -> None:
    arena, pooled, twin = state_arena(sizes)
    weights = gdn_weights()
    device = pooled[0].device

    def ids(n: int, seed: int) -> torch.Tensor:
        picked = arena.pick(PoolKind.STATE, n, seed=seed)
        return torch.tensor(picked, dtype=torch.int32, device=device)

    for n in sizes.gdn_batches:
        args = ((pooled, twin), ids(n, seed=n), decode_batch(n), weights)
        shape = f"batch {n}, one layer"
        for name, pair in (
            (f"causal_conv1d_update (batch {n})", conv_pair),
            (f"GDN packed recurrent decode (batch {n})", decode_pair),
        ):
            results.measure(
                name, partial(timed, partial(pair, *args), rounds, shape), 10
            )
        results.measure(
            f"GDN decode of {n // 2}, overlay's out-of-place / upstream's packed path",
            partial(
                timed,
                partial(decode_paths_pair, *args),
                rounds,
                f"batch {n // 2}, one layer, both on pooled views",
            ),
            10,
        )
    requests, tokens = sizes.prefill
    batch = GDNBatch(lens=[tokens] * requests, has_initial_state=[True] * requests)
    args = ((pooled, twin), ids(requests, seed=7), batch, weights)
    results.measure(
        f"GDN chunked prefill ({requests} x {tokens} tokens, states gathered)",
        partial(timed, partial(prefill_pair, *args), rounds, "one layer"),
        30,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=600)
    args = parser.parse_args(argv)
    sizes = DEVICE_SIZES if on_gpu() else CPU_SIZES
    rounds = ROUNDS if on_gpu() else 1
    results = Results(args.budget - 10)
    with ExitStack() as stack:
        stack.enter_context(interpreter_fixes())
        stack.enter_context(worker_workspace())
        attention(results, sizes, rounds)
        gdn(results, sizes, rounds)
    write_json(
        args.out,
        {
            "kernels": KERNELS,
            "environment": environment(),
            "sizes": sizes.__dict__,
            "ok": results.ok,
            "timings": results.entries,
        },
    )
    return 0 if results.ok else 1


if __name__ == "__main__":
    sys.exit(main())
