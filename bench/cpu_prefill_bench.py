"""CPU prefill attention: the native prefill kernel against the two paths it replaced for fp32.

``kernels/cpu/attention.py`` sends a prefill step's attention (each sequence's new rows against its cached
keys and values, causally) to one of three paths:

- ``prefill kernel``: ``kernels/cpu/csrc/paged_prefill.c`` (what fp32 with head_dim a multiple of 16
  runs now): 16 or 32 rows of a sequence per task, both products register-tiled;
- ``per-row decode``: the decode kernel with every query row a decode query of its own over its
  causal prefix (what fp32 ran before, and what bf16 still runs);
- ``buckets``: gathered blocks and torch's fused SDPA (without the native library).

Each row of the table is one prefill step's attention over ``--layers`` layers (plan included),
measured round-robin in one run so machine noise hits the three alike; outputs are checked equal
first. Shapes: chunks after a cached prompt the way the chat and prefix workloads of
``bench/vs_vllm.py`` send them, and a whole 512-token prompt.

    python -m bench.cpu_prefill_bench [--threads 2] [--reps 7] [--layers 4] [--long]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedkv.arith import ceil_div
from pagedkv.kernels.cpu import attention as cpu
from pagedkv.kernels.cpu import native as cpu_native

BLOCK = 16


@dataclass(frozen=True, slots=True)
class Shape:
    """``seqs`` sequences, each ``rows`` new rows after ``cached`` tokens; every fourth sequence
    shares its cached blocks (a prefix hit)."""

    heads: int
    kv_heads: int
    head_dim: int
    seqs: int
    rows: int
    cached: int


SHAPES = [
    Shape(8, 2, 64, 20, 24, 440),  # workload P: the rows after its prefixes' cached blocks (model A)
    Shape(9, 3, 64, 10, 48, 200),  # workload R: the user part after a system prompt (SmolLM2 shape)
    Shape(9, 3, 64, 4, 128, 272),
    Shape(9, 3, 64, 1, 512, 0),  # a whole prompt
    Shape(8, 2, 128, 8, 64, 192),  # model B
]
# --long: contexts of thousands of tokens, where a task's scores no longer fit in a core's cache
LONG_SHAPES = [
    Shape(32, 8, 64, 1, 256, 4000),  # a 1B model's heads, a chunk after a long cached prompt
    Shape(16, 2, 128, 2, 256, 2000),
    Shape(9, 3, 64, 1, 2048, 6144),
]


def build(shape: Shape, layers: int, gen: torch.Generator) -> dict[str, object]:
    ctx = shape.cached + shape.rows
    per_seq = ceil_div(ctx, BLOCK)
    shared = shape.cached // BLOCK
    tables = torch.zeros(shape.seqs, per_seq, dtype=torch.int32)
    nxt = 4 * shared
    for s in range(shape.seqs):
        tables[s, :shared] = torch.arange(shared) + (s % 4) * shared
        for b in range(shared, per_seq):
            tables[s, b] = nxt
            nxt += 1
    caches = [
        tuple(torch.randn(nxt, BLOCK, shape.kv_heads, shape.head_dim, generator=gen) for _ in range(2))
        for _ in range(layers)
    ]
    return {
        "query": torch.randn(shape.seqs * shape.rows, shape.heads, shape.head_dim, generator=gen),
        "caches": caches,
        "tables": tables,
        "qsl": torch.arange(shape.seqs + 1, dtype=torch.int32) * shape.rows,
        "lens": torch.full((shape.seqs,), ctx, dtype=torch.int32),
    }


def paths(shape: Shape, case: dict[str, object]) -> dict[str, Callable[[], torch.Tensor]]:
    q, caches, tables, qsl, lens = (case[k] for k in ("query", "caches", "tables", "qsl", "lens"))
    assert isinstance(q, torch.Tensor) and isinstance(caches, list)
    assert (
        isinstance(tables, torch.Tensor) and isinstance(qsl, torch.Tensor) and isinstance(lens, torch.Tensor)
    )
    group, scale = shape.heads // shape.kv_heads, shape.head_dim**-0.5

    def kernel() -> torch.Tensor:
        out = torch.empty_like(q)
        for kc, vc in caches:
            cpu_native.prefill(q, kc, vc, tables, qsl, lens, scale, out)
        return out

    def per_row() -> torch.Tensor:
        plan = cpu.plan_prefill(tables, qsl, lens, BLOCK, group)
        assert plan.native_tables is not None and plan.native_lens is not None
        out = torch.empty_like(q)
        for kc, vc in caches:
            cpu_native.decode(q, kc, vc, plan.native_tables, plan.native_lens, scale, out)
        return out

    def buckets() -> torch.Tensor:
        plan = cpu.plan_prefill_buckets(tables, qsl, lens, BLOCK, group)
        out = torch.empty_like(q)
        for kc, vc in caches:
            cpu.paged_prefill_attention(q, kc, vc, tables, qsl, lens, scale, out=out, plan=plan)
        return out

    return {"prefill kernel": kernel, "per-row decode": per_row, "buckets": buckets}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7, help="timed rounds per shape (median)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shapes", type=int, default=None, help="only the first N shapes")
    ap.add_argument("--long", action="store_true", help="the long-context shapes instead")
    args = ap.parse_args(argv)
    if not cpu_native.available():
        print("# the native kernels are not built here: nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(
        f"# {args.layers} layers, fp32, {args.threads} threads, median of {args.reps} round-robin rounds, ms"
    )
    print(
        "| q heads / kv heads x head_dim | sequences x new rows | cached tokens | prefill kernel ms "
        "| per-row decode ms | buckets ms | per-row / kernel | buckets / kernel |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for shape in (LONG_SHAPES if args.long else SHAPES)[: args.shapes]:
        fns = paths(shape, build(shape, args.layers, gen))
        outs = {name: fn() for name, fn in fns.items()}  # also the warm-up
        for name, out in outs.items():
            torch.testing.assert_close(out, outs["prefill kernel"], rtol=1e-4, atol=1e-4, msg=name)
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.reps):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
        k, r, b = ms["prefill kernel"], ms["per-row decode"], ms["buckets"]
        print(
            f"| {shape.heads}/{shape.kv_heads} x {shape.head_dim} | {shape.seqs} x {shape.rows} "
            f"| {shape.cached} | {k:.2f} | {r:.2f} | {b:.2f} | {r / k:.2f}x | {b / k:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
