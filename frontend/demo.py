"""`pagedkv demo`: a realistic workload through the whole stack, then the figures that matter.

Requests share a few system prompts of very different lengths (so the prefix
cache pays), have lognormal user-turn and output lengths, and some ask for
parallel samples (n = 2, forked and copy-on-write). Requests arrive over time
while earlier ones decode (continuous batching). A progress bar shows finished
requests; at the end the demo prints throughput, prefix-cache hit rate, KV
utilisation (tokens held / token slots allocated, sampled every step),
preemptions, and the memory a contiguous per-request reservation would have
needed for the same work.

KV utilisation is the vLLM paper's: token slots holding live tokens / token
slots of the allocated blocks, each physical block counted once (a block shared
by a prefix hit or a fork counts its tokens once too), sampled every step. It
cannot exceed 100% and is never clamped. What sharing saves is its own line:
block-table entries that point at a block another entry already counts.

By default it starts its own stack as local processes (like `pagedkv up`) on
free ports and stops it afterwards; `--local` runs the stack in-process,
`--block-manager/--workers` use a running one.
"""

from __future__ import annotations

import argparse
import math
import random
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from frontend.connection import add_connection_args, client_kwargs
from frontend.engine import Engine, EngineConfig, GenerationRequest, SamplingOptions


@dataclass(slots=True)
class DemoFigures:
    requests: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    wall_s: float = 0.0
    hit_rate: float = 0.0
    util_mean: float = 0.0
    util_min: float = 1.0
    shared_mean: float = 0.0  # share of block-table entries served by an already-counted block
    peak_saved_blocks: int = 0  # most blocks sharing saved at one step
    preempted_recompute: int = 0
    preempted_swap: int = 0
    peak_paged_blocks: int = 0
    peak_contiguous_tokens: int = 0
    bytes_per_token: int = 0
    block_size: int = 16
    steps: int = 0  # engine iterations
    bm_round_trips: int = 0  # the engine's block-manager Steps (the demo's own GetStats not counted)
    worker_steps: int = 0


def make_workload(num_requests: int, vocab: int, seed: int) -> list[GenerationRequest]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1, vocab) for _ in range(n)] for n in (24, 72, 160, 280)]
    popularity = [8, 4, 2, 1]  # the short prompt is the popular one
    reqs = []
    for i in range(num_requests):
        system = rng.choices(systems, weights=popularity)[0]
        user = max(4, min(160, int(rng.lognormvariate(math.log(32), 0.6))))
        out = max(4, min(96, int(rng.lognormvariate(math.log(28), 0.5))))
        sampled = rng.random() < 0.3
        reqs.append(
            GenerationRequest(
                f"demo-{i}",
                system + [rng.randrange(1, vocab) for _ in range(user)],
                max_tokens=out,
                n=2 if rng.random() < 0.25 else 1,
                sampling=SamplingOptions(temperature=0.8, top_p=0.95, seed=i) if sampled else SamplingOptions(),
            )
        )
    return reqs


@dataclass(slots=True, frozen=True)
class KvOccupancy:
    """One moment of the KV cache, from the sequences' block tables."""

    live_tokens: int  # slots holding a token, each physical block counted once
    physical_blocks: int  # distinct blocks allocated
    logical_blocks: int  # block-table entries summed over sequences (what no sharing would need)

    def utilisation(self, block_size: int) -> float:
        return self.live_tokens / (self.physical_blocks * block_size) if self.physical_blocks else 0.0


def kv_occupancy(seqs: Sequence[object], block_size: int) -> KvOccupancy:
    """Token slots in use per physical block: a sequence fills its i-th block with
    min(block_size, tokens - i * block_size) tokens; a block in several tables is counted once
    (its sharers hold the same tokens there). The last sampled token of a sequence has no slot
    until the next step reserves it (``needs_slot``), nor has a finished sequence's."""
    fill: dict[int, int] = {}
    logical = 0
    for s in seqs:
        tokens = len(s.tokens) - (1 if s.needs_slot or s.status.value == "finished" else 0)  # type: ignore[attr-defined]
        table = s.block_table  # type: ignore[attr-defined]
        logical += len(table)
        for i, block in enumerate(table):
            n = max(0, min(block_size, tokens - i * block_size))
            if n > fill.get(block, -1):
                fill[block] = n
    return KvOccupancy(live_tokens=sum(fill.values()), physical_blocks=len(fill), logical_blocks=logical)


