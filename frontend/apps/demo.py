"""`pagedkv demo`: a realistic workload through `pagedkv serve`, then the figures that matter.

Requests share a few system prompts of very different lengths (so the prefix
cache pays), have lognormal user-turn and output lengths, and some ask for
parallel samples (n = 2, forked and copy-on-write). They are sent over HTTP by
`--concurrency` streaming clients to `pagedkv serve`, whose one engine batches
them all (continuous batching: new requests join while earlier ones decode). A
progress bar shows finished requests; at the end the demo prints throughput,
prefix-cache hit rate, KV utilisation, the memory block sharing saved,
preemptions, and the memory a contiguous per-request reservation would have
needed for the same work. With `--model` naming a real model with a chat template, the prompts are
chat prompts (system prompt + question through the template) and a few greedy question/answer pairs
are printed beside the figures (frontend/apps/demo_text.py).

KV utilisation is the vLLM paper's: token slots holding live tokens / token
slots of the allocated blocks, each physical block counted once (a block shared
by a prefix hit or a fork counts its tokens once too), sampled every engine
iteration from the server's engine. It cannot exceed 100% and is never clamped.
What sharing saves is its own line: block-table entries that point at a block
another entry already counts.

By default it starts the block manager, cache host and worker as local
processes (like `pagedkv up`) on free ports and runs `pagedkv serve` in this
process (so it can sample the engine every iteration), then stops everything;
`--local` runs the whole stack in-process; `--block-manager/--workers` run the
server here against a running stack; `--url` drives a running server (the KV
figures need the engine, so they are left out there).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

from pagedkv import defaults, envs
from pagedkv.frontend.clients.connection import add_connection_args, client_kwargs
from pagedkv.frontend.engine import Engine, GenerationRequest, SamplingOptions
from pagedkv.ports import free_port
from pagedkv.weight_formats import WeightFormat


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
    block_size: int = defaults.BLOCK_SIZE
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
                sampling=SamplingOptions(temperature=0.8, top_p=0.95, seed=i)
                if sampled
                else SamplingOptions(),
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


@dataclass(slots=True)
class _Sampler:
    """Called by the server's engine thread after every iteration (EngineLoop's on_iteration):
    the same per-step figures the engine-driven demo took, from the engine's own block tables."""

    figs: DemoFigures
    utils: list[float]
    shared: list[float]

    def __call__(self, engine: Engine) -> None:
        f = self.figs
        f.block_size = engine.block_size
        running = engine.running_sequences()
        occ = kv_occupancy(running, engine.block_size)
        if occ.physical_blocks:
            self.utils.append(occ.utilisation(engine.block_size))
            self.shared.append(1 - occ.physical_blocks / occ.logical_blocks)
            f.peak_saved_blocks = max(f.peak_saved_blocks, occ.logical_blocks - occ.physical_blocks)
        f.peak_paged_blocks = max(f.peak_paged_blocks, engine.bm.get_stats().num_used_blocks)
        live = {s.request.request_id: s.request for s in running}
        f.peak_contiguous_tokens = max(
            f.peak_contiguous_tokens, sum((len(r.prompt) + r.max_tokens) * r.n for r in live.values())
        )
        f.preempted_recompute = engine.stats.preempted_recompute
        f.preempted_swap = engine.stats.preempted_swap
        f.steps = engine.stats.steps
        f.bm_round_trips = engine.stats.bm_round_trips
        f.worker_steps = engine.stats.worker_steps


def new_sampler(bytes_per_token: int = 0) -> _Sampler:
    return _Sampler(DemoFigures(bytes_per_token=bytes_per_token), [], [])


