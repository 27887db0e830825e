"""Decode attention over a TurboQuant KV cache: native kernel vs torch path vs bf16.

Qwen3.5-like shapes, every path in the same process, interleaved, the median
of ``--iters`` (the cases and the bf16 baseline: docs/turboquant.md,
"Benchmark").
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

from vllm_hybrid.ops.turboquant import TQLayout, native, reference

HEAD_DIM, KV_HEADS, Q_HEADS, BLOCK = 256, 2, 16, 16


def _median_ms(fn, iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _case(preset: str, batch: int, context: int, iters: int) -> dict[str, float]:
    layout = TQLayout.from_cache_dtype(preset, HEAD_DIM)
    g = torch.Generator().manual_seed(0)
    per_req = math.ceil(context / BLOCK)
    cache = torch.zeros(
        batch * per_req, BLOCK, KV_HEADS, layout.slot_bytes, dtype=torch.uint8
    )
    table = torch.arange(batch * per_req, dtype=torch.int32).view(batch, per_req)
    k = torch.randn(batch * context, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(batch * context, KV_HEADS, HEAD_DIM, generator=g)
    pos = torch.arange(context)
    slots = torch.cat(
        [table[b, pos // BLOCK].long() * BLOCK + pos % BLOCK for b in range(batch)]
    )
    reference.store(k, v, cache, slots, layout)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=g).bfloat16()
    seq = torch.full((batch,), context, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    k16 = k.view(batch, context, KV_HEADS, HEAD_DIM).transpose(1, 2).bfloat16()
    v16 = v.view(batch, context, KV_HEADS, HEAD_DIM).transpose(1, 2).bfloat16()
    k16, v16 = k16.contiguous(), v16.contiguous()

    def bf16() -> None:
        F.scaled_dot_product_attention(
            q.unsqueeze(2), k16, v16, scale=scale, enable_gqa=True
        )

    def run(impl):
        return lambda: impl.paged_attention(q, cache, table, seq, qsl, scale, layout)

    return {
        "native": _median_ms(run(native), iters),
        "torch": _median_ms(run(reference), iters),
        "bf16_sdpa": _median_ms(bf16, iters),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: keep)")
    ap.add_argument(
        "--presets", nargs="+", default=["turboquant_k8v4", "turboquant_3bit_nc"]
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not native.available():
        raise SystemExit("native kernel not built: run scripts/setup.sh")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load avg {os.getloadavg()[0]:.1f}; context {args.context}, "
        f"head_dim {HEAD_DIM}, KV heads {KV_HEADS}, query heads {Q_HEADS}"
    )
    print(
        f"{'preset':20} {'batch':>5} {'native ms':>10} {'torch ms':>9} "
        f"{'bf16 ms':>8} {'torch/native':>12} {'bf16/native':>11}"
    )
    for preset in args.presets:
        for batch in args.batch:
            t = _case(preset, batch, args.context, args.iters)
            print(
                f"{preset:20} {batch:>5} {t['native']:>10.2f} {t['torch']:>9.2f} "
                f"{t['bf16_sdpa']:>8.2f} {t['torch'] / t['native']:>12.1f} "
                f"{t['bf16_sdpa'] / t['native']:>11.2f}"
            )


if __name__ == "__main__":
    main()
