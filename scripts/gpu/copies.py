"""Part ``copies`` of the device run: align mode's state copies at the
mission's state page, next to the GDN decode step they ride along with.

Qwen3.6-35B-A3B at TP 1 has 30 gated-DeltaNet layers; each keeps per request
a conv state (3, 8192) in bf16 and a recurrent state (32, 128, 128) in the
SSM cache dtype (shapes from upstream's
``MambaStateShapeCalculator.gated_delta_net_state_shape``, checked here). In
float32 that is 30 x (48 KiB + 2 MiB) = 61.41 MiB per request, copied
whenever a request crosses a block edge in align mode. Measured for float32
and bf16 SSM state, on a pooled arena of the mission's layers (10 attention
+ 30 GDN) built by the kernel tier's helpers:

* ``batch_memcpy`` (``do_mamba_copy_block``, the path without speculative
  decoding): kernel time for 1, 64 and 256 requests copied in one step, per
  request, and the bytes moved per second; plus the host time
  ``collect_mamba_copy_meta`` takes to build the copy list;
* ``precopy_mamba_align_fused_kernel`` (the speculative-decoding path) for
  the same requests;
* the GDN decode step's own kernels at batch 64 and 256: for every one of
  the 30 layers ``causal_conv1d_update`` and the packed recurrent decode, in
  place on the same views.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from functools import partial

from tier_env import prepare, write_json

KERNELS = prepare()

import torch  # noqa: E402
from align_copy_ops import Crossing, copy_buffers, spec_decode_context  # noqa: E402
from arena_views import QWEN36_GDN, MiB, attention_spec, build_arena  # noqa: E402
from bench import Results, environment, on_gpu, time_ms  # noqa: E402
from gdn_ops import HV, V, conv_update, decode_batch, gdn_weights, packed_decode  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import (  # noqa: E402
    MambaStateShapeCalculator,
)
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402
from vllm.v1.worker import mamba_utils  # noqa: E402

from vllm_hybrid.v1.core.pooled.spec import PoolKind  # noqa: E402

#: The mission's shapes as the calculator must give them at TP 1.
MISSION_CONV = (3, 8192)
MISSION_SSM = (32, 128, 128)


@dataclass(frozen=True)
class Sizes:
    attention_layers: int
    gdn_layers: int
    copied: tuple[int, ...]
    #: Decode batches the GDN step is timed at.
    batches: tuple[int, ...]


DEVICE_SIZES = Sizes(
    attention_layers=10, gdn_layers=30, copied=(1, 64, 256), batches=(64, 256)
)
CPU_SIZES = Sizes(attention_layers=1, gdn_layers=2, copied=(1, 2), batches=(2,))


def mission_spec(ssm_dtype: torch.dtype) -> MambaSpec:
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(1, **QWEN36_GDN)
    shapes = tuple(tuple(s) for s in shapes)
    if shapes != (MISSION_CONV, MISSION_SSM):
        raise AssertionError(f"GDN state shapes {shapes}, expected the mission's")
    return MambaSpec(
        block_size=16,
        shapes=shapes,
        dtypes=(torch.bfloat16, ssm_dtype),
        mamba_cache_mode="align",
    )


def mission_arena(sizes: Sizes, spec: MambaSpec):
    """A pooled arena holding twice the largest copy's requests (sources and
    destinations), the state pool at its largest."""
    state_block = spec.page_size_bytes * sizes.gdn_layers
    blocks = 2 * max(sizes.copied + sizes.batches) + 8
    arena = build_arena(
        attention_spec(16),
        spec,
        num_token_layers=sizes.attention_layers,
        num_state_layers=sizes.gdn_layers,
        arena_bytes=blocks * state_block + 64 * MiB,
    )
    arena.state_floor = arena.config.layout.min_state_floor
    return arena


def synced_seconds(fn) -> float:
    """Host seconds of ``fn`` including the device work it queued."""
    if on_gpu():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if on_gpu():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def batch_memcpy(arena, sources, targets, request_bytes) -> dict:
    crossings = [
        Crossing(row=(s, t), src_col=0, dst_col=1)
        for s, t in zip(sources, targets, strict=True)
    ]
    holder = {}
    host = synced_seconds(
        lambda: holder.update(bufs=copy_buffers(arena, arena.states, crossings))
    )
    bufs = holder["bufs"]
    ms = time_ms(partial(mamba_utils.do_mamba_copy_block, bufs))
    n = len(crossings)
    return {
        "requests": n,
        "copies": int(bufs.offset),
        "kernel_ms": ms,
        "per_request_ms": ms / n,
        "moved_gb_per_s": 2 * n * request_bytes / (ms * 1e-3) / 1e9,
        "host_collect_ms": host * 1e3,
    }


def fused_precopy(arena, sources, targets, request_bytes) -> dict:
    rows = [(s, t) for s, t in zip(sources, targets, strict=True)]
    n = len(rows)
    ctx, table = spec_decode_context(arena, arena.states, rows)
    device = table.device

    def column(value: int) -> torch.Tensor:
        return torch.full((n,), value, dtype=torch.int32, device=device)

    run = partial(
        ctx.run_fused_precopy,
        num_reqs=n,
        state_idx_gpu=column(1),
        src_col_gpu=column(0),
        token_bias_gpu=column(0),
        idx_mapping=None,
    )
    ms = time_ms(run)
    return {
        "requests": n,
        "kernel_ms": ms,
        "per_request_ms": ms / n,
        "moved_gb_per_s": 2 * n * request_bytes / (ms * 1e-3) / 1e9,
    }


def gdn_step(arena, ids: list[int]) -> dict:
    """Every GDN layer's decode kernels for ``ids`` (one token each)."""
    weights = gdn_weights()
    n = len(ids)
    batch = decode_batch(n)
    state_ids = torch.tensor(ids, dtype=torch.int32, device=batch.a.device)
    mixed = batch.mixed_qkv.clone()
    out = torch.zeros((n, 1, HV, V), dtype=mixed.dtype, device=mixed.device)

    def step() -> None:
        for layer in arena.state_layers:
            states = arena.states[layer]
            conv_update(states, state_ids, mixed, weights)
            packed_decode(states, state_ids, mixed, batch, weights, out)

    ms = time_ms(step)
    return {"batch": n, "layers": len(arena.state_layers), "step_ms": ms}


