"""`pagedkv serve` under load over HTTP, against transformers' static batching on the same requests.

Modelled on vLLM's benchmarks/benchmark_serving.py: requests share a few system prompts (so the
prefix cache can pay), user-turn and output lengths are lognormal, and requests arrive as a Poisson
process at several rates (``inf`` = all at once: the offline throughput run), plus a
max-concurrency mode (all queued, at most C in flight). Every request streams (SSE) and asks for
exactly its output length (``ignore_eos``), so both sides produce the same tokens. Per run:
request throughput, output tokens/s, TTFT, TPOT (per request: (e2e - TTFT) / (tokens - 1)) and
inter-token latency (every gap between two streamed tokens) as mean / p50 / p99, and the prefix hit
rate (usage.prompt_tokens_details.cached_tokens / prompt tokens).

Two reference figures in the same run, same model:
- ``prefill alone``: TTFT of single requests (same length distribution, max_tokens 1) sent one at
  a time to the idle server: what the low-rate TTFT p50 is compared with (target <= 1.3x).
- ``transformers static``: `generate()` on the offline run's requests in arrival order, batches of
  ``--baseline-batch-size`` with left padding, each batch running until its longest output; only
  each request's own output tokens count. The offline run's output tokens/s over this row is the
  batching win (target >= 2.5x on CPU with a compute-bound model, e.g. hidden 512, 6 layers).

Runtime libraries: the stack's CPU workers start with tcmalloc and Intel OpenMP preloaded when
present (`pagedkv up` does, pagedkv/cpu_runtime.py), so this script re-runs itself with the same
``LD_PRELOAD`` first: the transformers baseline, in this process, runs on the same libraries.
``--no-preload`` runs both sides without them (the stack is then told not to preload either).

The stack started here is the one ``pagedkv up --model DIR`` starts with no flags, planned from this
machine (bench/up_stack.py adds only ports, logs and a shared-memory prefix); ``--num-gpu-blocks``,
``--max-num-seqs``, ``--max-batch-tokens`` and ``--no-preload`` make it a tuned configuration,
those ``up`` flags, named in the header. The transformers baseline computes with as many threads as
that stack's plan (``--baseline-threads`` to set them).

Each run gets fresh user turns (same system prompts, same distributions), so a later run does not
hit an earlier run's whole prompts in the prefix cache.

    # a random Llama (hidden 512, 6 layers) and the whole comparison, stack started here:
    python -m bench.serve_bench --make-model /tmp/llama512 --hidden 512 --layers 6
    # against a running server (`pagedkv up --model DIR`), same model directory for the baseline:
    python -m bench.serve_bench --url http://127.0.0.1:8000 --model DIR
    # quick check that it runs:
    python -m bench.serve_bench --make-model /tmp/llama-small --hidden 128 --layers 2 --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bench.models import gqa_llama
from bench.transformers_baseline import generate_static_batch
from pagedkv.frontend.clients.http import get_text, stream_events

if TYPE_CHECKING:
    from pagedkv.frontend.launch.processes import Stack


@dataclass(slots=True)
class Req:
    prompt: list[int]
    output_len: int


@dataclass(slots=True)
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class Row:
    name: str
    requests: int
    failed: int
    duration_s: float
    output_tokens: int
    ttft: list[float]
    tpot: list[float]
    itl: list[float]
    hit_rate: float | None

    @property
    def req_per_s(self) -> float:
        return (self.requests - self.failed) / self.duration_s if self.duration_s else 0.0

    @property
    def out_tok_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s else 0.0


def make_model(path: Path, hidden: int, layers: int, vocab: int, seed: int) -> None:
    """A random Llama saved the Hugging Face way (no download)."""
    intermediate = hidden * 8 // 3 // 64 * 64 or hidden * 2
    gqa_llama(
        path,
        vocab=vocab,
        hidden=hidden,
        layers=layers,
        heads=max(1, hidden // 64),
        intermediate=intermediate,
        seed=seed,
    )


class Workload:
    """Shared system prompts + lognormal user turns and outputs (vLLM's "sharegpt-like" shape)."""

    def __init__(self, args: argparse.Namespace, vocab: int) -> None:
        self.args = args
        self.vocab = vocab
        rng = random.Random(args.seed)
        self.systems = [
            [rng.randrange(10, vocab) for _ in range(args.system_len)] for _ in range(args.system_prompts)
        ]

    def _len(self, rng: random.Random, mean: float, lo: int, hi: int) -> int:
        sigma = self.args.sigma
        mu = math.log(mean) - sigma * sigma / 2  # so the mean is `mean`
        return max(lo, min(hi, int(rng.lognormvariate(mu, sigma))))

    def requests(self, n: int, run: int) -> list[Req]:
        a = self.args
        rng = random.Random(a.seed * 1000 + run + 1)
        out = []
        for _ in range(n):
            system = rng.choice(self.systems)
            user = self._len(rng, a.input_len, 4, a.input_len * 4)
            out.append(
                Req(
                    system + [rng.randrange(10, self.vocab) for _ in range(user)],
                    self._len(rng, a.output_len, 2, a.output_len * 4),
                )
            )
        return out


async def one_request(url: str, model: str, req: Req, api_key: str) -> Result:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    res = Result(prompt_tokens=len(req.prompt))
    start = time.perf_counter()
    last = start
    try:
        async for t, ev in stream_events(url + "/v1/completions", body, api_key=api_key):
            if ev.get("usage"):
                res.cached_tokens = int(
                    (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                )
            for ch in ev.get("choices", []):
                n = len(ch.get("token_ids") or [])
                if not n:
                    continue
                if res.output_tokens == 0:
                    res.ttft = t - start
                else:
                    res.itl.append(t - last)
                last = t
                res.output_tokens += n
        res.e2e = last - start
        res.ok = res.output_tokens == req.output_len
        if not res.ok:
            res.error = f"{res.output_tokens} tokens, expected {req.output_len}"
    except Exception as e:  # noqa: BLE001 - one failed request is a row entry, not a crash
        res.error = repr(e)
    return res


async def run_load(
    url: str, model: str, reqs: list[Req], rate: float, concurrency: int, seed: int, api_key: str
) -> tuple[list[Result], float]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency) if concurrency > 0 else None

    async def limited(r: Req) -> Result:
        if sem is None:
            return await one_request(url, model, r, api_key)
        async with sem:
            return await one_request(url, model, r, api_key)

    tasks = []
    start = time.perf_counter()
    for r in reqs:
        tasks.append(asyncio.create_task(limited(r)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def row_from(name: str, results: list[Result], duration: float) -> Row:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    return Row(
        name,
        len(results),
        len(results) - len(ok),
        duration,
        sum(r.output_tokens for r in ok),
        [r.ttft for r in ok],
        [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        [x for r in ok for x in r.itl],
        sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
    )


def transformers_static(model_dir: str, reqs: list[Req], batch_size: int, threads: int = 0) -> Row:
    """Static batching: left-padded batches in arrival order, each run to its longest output."""
    import torch
    from transformers import LlamaForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    useful = 0
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        generate_static_batch(model, [r.prompt for r in batch], max(r.output_len for r in batch))
        useful += sum(r.output_len for r in batch)
    duration = time.perf_counter() - start
    return Row(
        f"transformers static (batch {batch_size}, {torch.get_num_threads()} threads)",
        len(reqs),
        0,
        duration,
        useful,
        [],
        [],
        [],
        None,
    )


def prefill_alone(url: str, model: str, reqs: list[Req], api_key: str) -> list[float]:
    """TTFT of single requests (max_tokens 1), one at a time on the idle server."""
    out = []
    for r in reqs:
        res = asyncio.run(one_request(url, model, Req(r.prompt, 1), api_key))
        if res.ok:
            out.append(res.ttft)
    return out


def _stats(xs: list[float]) -> str:
    if not xs:
        return "-"
    s = sorted(xs)
    p = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return f"{statistics.fmean(s) * 1e3:.0f} / {p(0.5) * 1e3:.0f} / {p(0.99) * 1e3:.0f}"


def table(rows: list[Row], baseline: Row | None, alone: list[float]) -> str:
    head = (
        "run",
        "req",
        "fail",
        "req/s",
        "out tok/s",
        "vs transformers",
        "TTFT ms mean/p50/p99",
        "TPOT ms mean/p50/p99",
        "ITL ms mean/p50/p99",
        "prefix hits",
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows + ([baseline] if baseline else []):
        # Only the offline run has the baseline's very requests (and the baseline row itself: 1.00x).
        same = r is baseline or r.name.startswith("offline")
        ratio = (
            f"{r.out_tok_per_s / baseline.out_tok_per_s:.2f}x"
            if same and baseline and baseline.out_tok_per_s
            else "-"
        )
        lines.append(
            "| "
            + " | ".join(
                [
                    r.name,
                    str(r.requests),
                    str(r.failed),
                    f"{r.req_per_s:.2f}",
                    f"{r.out_tok_per_s:.1f}",
                    ratio,
                    _stats(r.ttft),
                    _stats(r.tpot),
                    _stats(r.itl),
                    "-" if r.hit_rate is None else f"{r.hit_rate:.1%}",
                ]
            )
            + " |"
        )
    if alone:
        lines.append(
            f"\nprefill alone (one request at a time, max_tokens 1): TTFT p50 "
            f"{statistics.median(alone) * 1e3:.0f} ms over {len(alone)} requests"
        )
        low = next((r for r in rows if r.name.startswith("rate")), None)
        if low and low.ttft:
            lines.append(
                f"lowest-rate run ({low.name}): TTFT p50 / prefill alone p50 = "
                f"{statistics.median(low.ttft) / statistics.median(alone):.2f}x (target <= 1.3x)"
            )
    return "\n".join(lines)


def start_stack(model_dir: str, flags: Sequence[str] = ()) -> tuple[Stack, str]:
    """The stack ``pagedkv up --model DIR FLAGS`` starts (no flags: the default, planned from this
    machine; bench/up_stack.py adds only ports, logs and a shared-memory prefix), as local
    processes: (the stack, its front door's URL)."""
    import os

    from bench import up_stack
    from pagedkv.frontend.launch.processes import Stack

    log_dir = tempfile.mkdtemp(prefix="pagedkv-serve-bench-")
    opts = up_stack.up_options(
        model_dir, flags, log_dir=log_dir, shm_prefix=f"pagedkv-serve-bench-{os.getpid()}"
    )
    stack = Stack(opts, out=sys.stderr)
    print(
        f"serve_bench: starting {up_stack.label(flags)}: {up_stack.describe(opts)} (logs in {log_dir})",
        file=sys.stderr,
        flush=True,
    )
    stack.start()
    return stack, f"http://127.0.0.1:{opts.serve_port}"


def stack_flags(args: argparse.Namespace) -> list[str]:
    """The ``pagedkv up`` flags of the stack started here: none (the default) unless a tuned
    configuration was asked for."""
    flags = []
    for name in ("num_gpu_blocks", "max_num_seqs", "max_batch_tokens"):
        if getattr(args, name) is not None:
            flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.no_preload:
        flags.append("--no-preload-runtime")
    return flags


def parse_rates(text: str) -> list[float]:
    return [math.inf if t.strip() in ("inf", "max") else float(t) for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="", help="a running pagedkv serve (default: start a stack here)")
    p.add_argument("--api-key", default="", help="API key of the server (or env PAGEDKV_API_KEY)")
    p.add_argument("--model", default="", help="the served model directory (for the transformers baseline)")
    p.add_argument("--make-model", default="", help="create a random Llama here first (then used as --model)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--num-requests", type=int, default=64, help="requests per run")
    p.add_argument("--rates", default="0.5,2,inf", help="Poisson arrival rates in req/s; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=8, help="the max-concurrency run (0 = skip)")
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-len", type=int, default=96, help="tokens of each shared system prompt")
    p.add_argument("--input-len", type=int, default=64, help="mean user-turn tokens (lognormal)")
    p.add_argument("--output-len", type=int, default=64, help="mean output tokens (lognormal)")
    p.add_argument("--sigma", type=float, default=0.5, help="lognormal sigma of both lengths")
    p.add_argument("--baseline-batch-size", type=int, default=16)
    p.add_argument(
        "--baseline-threads",
        type=int,
        default=0,
        help="torch threads of the transformers baseline (0 = as many as the cores the plan of the "
        "stack started here computes on; against --url, torch's default)",
    )
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument(
        "--no-preload",
        action="store_true",
        help="run the baseline and the stack's workers without tcmalloc / Intel OpenMP preloaded",
    )
    p.add_argument("--alone-requests", type=int, default=8, help="requests for the prefill-alone figure")
    for flag in ("--num-gpu-blocks", "--max-num-seqs", "--max-batch-tokens"):
        p.add_argument(
            flag,
            type=int,
            default=None,
            help=f"when the stack is started here: `pagedkv up {flag} N`, a tuned configuration named in "
            "the header [the default stack: as `pagedkv up` plans it]",
        )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny run: 12 requests, short lengths, rates 2,inf")
    p.add_argument("--json", default="", help="also write the rows as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    import os

    args = build_parser().parse_args(argv)
    if args.quick:
        args.num_requests, args.rates, args.max_concurrency = 12, "2,inf", 4
        args.system_len, args.input_len, args.output_len, args.alone_requests = 32, 16, 12, 3
        args.baseline_batch_size = min(args.baseline_batch_size, 4)
    api_key = args.api_key or os.environ.get("PAGEDKV_API_KEY", "")
    if args.make_model:
        make_model(Path(args.make_model), args.hidden, args.layers, args.vocab, args.seed)
        args.model = args.make_model
    if not args.model:
        print("serve_bench: --model DIR (or --make-model DIR) is needed", file=sys.stderr)
        return 2
    vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    stack = None
    url = args.url.rstrip("/")
    served = f"the server at {url}"
    try:
        if not url:
            from bench import up_stack

            flags = stack_flags(args)
            stack, url = start_stack(args.model, flags)
            served = f"{up_stack.label(flags)}, {up_stack.describe(stack.opts)}"
            if not args.baseline_threads:  # the peer computes on the cores the stack's plan uses
                args.baseline_threads = up_stack.compute_threads(stack.opts)
        models = json.loads(get_text(url + "/v1/models", api_key=api_key))
        model = models["data"][0]["id"]
        wl = Workload(args, vocab)
        # Warm-up (first-call costs), then the shared system prompts are in the prefix cache for every run.
        asyncio.run(run_load(url, model, wl.requests(2, 999), math.inf, 0, 0, api_key))
        alone = prefill_alone(url, model, wl.requests(args.alone_requests, 998), api_key)
        rows: list[Row] = []
        offline: list[Req] = []
        runs = [
            (f"rate {r:g} req/s" if math.isfinite(r) else "offline (all at once)", r, 0)
            for r in sorted(parse_rates(args.rates))
        ]
        if args.max_concurrency > 0:
            runs.append((f"max concurrency {args.max_concurrency}", math.inf, args.max_concurrency))
        for i, (name, rate, conc) in enumerate(runs):
            reqs = wl.requests(args.num_requests, i)
            if not math.isfinite(rate) and conc == 0:
                offline = reqs
            print(f"serve_bench: {name}: {len(reqs)} requests", file=sys.stderr, flush=True)
            results, duration = asyncio.run(run_load(url, model, reqs, rate, conc, args.seed + i, api_key))
            rows.append(row_from(name, results, duration))
            for r in results:
                if not r.ok:
                    print(f"serve_bench: a request failed: {r.error}", file=sys.stderr)
                    break
    finally:
        if stack is not None:
            stack.stop()
    baseline = None
    if not args.no_baseline and offline:
        print(
            "serve_bench: transformers static batching on the offline run's requests",
            file=sys.stderr,
            flush=True,
        )
        baseline = transformers_static(args.model, offline, args.baseline_batch_size, args.baseline_threads)
    print(
        f"\npagedkv serve vs transformers: {args.num_requests} requests per run, {args.system_prompts} "
        "shared "
        f"system prompts of {args.system_len} tokens, user turns ~{args.input_len} and outputs "
        f"~{args.output_len} "
        f"tokens (lognormal, sigma {args.sigma}), model {args.model}; pagedkv: {served}; LD_PRELOAD of "
        "this process (the "
        "baseline's): "
        f"{os.environ.get('LD_PRELOAD') or 'none'}\n"
    )
    print(table(rows, baseline, alone))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    {
                        "name": r.name,
                        "requests": r.requests,
                        "failed": r.failed,
                        "duration_s": r.duration_s,
                        "req_per_s": r.req_per_s,
                        "out_tok_per_s": r.out_tok_per_s,
                        "hit_rate": r.hit_rate,
                        "ttft": r.ttft,
                        "tpot": r.tpot,
                    }
                    for r in rows + ([baseline] if baseline else [])
                ],
                indent=1,
            )
        )
    return 1 if any(r.failed for r in rows) else 0


def _with_runtime_preloads() -> None:
    """Run this script again with the CPU workers' runtime libraries preloaded (see the module
    docstring), unless --no-preload or they are preloaded already."""
    from pagedkv.cpu_runtime import preload_env

    extra = {} if "--no-preload" in sys.argv else preload_env()
    if extra:
        # As a module again (`python -m bench.serve_bench`): run as a file, bench/ would be on the
        # path instead of the repository, and `import bench` would fail.
        os.execve(
            sys.executable,
            [sys.executable, "-m", "bench.serve_bench", *sys.argv[1:]],
            {**os.environ, **extra},
        )


if __name__ == "__main__":
    import os

    _with_runtime_preloads()
    sys.exit(main())
