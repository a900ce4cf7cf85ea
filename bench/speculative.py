"""Speculative decoding (n-gram prompt lookup) against plain decoding, one request at a time.

Two `pagedkv up --model FILE` stacks as a user starts them (bench/up_stack.py through
bench/vs_llamacpp.py's start_pagedkv): the default one, and the default plus ``--speculative
ngram``; with --llama-server, llama-server on the same file with its defaults and with its n-gram
lookup (``--spec-type ngram-simple``). Every server is up for the whole run and the rounds
alternate between them (this VM's speed drifts). Three workloads, greedy, every answer
--max-tokens long (``ignore_eos``), one request at a time:

- copy-heavy chat: a code file in a chat message and a request to repeat it with one name changed
  (/v1/chat/completions); a model too small to follow the request copies little of it;
- copy-heavy completion: the code file and the start of its copy (/v1/completions), where a small
  model does copy;
- open-ended chat: short questions with nothing to copy.

Reports generated tokens per second of each (median of --runs rounds), the speculative server
over its plain one (the median of the per-round ratios), the acceptance rate and tokens per
verification pass from the speculative stack's /metrics, and whether each pair's answers are
equal (token ids for pagedkv, text for llama-server; greedy: they must be).

With --in-flight 1,2,4,8: instead, the same requests (as many as the largest size, every
workload's prompts in turn) in waves of that many at once, the default stack against one that
speculates at every batch size: where speculation stops paying, the rule
--speculative-max-num-seqs sets.

    python -m bench.speculative [--gguf FILE] [--runs 3] [--max-tokens 160] [--llama-server BIN]
    python -m bench.speculative --in-flight 1,2,4,8 [--runs 3]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from bench import up_stack
from bench.kv_dtype_bench import smollm2_gguf
from bench.vs_llamacpp import Server, find_binary, start_llama, start_pagedkv
from pagedkv.frontend.clients.http import post_json

CODE = '''def merge_intervals(intervals):
    """Merge overlapping intervals and return them sorted by start."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]
