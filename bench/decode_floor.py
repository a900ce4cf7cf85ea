"""Batch-1 decode time per output token against the weight-read floor, per weight form.

The floor: a decode step of one sequence reads every weight once, so it cannot take less than the
resident weight bytes over the memory's read bandwidth. The bandwidth is measured here, on the
same machine in the same run (the best of ``--reps`` sums over a 512 MiB fp32 buffer, torch's
threads). Each weight form (``--forms``: dense = the file dequantized to fp32, file = its own
quantization) is then timed on the product's model runner: one sequence, a short prompt, then
``--tokens`` decode steps (median step). A third figure, the linear layers alone (every matrix
of the model once at one row, the median of ``--reps`` passes), says how much of a step is the
weight-packed matmuls.

    python -m bench.decode_floor --model FILE.gguf [--forms dense file] [--threads 2]

The development VM's 2 cores are shared with other jobs: compare the rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from worker_svc.model.config import load_model_config
from worker_svc.model.linear import Linear
from worker_svc.model.llama import LlamaModel
from worker_svc.model.weights import load_model
from worker_svc.model_runner import ModelRunner, SequenceRequest

BLOCK = 16


def read_bandwidth(reps: int) -> float:
    """Bytes per second of reading a 512 MiB fp32 buffer (best of ``reps`` sums)."""
    buf = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def decode_ms(model: LlamaModel, tokens: int, prompt_len: int = 32) -> float:
    cfg = model.cfg
    blocks = -(-(prompt_len + tokens + 1) // BLOCK)
    shape = (cfg.num_layers, 2, blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    runner = ModelRunner(model, torch.zeros(shape), torch.zeros((*shape[:2], 1, *shape[3:])))
    table = list(range(blocks))
    prompt = [(7 * i + 3) % cfg.vocab_size for i in range(prompt_len)]
    out = runner.step([SequenceRequest("s", prompt, table, 0)]).outputs[0].token_id
    seq_len, times = prompt_len, []
    for _ in range(tokens):
        t0 = time.perf_counter()
        out = runner.step([SequenceRequest("s", [out], table, seq_len)]).outputs[0].token_id
        times.append(time.perf_counter() - t0)
        seq_len += 1
    return statistics.median(times) * 1e3


def linears_ms(model: LlamaModel, reps: int) -> float:
    layers: list[Linear] = [model.lm_head]
    for layer in model.layers:
        layers += [layer.qkv, layer.o, layer.gate_up, layer.down]
    xs = [
        torch.randn(1, lin.quantized.in_features if lin.quantized else lin.weight.shape[1]) for lin in layers
    ]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for lin, x in zip(layers, xs, strict=True):
            lin(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--forms", nargs="+", default=["dense", "file"])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    cfg = load_model_config(args.model)
    bw = read_bandwidth(args.reps)
    print(f"read bandwidth {bw / 1e9:.1f} GB/s ({args.threads} threads, best of {args.reps})")
    print("| weights | linear path | resident MB | floor ms | decode ms/token | / floor | linears ms |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for form in args.forms:
        model = load_model(args.model, cfg, torch.float32, torch.device("cpu"), held=form)
        assert isinstance(model, LlamaModel)
        floor = model.weight_bytes / bw * 1e3
        step = decode_ms(model, args.tokens)
        lin = linears_ms(model, args.reps)
        print(
            f"| {form} | {model.linear_path} | {model.weight_bytes / 1e6:.1f} | {floor:.2f} | "
            f"{step:.2f} | {step / floor:.1f}x | {lin:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
