"""`pagedkv demo`: a realistic workload through the whole stack, then the figures that matter.

Requests share a few system prompts of very different lengths (so the prefix
cache pays), have lognormal user-turn and output lengths, and some ask for
parallel samples (n = 2, forked and copy-on-write). They are sent over HTTP by
`--concurrency` streaming clients to `pagedkv serve`, whose one engine batches
them all (continuous batching: new requests join while earlier ones decode).
A progress bar shows finished requests; at the end the demo prints throughput,
prefix-cache hit rate, KV utilisation (the tokens the running requests hold,
a shared prefix counted once per request, over the block manager's used token
slots, sampled every 50 ms: above 100% when blocks are shared), preemptions, and the memory a contiguous
per-request reservation would have needed for the same work.

By default it starts its own stack with a server as local processes (like
`pagedkv up`) on free ports and stops it afterwards; `--local` runs the stack and
the server in-process, `--url` uses a running server (`--block-manager` for the
KV figures).
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
from frontend.engine import GenerationRequest, SamplingOptions


@dataclass(slots=True)
class DemoFigures:
    requests: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    wall_s: float = 0.0
    hit_rate: float = 0.0
    util_mean: float = 0.0
    util_min: float = 1.0
    preempted_recompute: int = 0
    preempted_swap: int = 0
    peak_paged_blocks: int = 0
    peak_contiguous_tokens: int = 0
    bytes_per_token: int = 0
    block_size: int = 16


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


@dataclass(slots=True)
class _Flight:
    """A request in flight, as the demo's client sees it."""

    prompt_len: int
    max_tokens: int
    n: int
    generated: int = 0


def _body(model: str, r: GenerationRequest) -> dict[str, object]:
    s = r.sampling
    body: dict[str, object] = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens, "n": r.n,
                               "temperature": s.temperature, "top_p": s.top_p, "ignore_eos": True,
                               "stream_options": {"include_usage": True}}
    if s.seed is not None:
        body["seed"] = s.seed
    return body


def run_workload(url: str, requests: list[GenerationRequest], concurrency: int, *, api_key: str = "",
                 block_manager: object | None = None, bytes_per_token: int = 0, progress: bool = True) -> DemoFigures:
    """``concurrency`` streaming clients send the requests to `pagedkv serve` at ``url`` over HTTP
    (the server batches them all in one engine); with the stack's ``block_manager`` client the pool
    is sampled every 50 ms for the KV figures."""
    import asyncio
    import threading

    from tqdm import tqdm

    from frontend.http_client import get_text, stream_events

    model = __import__("json").loads(get_text(url + "/v1/models", api_key=api_key))["data"][0]["id"]
    figs = DemoFigures(requests=len(requests), bytes_per_token=bytes_per_token)
    flights: dict[str, _Flight] = {}
    utils: list[float] = []
    stop = threading.Event()
    stats0 = block_manager.get_stats() if block_manager is not None else None  # type: ignore[attr-defined]

    def sample_pool() -> None:
        while not stop.wait(0.05):
            st = block_manager.get_stats()  # type: ignore[attr-defined]
            live = list(flights.values())
            # Client-side view: requests that streamed a token hold their prompt and what they generated
            # (minus each sample's last token, whose KV the next iteration writes); queued ones hold nothing.
            started = [f for f in live if f.generated]
            held = sum(f.prompt_len + f.generated - f.n for f in started)
            slots = st.num_used_blocks * st.block_size
            if slots and started:
                utils.append(held / slots)
            figs.block_size = st.block_size
            figs.peak_paged_blocks = max(figs.peak_paged_blocks, st.num_used_blocks)
            figs.peak_contiguous_tokens = max(figs.peak_contiguous_tokens,
                                              sum((f.prompt_len + f.max_tokens) * f.n for f in live))

    bar = tqdm(total=len(requests), unit="req", desc="demo", disable=not progress, file=sys.stderr)
    cached = 0

    async def client(queue: asyncio.Queue[GenerationRequest]) -> None:
        nonlocal cached
        while not queue.empty():
            r = queue.get_nowait()
            flights[r.request_id] = f = _Flight(len(r.prompt), r.max_tokens, r.n)
            async for _, ev in stream_events(url + "/v1/completions", _body(model, r), api_key=api_key):
                for ch in ev.get("choices", []):
                    f.generated += len(ch.get("token_ids") or [])
                usage = ev.get("usage")
                if usage:
                    figs.generated_tokens += usage["completion_tokens"]
                    figs.prompt_tokens += usage["prompt_tokens"]
                    cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            del flights[r.request_id]
            bar.update(1)

    async def drive() -> None:
        queue: asyncio.Queue[GenerationRequest] = asyncio.Queue()
        for r in requests:
            queue.put_nowait(r)
        await asyncio.gather(*(client(queue) for _ in range(max(1, concurrency))))

    sampler = threading.Thread(target=sample_pool, daemon=True) if block_manager is not None else None
    start = time.perf_counter()
    if sampler:
        sampler.start()
    try:
        asyncio.run(drive())
    finally:
        stop.set()
        if sampler:
            sampler.join()
        bar.close()
    figs.wall_s = time.perf_counter() - start
    figs.hit_rate = cached / figs.prompt_tokens if figs.prompt_tokens else 0.0
    figs.util_mean = sum(utils) / len(utils) if utils else 0.0
    figs.util_min = min(utils) if utils else 0.0
    if stats0 is not None:
        st = block_manager.get_stats()  # type: ignore[attr-defined]
        figs.preempted_recompute = st.num_preemptions_recompute - stats0.num_preemptions_recompute
        figs.preempted_swap = st.num_preemptions_swap - stats0.num_preemptions_swap
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
        ("KV utilisation: logical tokens / slots (mean, min; > 100% = shared blocks)",
         f"{f.util_mean:.1%}, {f.util_min:.1%}"),
        ("preemptions (recompute, swap)", f"{f.preempted_recompute}, {f.preempted_swap}"),
        ("peak KV memory, paged", f"{paged / 2**20:.2f} MiB ({f.peak_paged_blocks} blocks)"),
        ("peak KV memory, contiguous reservation", f"{contiguous / 2**20:.2f} MiB (prompt + max_tokens, per sample)"),
        ("contiguous / paged", f"{f.peak_contiguous_tokens / (f.peak_paged_blocks * f.block_size):.2f}x"
         if f.peak_paged_blocks else "-"),
    ]
    if not f.peak_paged_blocks:  # --url without --block-manager: the pool was not sampled
        rows = [(k, v if not k.startswith(("KV", "peak", "contiguous", "preemptions")) else "- (needs --block-manager)")
                for k, v in rows]
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
    p.add_argument("--concurrency", type=int, default=16, help="concurrent streaming HTTP clients")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-gpu-blocks", type=int, default=256, help="when the demo starts the stack")
    p.add_argument("--num-workers", type=int, default=2, help="with --local: workers in the stack")
    p.add_argument("--max-num-seqs", type=int, default=32, help="when the demo starts the stack")
    p.add_argument("--max-batch-tokens", type=int, default=256, help="when the demo starts the stack")
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: built-in tiny model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--local", action="store_true", help="run the stack and the server in this process")
    p.add_argument("--url", default=None, help="use a running `pagedkv serve` instead of starting a stack")
    p.add_argument("--api-key-file", default="", help="with --url: the server's API key (default: env PAGEDKV_API_KEY)")
    p.add_argument("--block-manager", default=None, help="with --url: the stack's block manager, for the KV figures")
    p.add_argument("--workers", default=None, help="with --url: a worker host:port, for bytes per token")
    p.add_argument("--no-progress", action="store_true")
    add_connection_args(p)
    return p


