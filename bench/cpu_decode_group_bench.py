"""The native CPU decode kernel at GQA group 3 (SmolLM2: 9 query heads over 3 KV heads, its
generic path) against group 4 (a specialised copy), everything else equal.

One decode attention call per layer on the CPU backend with the native kernel (fp32, head_dim
64, 3 KV heads, block 16): median time per call and per query head, measured round-robin.

    python -m bench.cpu_decode_group_bench [--threads 2] [--reps 30] [--seqs 32] [--context 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedkv import kernels
from pagedkv.arith import ceil_div
from pagedkv.kernels.cpu import native as cpu_native

BLOCK, KV_HEADS, HEAD_DIM = 16, 3, 64


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--groups", default="3,4")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_native.available():
        print("the native kernel is not available here (no C compiler)")
        return 1
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = ceil_div(args.context, BLOCK)
    num_blocks = args.seqs * blocks_per_seq
    k = torch.randn((num_blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen)
    v = torch.randn((num_blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(args.seqs, blocks_per_seq)
    lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    groups = [int(g) for g in args.groups.split(",")]
    qs = {g: torch.randn((args.seqs, g * KV_HEADS, HEAD_DIM), generator=gen) for g in groups}
    times: dict[int, list[float]] = {g: [] for g in groups}
    with kernels.use_backend("cpu"):
        for g in groups:  # warm-up (builds the kernel on first use)
            kernels.paged_decode_attention(qs[g], k, v, tables, lens, HEAD_DIM**-0.5)
        for _ in range(args.reps):
            for g in groups:
                t = time.perf_counter()
                kernels.paged_decode_attention(qs[g], k, v, tables, lens, HEAD_DIM**-0.5)
                times[g].append(time.perf_counter() - t)
    print(
        f"{args.seqs} seqs x {args.context} tokens, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, fp32, "
        f"{args.threads} threads, median of {args.reps}"
    )
    print(f"{'group':>5} {'query heads':>11} {'us/call':>9} {'us/query head':>14}")
    for g in groups:
        med = statistics.median(times[g]) * 1e6
        print(f"{g:>5} {g * KV_HEADS:>11} {med:>9.0f} {med / (g * KV_HEADS):>14.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
