"""The dense layers of a real small-model shape, alone: how fast their GEMMs run at a decode step's
row counts, with the weights read from memory as in a real step, and from cache.

Why: on CPU a decode step of a 30-layer model multiplies a few dozen rows by every weight matrix,
so it reads all the weights (SmolLM2-135M in fp32: 425 MB of layers and a 113 MB output layer)
for little arithmetic. This measures where that leaves the GEMMs: "cold" runs the 30 layers'
matrices in order, each a separate copy (what a forward pass does: every weight comes from DRAM),
"hot" runs one layer's matrices 30 times (its weights stay in cache). Both use the worker's
``Linear`` (weights prepacked for oneDNN, worker_svc/model/linear.py). GFLOP/s counts 2 x rows x
weights; GB/s counts the weight bytes read once per layer call.

    python bench/dense_bench.py [--rows 1,8,32,64] [--threads 2] [--reps 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layer_ops_bench import small_model_shape  # noqa: E402  (this folder: the one SmolLM2 shape)

from worker_svc.model.linear import Linear  # noqa: E402

# The fused QKV, O, fused gate/up and down matrices ([out, in]) of one layer of that shape.
_CFG = small_model_shape(layers=1)
_Q, _KV = _CFG.num_heads * _CFG.head_dim, _CFG.num_kv_heads * _CFG.head_dim
SHAPES = {
    "qkv": (_Q + 2 * _KV, _CFG.hidden_size),
    "o": (_CFG.hidden_size, _Q),
    "gate_up": (2 * _CFG.intermediate_size, _CFG.hidden_size),
    "down": (_CFG.hidden_size, _CFG.intermediate_size),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32,64", help="rows per GEMM (a step's tokens), comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=8, help="timed passes per cell (median)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    layers = [
        {name: Linear.build(0.05 * torch.randn(o, i, generator=gen)) for name, (o, i) in SHAPES.items()}
        for _ in range(args.layers)
    ]
    weights = sum(o * i for o, i in SHAPES.values()) * args.layers
    print(
        f"# {args.layers} layers x (qkv, o, gate_up, down) of hidden 576, fp32, {args.threads} threads, "
        f"{weights * 4 / 1e6:.0f} MB of weights a pass; median of {args.reps} passes"
    )
    print("| rows | cold ms | cold GFLOP/s | cold weight GB/s | hot ms | hot GFLOP/s | cold / hot |")
    print("|---|---|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {name: torch.randn(rows, i, generator=gen) for name, (_, i) in SHAPES.items()}

        def cold(xs: dict[str, torch.Tensor] = xs) -> None:
            for layer in layers:
                for name, lin in layer.items():
                    lin(xs[name])

        def hot(xs: dict[str, torch.Tensor] = xs) -> None:
            for _ in layers:
                for name, lin in layers[0].items():
                    lin(xs[name])

        times = {}
        for label, fn in (("cold", cold), ("hot", hot)):
            fn()
            samples = []
            for _ in range(args.reps):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            times[label] = statistics.median(samples)
        flop = 2 * rows * weights
        c, h = times["cold"], times["hot"]
        print(
            f"| {rows} | {c * 1e3:.3f} | {flop / c / 1e9:.0f} | {weights * 4 / c / 1e9:.1f} | {h * 1e3:.3f} "
            f"| {flop / h / 1e9:.0f} | {c / h:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
