#!/usr/bin/env python
"""Decode step time, eager vs CUDA graphs, at a few batch sizes side by side.

    python -m bench.cuda_graph_bench [--out DIR] [--batches 1,6,32] [--steps 30]

A Llama-shaped model with random weights (many thin layers: the shape where launch overhead counts)
and one ModelRunner per mode over its own cache, both with the Triton kernels. Each batch size first
prefills its sequences, then times ``--steps`` decode steps (``ModelRunner.step``: batch assembly,
forward, sampling; the tokens reaching the host end each step). A batch size that is not a captured
size (6) replays the next size's graph with padding rows. Prints a markdown table and writes
cuda_graphs.md / cuda_graphs.json under ``--out``, with the share of greedy tokens both modes agree
on (bf16: eager and graphs may split the KV differently, so a near-tie can flip; token equality
itself is asserted in fp32 by tests/worker_svc/model/test_cuda_graphs.py). Exit code 1 when nothing was
measured.

``--device cpu`` (bench/gpu_check.sh --rehearse) runs the same flow with a tiny model; there the
"graphs" column is NOT a CUDA graph: the capture backend replays the padded forward eagerly, so it
only rehearses the script (its label says so).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from collections.abc import Callable

import torch

from pagedkv.arith import ceil_div

BLOCK = 16
GPU_SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_layers=16,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
)
CPU_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)


class EagerReplay:
    """CPU stand-in for ``CudaCapture``: "replay" runs the padded forward again (no graph)."""

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[object, torch.Tensor]:
        out = forward()

        class _Replay:
            def replay(self) -> None:
                out.copy_(forward())

        return _Replay(), out


def run(device: str, batches: list[int], ctx: int, steps: int, deadline_s: float) -> list[dict]:
    from pagedkv.worker_svc.model import cuda_graphs
    from pagedkv.worker_svc.model.config import ModelConfig
    from pagedkv.worker_svc.model.llama import LlamaModel
    from pagedkv.worker_svc.model.weights import random_weights
    from pagedkv.worker_svc.model_runner import ModelRunner, SequenceRequest

    t_start = time.monotonic()
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = ModelConfig(**(GPU_SHAPE if dev.type == "cuda" else CPU_SHAPE), name="graph-bench")  # type: ignore[arg-type]
    model = LlamaModel(cfg, random_weights(cfg, dtype, dev))  # std 0.2: sharp, few greedy near-ties
    blocks_per_seq = ceil_div(ctx + steps + 1, BLOCK)
    num_blocks = max(batches) * blocks_per_seq
    shape = (cfg.num_layers, 2, num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    graphs = cuda_graphs.for_worker(True, max(batches), blocks_per_seq * BLOCK, dev, BLOCK, num_blocks)
    if graphs is None:  # CPU: the same bookkeeping, replayed eagerly
        graphs = cuda_graphs.DecodeGraphs(
            sizes=cuda_graphs.capture_sizes(max(batches)), max_blocks=blocks_per_seq, backend=EagerReplay()
        )
    backend = "triton" if dev.type == "cuda" else None

    def runner(g: cuda_graphs.DecodeGraphs | None) -> ModelRunner:
        gpu = torch.zeros(shape, dtype=dtype, device=dev)
        cpu = torch.zeros((*shape[:2], 0, *shape[3:]), dtype=dtype)
        return ModelRunner(model, gpu, cpu, kernel_backend=backend, decode_graphs=g)

    modes = {"eager": runner(None), "graphs": runner(graphs)}
    rows = []
    for bsz in batches:
        if rows and time.monotonic() - t_start > deadline_s * 0.6:
            print(f"deadline: batch {bsz} and larger not measured", flush=True)
            break
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(bsz)]
        row: dict = {"batch": bsz, "graph_size": cuda_graphs.bucket_for(bsz, graphs.sizes), "context": ctx}
        tokens: dict[str, list[list[int]]] = {}
        for name, r in modes.items():
            prompts = [[(i * 7 + j) % cfg.vocab_size for j in range(ctx)] for i in range(bsz)]
            res = r.step([SequenceRequest(f"s{i}", prompts[i], tables[i], 0) for i in range(bsz)])
            last = [o.token_id for o in res.outputs]
            times, out = [], []
            for k in range(steps):
                reqs = [SequenceRequest(f"s{i}", [last[i]], tables[i], ctx + k) for i in range(bsz)]
                t0 = time.perf_counter()
                res = r.step(reqs)  # ends with the sampled tokens on the host: the step's work is done
                times.append(time.perf_counter() - t0)
                last = [o.token_id for o in res.outputs]
                out.append(last)
            warm = sorted(times[2:]) or sorted(times)  # the first steps compile / capture
            row[f"{name}_ms_p50"] = warm[len(warm) // 2] * 1e3
            tokens[name] = out
        row["speedup"] = row["eager_ms_p50"] / row["graphs_ms_p50"]
        pairs = [
            (a, b)
            for x, y in zip(tokens["eager"], tokens["graphs"], strict=True)
            for a, b in zip(x, y, strict=True)
        ]
        row["token_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
        rows.append(row)
        print(
            f"batch {bsz:3d} (graph {row['graph_size']}): eager {row['eager_ms_p50']:.2f} ms/step, "
            f"graphs {row['graphs_ms_p50']:.2f} ms/step, x{row['speedup']:.2f}, "
            f"token agreement {row['token_agreement']:.3f}",
            flush=True,
        )
    print(f"graph stats: {dict(graphs.stats)}", flush=True)
    return rows


def table(rows: list[dict], device: str, steps: int) -> str:
    cpu = device == "cpu"
    graphs_label = "padded eager replay ms/step (CPU rehearsal, no graph)" if cpu else "graphs ms/step"
    ratio_label = "eager / padded replay" if cpu else "eager / graphs"
    md = [
        f"## decode step time, eager vs CUDA graphs ({device}; p50 of {steps} steps after 2 warm-up, "
        "ModelRunner.step: assembly + forward + sampling)",
        "",
        f"| batch | graph size | context | eager ms/step | {graphs_label} | {ratio_label} "
        "| token agreement |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        md.append(
            f"| {r['batch']} | {r['graph_size']} | {r['context']} | {r['eager_ms_p50']:.2f} | "
            f"{r['graphs_ms_p50']:.2f} | {r['speedup']:.2f} | {r['token_agreement']:.3f} |"
        )
    return "\n".join(md) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,6,32", help="comma-separated decode batch sizes")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per batch size and mode")
    ap.add_argument("--deadline-s", type=float, default=120.0, help="start no batch size after 60%% of this")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="write cuda_graphs.md / .json here")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = run(args.device, batches, args.context, args.steps, args.deadline_s)
    md = table(rows, args.device, args.steps)
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cuda_graphs.md").write_text(md)
        (args.out / "cuda_graphs.json").write_text(json.dumps(rows, indent=1))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
