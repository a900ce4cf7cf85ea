"""A decode step of a real small-model shape with the fused layer operations and without, side by side.

The model is random weights at SmolLM2-135M's shape (30 layers, hidden 576, 9 query heads over 3
KV heads of 64, intermediate 1536, tied 49,152-row output layer); each step is ``--batch``
sequences decoding one token over ``--ctx`` cached tokens, through the worker's ``ModelRunner`` on
the CPU backend. The two configurations alternate step by step (the machine is noisy), and the
table gives each one's median and best step time over ``--rounds`` steps, and their ratio:

    python -m bench.layer_ops_bench [--batch 32,8] [--ctx 300] [--threads 2] [--rounds 12]

"fused" is what the worker runs (worker_svc/model/layer_ops.py: kernels/cpu/csrc/layer_ops.c);
"torch" is the same forward with the torch composition of RMSNorm, RoPE + KV write and SiLU-mul.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from pagedkv.arith import ceil_div
from pagedkv.kernels.cpu import layer_ops as cpu_layer_ops
from pagedkv.worker_svc.model import layer_ops
from pagedkv.worker_svc.model.config import ModelConfig, RopeConfig
from pagedkv.worker_svc.model.registry import build_model
from pagedkv.worker_svc.model.weights import fuse, random_weights
from pagedkv.worker_svc.model_runner import ModelRunner, SequenceRequest

BLOCK = 16


def small_model_shape(layers: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=49_152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=layers,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope=RopeConfig(theta=100_000.0),
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="32,8", help="decode batch sizes, comma-separated")
    ap.add_argument("--ctx", type=int, default=300, help="cached tokens per sequence")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12, help="steps per configuration and batch size")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args(argv)
    if not cpu_layer_ops.available():
        print("layer_ops_bench: the native kernels are not built here; nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    cfg = small_model_shape(args.layers)
    model = build_model(cfg, fuse(random_weights(cfg, torch.float32, torch.device("cpu")), cfg))
    batches = [int(b) for b in args.batch.split(",")]
    blocks_per_seq = ceil_div(args.ctx + 1, BLOCK)
    cache = torch.randn(cfg.num_layers, 2, max(batches) * blocks_per_seq, BLOCK, 3, 64)
    runner = ModelRunner(model, cache, torch.empty(0), kernel_backend="cpu")
    fused_choice = layer_ops.choose

    def torch_choice(x: torch.Tensor, step: object) -> layer_ops.LayerOps:
        return layer_ops.LayerOps(kernels=None)

    print(
        f"# decode step, {cfg.num_layers} layers x hidden 576, ctx {args.ctx}, {args.threads} threads, "
        f"{args.rounds} steps each, alternating"
    )
    print("| batch | fused median ms | fused best ms | torch median ms | torch best ms | torch / fused |")
    print("|---|---|---|---|---|---|")
    for batch in batches:
        seqs = [
            SequenceRequest(
                seq_id=str(i),
                token_ids=[5 + i],
                block_ids=list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)),
                num_cached_tokens=args.ctx,
            )
            for i in range(batch)
        ]
        times: dict[str, list[float]] = {"fused": [], "torch": []}
        for _ in range(args.rounds + 1):  # the first round warms up and is dropped
            for name, choice in (("fused", fused_choice), ("torch", torch_choice)):
                layer_ops.choose = choice  # type: ignore[assignment]
                start = time.perf_counter()
                runner.step(seqs)
                times[name].append((time.perf_counter() - start) * 1e3)
        layer_ops.choose = fused_choice
        f, t = times["fused"][1:], times["torch"][1:]
        fm, tm = statistics.median(f), statistics.median(t)
        print(f"| {batch} | {fm:.1f} | {min(f):.1f} | {tm:.1f} | {min(t):.1f} | {tm / fm:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
