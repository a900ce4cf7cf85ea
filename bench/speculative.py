"""Speculative decoding (n-gram prompt lookup) against plain decoding, one request at a time.

Two `pagedkv up --model FILE` stacks as a user starts them (bench/up_stack.py through
bench/vs_llamacpp.py's start_pagedkv): the default one, and the default plus ``--speculative
ngram``. Two workloads, greedy, sent one at a time through /v1/chat/completions:

- copy-heavy: a code file in the prompt and a request to repeat it with one name changed;
- open-ended chat: short questions with nothing to copy.

Reports generated tokens per second of each (median of --runs passes), the ratio, the acceptance
rate and tokens per verification pass from the speculative stack's /metrics, and whether the two
stacks' answers are equal token for token (they must be: greedy). With --llama-server, the same
prompts (as text) on llama-server beside them.

    python -m bench.speculative [--gguf FILE] [--runs 3] [--max-tokens 160] [--llama-server BIN]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
import urllib.request

from bench.kv_dtype_bench import smollm2_gguf
from bench.vs_llamacpp import Server, find_binary, start_pagedkv
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

COPY = [
    "Here is a Python function:\n\n```python\n"
    + CODE
    + "```\n\nRepeat this function exactly, but rename it to combine_ranges. Output only the code.",
    "Here is a Python function:\n\n```python\n"
    + CODE.replace("intervals", "spans")
    + "```\n\nCopy the function again with the variable `merged` renamed to `result`. Only code.",
]

CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are some good habits for staying healthy while working from home?",
]


def chat(url: str, text: str, max_tokens: int) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    out = post_json(
        url + "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    secs = time.perf_counter() - t0
    return [int(t) for t in out["choices"][0]["token_ids"]], secs


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:  # noqa: S310 - loopback
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def workload(server: Server, prompts: list[str], max_tokens: int, runs: int) -> tuple[float, list[list[int]]]:
    """Median generated tokens per second over ``runs`` passes (one request at a time)."""
    rates: list[float] = []
    outs: list[list[int]] = []
    for _ in range(runs):
        tokens = secs = 0.0
        outs = []
        for p in prompts:
            ids, s = chat(server.url, p, max_tokens)
            outs.append(ids)
            tokens += len(ids)
            secs += s
        rates.append(tokens / secs)
    return statistics.median(rates), outs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", help="the GGUF file (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--llama-server", help="also run llama-server (its lookup decoding is not wired here)")
    args = p.parse_args(argv)
    gguf = pathlib.Path(args.gguf) if args.gguf else smollm2_gguf()
    if gguf is None or not gguf.is_file():
        print("speculative: no GGUF file", file=sys.stderr)
        return 2
    args.log_dir = pathlib.Path(tempfile.mkdtemp(prefix="pagedkv-speculative-"))
    args.concurrency, args.threads = 1, 0
    rows: dict[str, dict[str, float]] = {}
    outputs: dict[str, dict[str, list[list[int]]]] = {}
    for flags in ((), ("--speculative", "ngram")):
        server = start_pagedkv(gguf, args, flags)
        try:
            chat(server.url, CHAT[0], 8)  # warm up
            rows[server.name], outputs[server.name] = {}, {}
            for name, prompts in (("copy-heavy", COPY), ("open-ended chat", CHAT)):
                rate, outs = workload(server, prompts, args.max_tokens, args.runs)
                rows[server.name][name] = rate
                outputs[server.name][name] = outs
            if flags:
                rows[server.name]["acceptance"] = metric(server.url, "pagedkv_spec_decode_acceptance_rate")
                rows[server.name]["tokens/pass"] = metric(server.url, "pagedkv_spec_decode_tokens_per_pass")
        finally:
            server.stop()
    if args.llama_server and find_binary(args.llama_server, "llama-server"):
        print("# llama-server rows: not run by this script yet", file=sys.stderr)
    plain, spec = list(rows)
    print(f"| workload | {plain} tok/s | {spec} tok/s | ratio | outputs equal |")
    print("|---|---:|---:|---:|---|")
    for name in ("copy-heavy", "open-ended chat"):
        a, b = rows[plain][name], rows[spec][name]
        same = outputs[plain][name] == outputs[spec][name]
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {same} |")
    print(
        f"\nacceptance rate {rows[spec]['acceptance']:.2f}, "
        f"{rows[spec]['tokens/pass']:.2f} tokens per verification pass ({spec})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