def run_workload(engine: Engine, requests: list[GenerationRequest], arrivals_per_step: int,
                 progress: bool = True) -> DemoFigures:
    from tqdm import tqdm

    figs = DemoFigures(requests=len(requests), block_size=engine.block_size)
    info = engine.workers[0].get_info()
    dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(info.dtype, 4)
    figs.bytes_per_token = 2 * info.num_layers * info.num_kv_heads * info.head_dim * dtype_bytes
    pending = list(requests)
    utils: list[float] = []
    shared: list[float] = []
    bar = tqdm(total=len(requests), unit="req", desc="demo", disable=not progress, file=sys.stderr)
    finished = 0
    start = time.perf_counter()
    while pending or engine.has_work():
        for _ in range(min(arrivals_per_step, len(pending))):
            engine.add_request(pending.pop(0))
        engine.step()
        stats = engine.bm.get_stats()
        running = engine.running_sequences()
        occ = kv_occupancy(running, engine.block_size)
        if occ.physical_blocks:
            utils.append(occ.utilisation(engine.block_size))
            shared.append(1 - occ.physical_blocks / occ.logical_blocks)
            figs.peak_saved_blocks = max(figs.peak_saved_blocks, occ.logical_blocks - occ.physical_blocks)
        figs.peak_paged_blocks = max(figs.peak_paged_blocks, stats.num_used_blocks)
        live_requests = {s.request.request_id: s.request for s in running}
        reserve = sum((len(r.prompt) + r.max_tokens) * r.n for r in live_requests.values())
        figs.peak_contiguous_tokens = max(figs.peak_contiguous_tokens, reserve)
        done = sum(1 for o in engine.outputs.values() if o.finished)
        if done > finished:
            bar.update(done - finished)
            finished = done
    figs.wall_s = time.perf_counter() - start
    bar.close()
    stats = engine.bm.get_stats()
    figs.hit_rate = stats.prefix_hit_tokens / stats.prefix_query_tokens if stats.prefix_query_tokens else 0.0
    figs.generated_tokens = engine.stats.generated_tokens
    figs.prompt_tokens = engine.stats.prompt_tokens
    figs.util_mean = sum(utils) / len(utils) if utils else 0.0
    figs.util_min = min(utils) if utils else 0.0
    figs.shared_mean = sum(shared) / len(shared) if shared else 0.0
    figs.preempted_recompute = engine.stats.preempted_recompute
    figs.preempted_swap = engine.stats.preempted_swap
    figs.steps = engine.stats.steps
    figs.bm_round_trips = engine.stats.bm_round_trips
    figs.worker_steps = engine.stats.worker_steps
    return figs