def _body(model: str, r: GenerationRequest) -> dict[str, object]:
    s = r.sampling
    body: dict[str, object] = {
        "model": model,
        "prompt": r.prompt,
        "max_tokens": r.max_tokens,
        "n": r.n,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if s.seed is not None:
        body["seed"] = s.seed
    return body


def run_workload(
    url: str,
    requests: list[GenerationRequest],
    concurrency: int,
    *,
    api_key: str = "",
    sampler: _Sampler | None = None,
    progress: bool = True,
) -> DemoFigures:
    """``concurrency`` streaming clients send the requests to `pagedkv serve` at ``url`` over HTTP;
    the server batches them all in one engine. ``sampler`` (hooked into that engine) supplies the
    KV figures."""
    import asyncio
    import json

    from tqdm import tqdm

    from pagedkv.frontend.clients.http import get_text, stream_events

    model = json.loads(get_text(url + "/v1/models", api_key=api_key))["data"][0]["id"]
    figs = sampler.figs if sampler is not None else DemoFigures()
    figs.requests = len(requests)
    bar = tqdm(total=len(requests), unit="req", desc="demo", disable=not progress, file=sys.stderr)
    cached = 0

    async def client(queue: asyncio.Queue[GenerationRequest]) -> None:
        nonlocal cached
        while not queue.empty():
            r = queue.get_nowait()
            async for _, ev in stream_events(url + "/v1/completions", _body(model, r), api_key=api_key):
                usage = ev.get("usage")
                if usage:
                    figs.generated_tokens += usage["completion_tokens"]
                    figs.prompt_tokens += usage["prompt_tokens"]
                    cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            bar.update(1)

    async def drive() -> None:
        queue: asyncio.Queue[GenerationRequest] = asyncio.Queue()
        for r in requests:
            queue.put_nowait(r)
        await asyncio.gather(*(client(queue) for _ in range(max(1, concurrency))))

    start = time.perf_counter()
    try:
        asyncio.run(drive())
    finally:
        bar.close()
    figs.wall_s = time.perf_counter() - start
    figs.hit_rate = cached / figs.prompt_tokens if figs.prompt_tokens else 0.0
    if sampler is not None:
        figs.util_mean = sum(sampler.utils) / len(sampler.utils) if sampler.utils else 0.0
        figs.util_min = min(sampler.utils) if sampler.utils else 0.0
        figs.shared_mean = sum(sampler.shared) / len(sampler.shared) if sampler.shared else 0.0
    return figs


def report(f: DemoFigures) -> str:
    paged = f.peak_paged_blocks * f.block_size * f.bytes_per_token
    contiguous = f.peak_contiguous_tokens * f.bytes_per_token
    rows = [
        ("requests", f"{f.requests}"),
        ("prompt tokens / generated tokens", f"{f.prompt_tokens} / {f.generated_tokens}"),
        ("wall time", f"{f.wall_s:.1f} s"),
        ("throughput (generated)", f"{f.generated_tokens / f.wall_s:.1f} tokens/s" if f.wall_s else "-"),
        (
            "throughput (prompt + generated)",
            f"{(f.prompt_tokens + f.generated_tokens) / f.wall_s:.1f} tokens/s" if f.wall_s else "-",
        ),
        ("prefix-cache hit rate (prompt tokens)", f"{f.hit_rate:.1%}"),
        (
            "KV utilisation: live token slots / allocated slots (mean, min)",
            f"{f.util_mean:.1%}, {f.util_min:.1%}",
        ),
        (
            "KV memory saved by block sharing (mean, peak)",
            f"{f.shared_mean:.1%} of block-table entries, peak {f.peak_saved_blocks} blocks "
            f"({f.peak_saved_blocks * f.block_size * f.bytes_per_token / 2**20:.2f} MiB)",
        ),
        ("preemptions (recompute, swap)", f"{f.preempted_recompute}, {f.preempted_swap}"),
        ("peak KV memory, paged", f"{paged / 2**20:.2f} MiB ({f.peak_paged_blocks} blocks)"),
        (
            "peak KV memory, contiguous reservation",
            f"{contiguous / 2**20:.2f} MiB (prompt + max_tokens, per sample)",
        ),
        ("contiguous / paged", f"{contiguous / paged:.2f}x" if paged else "-"),
        ("engine iterations", f"{f.steps}"),
        (
            "block-manager round trips per iteration (Step)",
            f"{f.bm_round_trips / f.steps:.2f} ({f.bm_round_trips} in all)" if f.steps else "-",
        ),
        (
            "worker steps per iteration",
            f"{f.worker_steps / f.steps:.2f} ({f.worker_steps} in all)" if f.steps else "-",
        ),
    ]
    if not f.peak_paged_blocks:  # --url: the server's engine was not sampled
        rows = [
            (
                k,
                v
                if not k.startswith(
                    ("KV", "peak", "contiguous", "preemptions", "engine", "block-manager", "worker steps")
                )
                else "- (needs the engine: run the demo without --url)",
            )
            for k, v in rows
        ]
    width = max(len(k) for k, _ in rows)
    lines = ["", "pagedkv demo results", ""] + [f"  {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedkv demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=16, help="concurrent streaming HTTP clients")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=defaults.DEMO_NUM_GPU_BLOCKS,
        help="when the demo starts the stack [%(default)s]",
    )
    p.add_argument("--num-workers", type=int, default=2, help="with --local: workers in the stack")
    p.add_argument("--max-num-seqs", type=int, default=32, help="the server's engine (not with --url)")
    p.add_argument("--max-batch-tokens", type=int, default=256, help="the server's engine (not with --url)")
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory or GGUF file (default: built-in tiny model); with a tokenizer "
        "and chat template the workload is chat prompts and a few real answers are printed",
    )
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--weight-format",
        choices=get_args(WeightFormat),
        default="auto",
        help="how the stack holds the weights (auto = a GGUF file's own quantization on CPU; "
        "fp32 | bf16 dense; int8 | int4 a Hugging Face directory quantized at load)",
    )
    p.add_argument("--local", action="store_true", help="run the stack and the server in this process")
    p.add_argument("--url", default=None, help="drive a running `pagedkv serve` (no KV figures)")
    p.add_argument(
        "--block-manager",
        default=None,
        help="a running stack without a frontend: run `pagedkv serve` here against this block manager",
    )
    p.add_argument(
        "--workers", default=None, help="with --block-manager: comma-separated worker host:port list"
    )
    p.add_argument(
        "--api-key-file", default="", help="with --url: the server's API key (default: env PAGEDKV_API_KEY)"
    )
    p.add_argument("--vocab-size", type=int, default=128, help="with --url: token ids are drawn below this")
    p.add_argument("--no-progress", action="store_true")
    add_connection_args(p)
    return p