def _bytes_per_token(worker: object) -> int:
    info = worker.get_info()  # type: ignore[attr-defined]
    dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(info.dtype, 4)
    return 2 * info.num_layers * info.num_kv_heads * info.head_dim * dtype_bytes


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pagedkv.logging_setup import configure_logging

    configure_logging("warning")
    progress = not args.no_progress
    from frontend.client import BlockManagerClient
    from frontend.worker_client import WorkerClient

    def run(url: str, bm: BlockManagerClient | None, worker: WorkerClient | None, api_key: str = "") -> None:
        vocab = worker.get_info().vocab_size if worker is not None else 128  # type: ignore[union-attr]
        reqs = make_workload(args.requests, vocab, args.seed)
        bpt = _bytes_per_token(worker) if worker is not None else 0
        print(report(run_workload(url, reqs, args.concurrency, api_key=api_key, block_manager=bm,
                                  bytes_per_token=bpt, progress=progress)))

    if args.url:
        import os
        import pathlib

        key = os.environ.get("PAGEDKV_API_KEY", "")
        if args.api_key_file:
            key = pathlib.Path(args.api_key_file).read_text().strip()
        conn = client_kwargs(args)
        bm = BlockManagerClient(args.block_manager, **conn) if args.block_manager else None
        worker = WorkerClient(args.workers.split(",")[0], **conn) if args.workers else None
        try:
            run(args.url.rstrip("/"), bm, worker, key)
        finally:
            for c in (bm, worker):
                if c is not None:
                    c.close()
        return 0
    if args.local:
        from frontend.local_stack import LocalStack, StackConfig
        from frontend.serve import RunningServe
        from frontend.serve_settings import ServeSettings

        with LocalStack(StackConfig(model=args.model, num_gpu_blocks=args.num_gpu_blocks,
                                    num_workers=args.num_workers, device=args.device)) as stack:
            settings = ServeSettings(port=0, block_manager=stack.block_manager_target,
                                     workers=",".join(stack.worker_targets), max_num_seqs=args.max_num_seqs,
                                     max_batch_tokens=args.max_batch_tokens, max_waiting=args.requests + 1,
                                     log_level="warning")
            with RunningServe(settings) as server, BlockManagerClient(stack.block_manager_target) as bm, \
                    WorkerClient(stack.worker_targets[0]) as worker:
                run(server.url, bm, worker)
        return 0

    from frontend.stack import Stack, StackOptions

    import tempfile

    log_dir = tempfile.mkdtemp(prefix="pagedkv-demo-logs-")
    opts = StackOptions(
        block_manager_port=_free_port(), cache_host_port=_free_port(), worker_port=_free_port(),
        num_workers=1, num_gpu_blocks=args.num_gpu_blocks, model=args.model, device=args.device,
        log_format="json", log_dir=log_dir, serve_port=_free_port(),
    )
    stack = Stack(opts, out=sys.stderr)
    frontend = next(s for s in stack.services if s.name == "frontend")
    frontend.args += ["--max-num-seqs", str(args.max_num_seqs), "--max-batch-tokens", str(args.max_batch_tokens),
                      "--max-waiting", str(args.requests + 1)]
    print(f"pagedkv demo: starting the stack (block manager, cache host, worker, pagedkv serve) as local "
          f"processes; their logs go to {log_dir}", file=sys.stderr, flush=True)
    try:
        stack.start()
        workers = [s for s in stack.services if s.name.startswith("worker-")]
        with BlockManagerClient(stack.services[0].address) as bm, WorkerClient(workers[0].address) as worker:
            run(frontend.health_url.removesuffix("/health"), bm, worker)
    finally:
        leaked = stack.stop()
    if leaked:
        print(f"pagedkv demo: shared memory left behind: {leaked}", file=sys.stderr)
        return 1
    return 0