def report(f: DemoFigures) -> str:
    paged = f.peak_paged_blocks * f.block_size * f.bytes_per_token
    contiguous = f.peak_contiguous_tokens * f.bytes_per_token
    rows = [
        ("requests", f"{f.requests}"),
        ("prompt tokens / generated tokens", f"{f.prompt_tokens} / {f.generated_tokens}"),
        ("wall time", f"{f.wall_s:.1f} s"),
        ("throughput (generated)", f"{f.generated_tokens / f.wall_s:.1f} tokens/s" if f.wall_s else "-"),
        ("throughput (prompt + generated)",
         f"{(f.prompt_tokens + f.generated_tokens) / f.wall_s:.1f} tokens/s" if f.wall_s else "-"),
        ("prefix-cache hit rate (prompt tokens)", f"{f.hit_rate:.1%}"),
        ("KV utilisation: live token slots / allocated slots (mean, min)", f"{f.util_mean:.1%}, {f.util_min:.1%}"),
        ("KV memory saved by block sharing (mean, peak)",
         f"{f.shared_mean:.1%} of block-table entries, peak {f.peak_saved_blocks} blocks "
         f"({f.peak_saved_blocks * f.block_size * f.bytes_per_token / 2**20:.2f} MiB)"),
        ("preemptions (recompute, swap)", f"{f.preempted_recompute}, {f.preempted_swap}"),
        ("peak KV memory, paged", f"{paged / 2**20:.2f} MiB ({f.peak_paged_blocks} blocks)"),
        ("peak KV memory, contiguous reservation", f"{contiguous / 2**20:.2f} MiB (prompt + max_tokens, per sample)"),
        ("contiguous / paged", f"{contiguous / paged:.2f}x" if paged else "-"),
        ("engine iterations", f"{f.steps}"),
        ("block-manager round trips per iteration (Step)",
         f"{f.bm_round_trips / f.steps:.2f} ({f.bm_round_trips} in all)" if f.steps else "-"),
        ("worker steps per iteration", f"{f.worker_steps / f.steps:.2f} ({f.worker_steps} in all)" if f.steps else "-"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["", "pagedkv demo results", ""] + [f"  {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedkv demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--arrivals-per-step", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-gpu-blocks", type=int, default=256, help="when the demo starts the stack")
    p.add_argument("--num-workers", type=int, default=2, help="with --local: workers in the stack")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-batch-tokens", type=int, default=256)
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: built-in tiny model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--local", action="store_true", help="run the stack in this process")
    p.add_argument("--block-manager", default=None, help="use a running stack: block manager host:port")
    p.add_argument("--workers", default=None, help="with --block-manager: comma-separated worker host:port list")
    p.add_argument("--no-progress", action="store_true")
    add_connection_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pagedkv.logging_setup import configure_logging

    configure_logging("warning")
    engine_cfg = EngineConfig(max_num_seqs=args.max_num_seqs, max_batch_tokens=args.max_batch_tokens)
    progress = not args.no_progress

    def run(engine: Engine) -> None:
        reqs = make_workload(args.requests, engine.vocab_size, args.seed)
        print(report(run_workload(engine, reqs, args.arrivals_per_step, progress)))

    if args.block_manager:
        from frontend.client import BlockManagerClient
        from frontend.worker_client import WorkerClient

        if not args.workers:
            print("pagedkv demo: --block-manager needs --workers", file=sys.stderr)
            return 2
        conn = client_kwargs(args)
        with BlockManagerClient(args.block_manager, **conn) as bm:
            run(Engine(bm, [WorkerClient(t, **conn) for t in args.workers.split(",")], engine_cfg))
        return 0
    if args.local:
        from frontend.local_stack import LocalStack, StackConfig

        with LocalStack(StackConfig(model=args.model, num_gpu_blocks=args.num_gpu_blocks,
                                    num_workers=args.num_workers, device=args.device)) as stack:
            run(stack.engine(engine_cfg))
        return 0

    from frontend.client import BlockManagerClient
    from frontend.stack import Stack, StackOptions
    from frontend.worker_client import WorkerClient

    import tempfile

    log_dir = tempfile.mkdtemp(prefix="pagedkv-demo-logs-")
    opts = StackOptions(
        block_manager_port=_free_port(), cache_host_port=_free_port(), worker_port=_free_port(),
        num_workers=1, num_gpu_blocks=args.num_gpu_blocks, model=args.model, device=args.device,
        log_format="json", log_dir=log_dir,
    )
    print(f"pagedkv demo: starting the stack (block manager, cache host, worker) as local processes; "
          f"their logs go to {log_dir}", file=sys.stderr, flush=True)
    stack = Stack(opts, out=sys.stderr)
    try:
        stack.start()
        with BlockManagerClient(stack.services[0].address) as bm:
            workers = [WorkerClient(s.address) for s in stack.services[2:]]
            run(Engine(bm, workers, engine_cfg))
    finally:
        leaked = stack.stop()
    if leaked:
        print(f"pagedkv demo: shared memory left behind: {leaked}", file=sys.stderr)
        return 1
    return 0