def _bytes_per_token(worker: object) -> int:
    info = worker.get_info()  # type: ignore[attr-defined]
    dtype_bytes = {"float32": 4, "float16": 2, "bfloat16": 2}.get(info.dtype, 4)
    return 2 * info.num_layers * info.num_kv_heads * info.head_dim * dtype_bytes


def _serve_here(
    args: argparse.Namespace, block_manager: str, workers: list[str], conn: dict[str, object]
) -> None:
    """`pagedkv serve` in this process, its engine sampled every iteration, driven over HTTP."""
    from pagedkv.frontend.clients.worker import WorkerClient
    from pagedkv.frontend.serve.server import OpenAIServer
    from pagedkv.frontend.serve.settings import ServeSettings

    with WorkerClient(workers[0], **conn) as w:
        info_vocab, bpt = w.get_info().vocab_size, _bytes_per_token(w)
    sampler = new_sampler(bpt)
    settings = ServeSettings(
        port=0,
        block_manager=block_manager,
        workers=",".join(workers),
        max_num_seqs=args.max_num_seqs,
        max_batch_tokens=args.max_batch_tokens,
        max_waiting=args.requests + 1,
        log_level="warning",
        model=args.model or "",
        tls_ca=str(conn.get("tls_ca", "")),
        tls_client_cert=str(conn.get("tls_cert", "")),
        tls_client_key=str(conn.get("tls_key", "")),
        token=str(conn.get("token", "")),
        allow_insecure=bool(conn.get("allow_insecure", False)),
    )
    with OpenAIServer(settings, on_iteration=sampler) as server:
        text = server.state.limits.text
        if text.has_chat_template:  # a real model: chat prompts, and real answers beside the figures
            from pagedkv.frontend.apps.demo_text import (
                SHOWN_QUESTIONS,
                ask,
                format_answers,
                make_text_workload,
            )

            reqs = make_text_workload(args.requests, text, args.seed)
        else:
            reqs = make_workload(args.requests, info_vocab, args.seed)
        print(
            report(
                run_workload(
                    server.url, reqs, args.concurrency, sampler=sampler, progress=not args.no_progress
                )
            )
        )
        if text.has_chat_template:
            print(format_answers(ask(server.url, SHOWN_QUESTIONS)))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pagedkv.logging_setup import configure_logging

    configure_logging("warning")
    if args.url:
        import pathlib

        key = envs.get_str("PAGEDKV_API_KEY")
        if args.api_key_file:
            key = pathlib.Path(args.api_key_file).read_text().strip()
        reqs = make_workload(args.requests, args.vocab_size, args.seed)
        print(
            report(
                run_workload(
                    args.url.rstrip("/"), reqs, args.concurrency, api_key=key, progress=not args.no_progress
                )
            )
        )
        return 0
    if args.block_manager:
        if not args.workers:
            print("pagedkv demo: --block-manager needs --workers", file=sys.stderr)
            return 2
        _serve_here(args, args.block_manager, [t for t in args.workers.split(",") if t], client_kwargs(args))
        return 0
    if args.local:
        from pagedkv.frontend.launch.config import StackConfig
        from pagedkv.frontend.launch.local_stack import LocalStack

        with LocalStack(
            StackConfig(
                model=args.model,
                num_gpu_blocks=args.num_gpu_blocks,
                num_workers=args.num_workers,
                device=args.device,
                weight_format=args.weight_format,
            )
        ) as stack:
            _serve_here(args, stack.block_manager_target, stack.worker_targets, {})
        return 0

    import tempfile

    from pagedkv.frontend.launch.config import StackConfig
    from pagedkv.frontend.launch.processes import Stack

    log_dir = tempfile.mkdtemp(prefix="pagedkv-demo-logs-")
    opts = StackConfig(
        block_manager_port=free_port(),
        cache_host_port=free_port(),
        worker_port=free_port(),
        num_workers=1,
        num_gpu_blocks=args.num_gpu_blocks,
        num_cpu_blocks=defaults.DEMO_NUM_CPU_BLOCKS,
        model=args.model,
        device=args.device,
        weight_format=args.weight_format,
        log_format="json",
        log_dir=log_dir,
    )
    print(
        f"pagedkv demo: starting the stack (block manager, cache host, worker) as local processes, "
        f"`pagedkv serve` in this process; their logs go to {log_dir}",
        file=sys.stderr,
        flush=True,
    )
    procs = Stack(opts, out=sys.stderr)
    try:
        procs.start()
        workers = [s.address for s in procs.services if s.name.startswith("worker-")]
        _serve_here(args, procs.services[0].address, workers, client_kwargs(args))
    finally:
        leaked = procs.stop()
    if leaked:
        print(f"pagedkv demo: shared memory left behind: {leaked}", file=sys.stderr)
        return 1
    return 0
