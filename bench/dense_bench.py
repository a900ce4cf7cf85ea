"""The dense layers of a real small-model shape, alone: how fast their GEMMs run at a decode step's
row counts, on the native packed path against oneDNN's, side by side in one run.

Why: on CPU a decode step of a 30-layer model multiplies a few dozen rows by every weight matrix,
so it reads all the weights (SmolLM2-135M in fp32: 425 MB of layers and a 113 MB output layer)
for little arithmetic. Each pass runs the 30 layers' four matrices in order, each a separate copy,
then the output layer: what a forward pass does, every weight coming from DRAM. Both paths are the
worker's ``Linear`` (worker_svc/model/linear.py): "native" is ``kernels/cpu/linear.py`` (what the
worker uses for fp32 where its AVX-512 or AVX2 build loads), "oneDNN" the prepacked oneDNN linear (what it
uses for fp32 elsewhere, for bf16, and without the native library). Passes alternate between the
two, so machine noise hits both alike. GFLOP/s counts 2 x rows x weights; GB/s counts the weight
bytes read once per pass.

    python -m bench.dense_bench [--rows 1,4,8,16,32,64,256] [--threads 2] [--reps 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.layer_ops_bench import small_model_shape
from pagedkv.worker_svc.model.linear import Linear

# The fused QKV, O, fused gate/up and down matrices ([out, in]) of one layer of that shape.
_CFG = small_model_shape(layers=1)
_Q, _KV = _CFG.num_heads * _CFG.head_dim, _CFG.num_kv_heads * _CFG.head_dim
SHAPES = {
    "qkv": (_Q + 2 * _KV, _CFG.hidden_size),
    "o": (_CFG.hidden_size, _Q),
    "gate_up": (2 * _CFG.intermediate_size, _CFG.hidden_size),
    "down": (_CFG.hidden_size, _CFG.intermediate_size),
}
OUTPUT = (_CFG.vocab_size, _CFG.hidden_size)  # the output layer: [vocabulary, hidden]
PATHS = ("native", "oneDNN")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rows", default="1,4,8,16,32,64,256", help="rows per GEMM (a step's tokens), comma-separated"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=OUTPUT[0], help="output layer rows (0: none)")
    ap.add_argument("--reps", type=int, default=8, help="timed passes per cell (median)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(args.layers) for shape in SHAPES.values()]
    if args.vocab:
        shapes.append((args.vocab, OUTPUT[1]))
    matrices = [0.05 * torch.randn(o, i, generator=gen) for o, i in shapes]
    layers = {
        "native": [Linear.build(w, native=True) for w in matrices],
        "oneDNN": [Linear.build(w, native=False) for w in matrices],
    }
    if layers["native"][0].path != "native" or layers["oneDNN"][0].path != "onednn":
        print("# the native library or oneDNN is unavailable here: nothing to compare", file=sys.stderr)
        return 1
    weights = sum(o * i for o, i in shapes)
    print(
        f"# {args.layers} layers x (qkv, o, gate_up, down) of hidden 576 + a {args.vocab}-row output layer, "
        f"fp32, {args.threads} threads, {weights * 4 / 1e6:.0f} MB of weights a pass; "
        f"median of {args.reps} alternating passes"
    )
    print(
        "| rows | native ms | native GFLOP/s | native weight GB/s | oneDNN ms | oneDNN GFLOP/s "
        "| oneDNN weight GB/s | oneDNN / native |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, i, generator=gen) for _, i in shapes]
        for i in range(min(4, len(shapes))):  # the two paths compute the same products
            torch.testing.assert_close(
                layers["native"][i](xs[i]), layers["oneDNN"][i](xs[i]), rtol=1e-4, atol=1e-4
            )
        samples: dict[str, list[float]] = {p: [] for p in PATHS}
        for rep in range(args.reps + 1):
            for path in PATHS:
                start = time.perf_counter()
                for lin, x in zip(layers[path], xs, strict=True):
                    lin(x)
                if rep:  # the first pass of each warms up
                    samples[path].append(time.perf_counter() - start)
        n, o = statistics.median(samples["native"]), statistics.median(samples["oneDNN"])
        flop = 2 * rows * weights
        print(
            f"| {rows} | {n * 1e3:.2f} | {flop / n / 1e9:.0f} | {weights * 4 / n / 1e9:.1f} "
            f"| {o * 1e3:.2f} | {flop / o / 1e9:.0f} | {weights * 4 / o / 1e9:.1f} | {o / n:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