'''

COPY_CHAT = [
    "Here is a Python function:\n\n```python\n"
    + CODE
    + "```\n\nRepeat this function exactly, but rename it to combine_ranges. Output only the code.",
    "Here is a Python function:\n\n```python\n"
    + CODE.replace("intervals", "spans")
    + "```\n\nCopy the function again with the variable `merged` renamed to `result`. Only code.",
]

COPY_COMPLETION = [
    "```python\n" + CODE + "```\n\nThe same function, renamed to combine_ranges:\n\n```python\n",
    CODE + "\n\n# The same function again:\n",
]

CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are some good habits for staying healthy while working from home?",
]

# (workload, endpoint, prompts)
WORKLOADS = [
    ("copy-heavy chat", "chat", COPY_CHAT),
    ("copy-heavy completion", "completions", COPY_COMPLETION),
    ("open-ended chat", "chat", CHAT),
]


def ask(url: str, endpoint: str, prompt: str, max_tokens: int) -> tuple[list[int] | str, int, float]:
    """One greedy answer of exactly max_tokens tokens: (its token ids where the server returns
    them, else its text; the generated token count from usage; seconds)."""
    body: dict[str, object] = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body["return_token_ids"] = True
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    t0 = time.perf_counter()
    out = post_json(url + path, body)
    secs = time.perf_counter() - t0
    choice = out["choices"][0]
    ids = choice.get("token_ids")
    answer: list[int] | str
    if ids:
        answer = [int(t) for t in ids]
    else:
        answer = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    return answer, int(out["usage"]["completion_tokens"]), secs


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:  # noqa: S310 - loopback
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def one_round(server: Server, max_tokens: int) -> dict[str, tuple[float, list[list[int] | str]]]:
    """Each workload's generated tokens per second on one server, and its answers."""
    out = {}
    for name, endpoint, prompts in WORKLOADS:
        tokens, secs, answers = 0, 0.0, []
        for p in prompts:
            answer, n, s = ask(server.url, endpoint, p, max_tokens)
            answers.append(answer)
            tokens += n
            secs += s
        out[name] = (tokens / secs, answers)
    return out


def in_flight_rate(server: Server, n: int, total: int, max_tokens: int) -> float:
    """Generated tokens per second of ``total`` requests (every workload's prompts in turn), sent in
    waves of ``n`` at once: the same requests at every ``n``."""
    prompts = [(endpoint, p) for _, endpoint, ps in WORKLOADS for p in ps]
    requests = [prompts[i % len(prompts)] for i in range(total)]
    tokens = 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        for i in range(0, total, n):
            done = pool.map(lambda r: ask(server.url, r[0], r[1], max_tokens), requests[i : i + n])
            tokens += sum(count for _, count, _ in done)
    return tokens / (time.perf_counter() - t0)


def in_flight_table(gguf: pathlib.Path, args: argparse.Namespace, sizes: list[int]) -> None:
    """Where speculation stops paying as the batch grows (the rule ``--speculative-max-num-seqs``
    sets): the default stack against one that speculates at every batch size, rounds alternating."""
    on = ("--speculative", "ngram", "--speculative-max-num-seqs", str(max(sizes)))
    servers: list[Server] = []
    try:
        servers = [start_pagedkv(gguf, args), start_pagedkv(gguf, args, on)]
        for s in servers:
            ask(s.url, "chat", CHAT[0], 8)  # warm up
        rates: dict[tuple[str, int], list[float]] = {}
        for r in range(args.runs):
            for n in sizes:
                for s in servers if r % 2 == 0 else servers[::-1]:
                    rate = in_flight_rate(s, n, max(sizes), args.max_tokens)
                    rates.setdefault((s.name, n), []).append(rate)
                    print(f"# round {r + 1} {n} in flight {s.name}: {rates[s.name, n][-1]:.1f} tok/s",
                          file=sys.stderr, flush=True)  # fmt: skip
    finally:
        for s in servers:
            s.stop()
    plain, spec = (s.name for s in servers)
    print(
        f"{gguf.name}, {max(sizes)} requests (every workload's prompts in turn) in waves of n at once, "
        f"greedy, {args.max_tokens} tokens an answer, median of {args.runs} rounds\n"
    )
    print(f"| in flight | {plain} tok/s | {spec} tok/s | speculative / plain |")
    print("|---:|---:|---:|---:|")
    for n in sizes:
        a, b = rates[plain, n], rates[spec, n]
        ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
        print(f"| {n} | {statistics.median(a):.1f} | {statistics.median(b):.1f} | {ratio:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", help="the GGUF file (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--runs", type=int, default=3, help="rounds, each server in turn")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--llama-server", help="also llama-server, plain and with --spec-type ngram-simple")
    p.add_argument(
        "--in-flight",
        metavar="N,N,...",
        help="instead: these many requests at once, the default stack against one speculating at every size",
    )
    args = p.parse_args(argv)
    gguf = pathlib.Path(args.gguf) if args.gguf else smollm2_gguf()
    if gguf is None or not gguf.is_file():
        print("speculative: no GGUF file", file=sys.stderr)
        return 2
    args.log_dir = pathlib.Path(tempfile.mkdtemp(prefix="pagedkv-speculative-"))
    args.concurrency, args.long_prompts, args.long_tokens = 1, [], 0
    if args.in_flight:
        in_flight_table(gguf, args, [int(n) for n in args.in_flight.split(",")])
        return 0
    # llama-server computes on the cores the default plan computes on
    args.threads = up_stack.compute_threads(up_stack.up_options(str(gguf), []))
    binary = find_binary(args.llama_server, "llama-server") if args.llama_server else None
    if args.llama_server and binary is None:
        print(f"speculative: no llama-server at {args.llama_server}", file=sys.stderr)
        return 2
    # (plain, speculative) pairs
    pairs: list[tuple[Server, Server]] = []
    try:
        pairs.append((start_pagedkv(gguf, args), start_pagedkv(gguf, args, ("--speculative", "ngram"))))
        if binary:
            pairs.append(
                (
                    start_llama(binary, gguf, "llama-server", "Q", args),
                    start_llama(binary, gguf, "llama-server --spec-type ngram-simple", "Q", args,
                                ("--spec-type", "ngram-simple")),
                )
            )  # fmt: skip
        servers = [s for pair in pairs for s in pair]
        for s in servers:
            ask(s.url, "chat", CHAT[0], 8)  # warm up
        runs: dict[str, list[dict[str, tuple[float, list[list[int] | str]]]]] = {s.name: [] for s in servers}
        for r in range(args.runs):
            for s in servers if r % 2 == 0 else servers[::-1]:
                runs[s.name].append(one_round(s, args.max_tokens))
                print(f"# round {r + 1} {s.name}: "
                      + ", ".join(f"{w} {v[0]:.1f} tok/s" for w, v in runs[s.name][-1].items()),
                      file=sys.stderr, flush=True)  # fmt: skip
        spec_metrics = {
            "acceptance": metric(pairs[0][1].url, "pagedkv_spec_decode_acceptance_rate"),
            "tokens/pass": metric(pairs[0][1].url, "pagedkv_spec_decode_tokens_per_pass"),
        }
    finally:
        for pair in pairs:
            for s in pair:
                s.stop()
    print(
        f"{gguf.name}, one request at a time, greedy, {args.max_tokens} tokens an answer, "
        f"median of {args.runs} rounds\n"
    )
    print("| workload | server | plain tok/s | speculative tok/s | speculative / plain | answers equal |")
    print("|---|---|---:|---:|---:|---|")
    for name, _, _ in WORKLOADS:
        for plain, spec in pairs:
            a = [run[name][0] for run in runs[plain.name]]
            b = [run[name][0] for run in runs[spec.name]]
            ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
            same = all(
                pr[name][1] == sr[name][1] for pr, sr in zip(runs[plain.name], runs[spec.name], strict=True)
            )
            print(
                f"| {name} | {plain.name} / {spec.name} | {statistics.median(a):.1f} | "
                f"{statistics.median(b):.1f} | {ratio:.2f}x | {same} |"
            )
    print(
        f"\nacceptance rate {spec_metrics['acceptance']:.2f}, "
        f"{spec_metrics['tokens/pass']:.2f} tokens per verification pass ({pairs[0][1].name}, all workloads)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