def measure_dtype(results: Results, sizes: Sizes, ssm_dtype: torch.dtype) -> None:
    label = str(ssm_dtype).removeprefix("torch.")
    spec = mission_spec(ssm_dtype)
    request_bytes = spec.page_size_bytes * sizes.gdn_layers
    results.measure(
        f"{label}: state page",
        lambda: {
            "shapes": spec.shapes,
            "dtypes": [str(d) for d in spec.dtypes],
            "layer_page_bytes": spec.page_size_bytes,
            "request_bytes": request_bytes,
            "request_mib": request_bytes / MiB,
        },
        reserve=5,
    )
    arena = mission_arena(sizes, spec)
    largest = max(sizes.copied + sizes.batches)
    ids = arena.pick(PoolKind.STATE, 2 * largest, seed=5)
    sources, targets = ids[:largest], ids[largest:]
    for n in sizes.copied:
        args = (arena, sources[:n], targets[:n], request_bytes)
        results.measure(f"{label}: batch_memcpy x{n}", partial(batch_memcpy, *args), 10)
        results.measure(
            f"{label}: fused precopy x{n}", partial(fused_precopy, *args), 10
        )
    for n in sizes.batches:
        results.measure(
            f"{label}: GDN decode step, batch {n}",
            partial(gdn_step, arena, sources[:n]),
            15,
        )
    del arena
    if on_gpu():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=float, default=600)
    args = parser.parse_args(argv)
    sizes = DEVICE_SIZES if on_gpu() else CPU_SIZES
    results = Results(args.budget - 5)
    for ssm_dtype in (torch.float32, torch.bfloat16):
        measure_dtype(results, sizes, ssm_dtype)
    write_json(
        args.out,
        {
            "kernels": KERNELS,
            "environment": environment(),
            "sizes": sizes.__dict__,
            "ok": results.ok,
            "copies": results.entries,
        },
    )
    return 0 if results.ok else 1


if __name__ == "__main__":
    sys.exit(main())
