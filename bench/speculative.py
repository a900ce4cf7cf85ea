"""Speculative decoding (n-gram prompt lookup, a draft model) against plain decoding, one request at a time.

Two `pagedkv up --model FILE` stacks as a user starts them (bench/up_stack.py through
bench/vs_llamacpp.py's start_pagedkv): the default one, and the default plus ``--speculative
ngram``; with --llama-server, llama-server on the same file with its defaults and with its n-gram
lookup (``--spec-type ngram-simple``); with --speculative-model DRAFT, also the default plus
``--speculative-model DRAFT`` (a draft model sharing the file's vocabulary; the packaged model as
its own draft keeps every proposal and shows what drafting costs when the draft is as big as the
model). Every server is up for the whole run and the rounds
alternate between them (this VM's speed drifts). Greedy, one request at a time, every answer as
long as the model makes it (its end of sequence, or the stop string a client sets on a completion
that opens a fenced or quoted block), at most --max-tokens. Six workloads, two prompts each:

- code, chat: a code file in a chat message and a request to repeat it with one name changed
  (/v1/chat/completions);
- code, completion: the code file and the opening of its copy in a fenced block
  (/v1/completions, ``stop`` at the fence);
- passage, chat: a paragraph and a request to repeat it with one word or day changed;
- passage, completion: the paragraph and the opening of its changed copy (``stop`` at the quotes);
- open-ended chat and open-ended completion: short questions and story openings with nothing to
  copy.

A model whose file has no chat template (a base model) is refused chat requests: the chat
workloads are then left out, with a line on stderr.

A model too small to follow a request may copy less (or more) than asked: the answers are what the
model wrote, the same on both sides of each pair (greedy), so both sides count the same tokens.

Reports generated tokens per second of each (median of --runs rounds), the speculative server
over its plain one (the median of the per-round ratios), the acceptance rate and tokens per
verification pass per workload from each speculative stack's /metrics counters, and whether each
pair's answers are equal (token ids for pagedkv, text for llama-server; greedy: they must be).

With --in-flight 1,2,4,8: instead, the default stack against one that speculates at every batch
size, on two mixes of as many requests as the largest size, sent in waves of n at once: the
copy-heavy workloads' prompts in turn, and the open-ended ones' prompts in turn (where speculation
gains least). Where speculation stops paying on the open-ended mix is the rule
--speculative-max-num-seqs sets.

    python -m bench.speculative [--gguf FILE] [--runs 3] [--max-tokens 256] [--llama-server BIN]
        [--speculative-model DRAFT]
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
from dataclasses import dataclass

from bench import up_stack
from bench.kv_dtype_bench import smollm2_gguf
from bench.vs_llamacpp import Server, find_binary, start_llama, start_pagedkv
from pagedkv.frontend.clients.http import HttpError, post_json

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
    "```python\n" + CODE + "```\n\nThe same function again:\n\n```python\n",
]

LIGHTHOUSE = (
    "The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed "
    "the spiral stairs, trimmed the wick and polished the great lens until it shone. Ships passing the "
    "rocks below saw the beam sweep across the water and knew to steer east, away from the reef. When the "
    "keeper grew old, his daughter took over the work, and she kept the light burning through the worst "
    "storms the coast had ever seen."
)
MEETING = (
    "Our team meets every Monday at nine to plan the week. Each person lists the tasks they finished, "
    "the tasks they will start, and anything that blocks them. The notes go into the shared document, and "
    "the team lead sends a summary to the whole department by noon. On Fridays we review what shipped and "
    "move anything unfinished to the next week's list."
)

PASSAGE_CHAT = [
    "Here is a paragraph:\n\n"
    + LIGHTHOUSE
    + "\n\nRepeat the paragraph word for word, but change 'daughter' to 'son'.",
    "Rewrite this note exactly as it is, except that the meeting is on Tuesday instead of Monday:\n\n"
    + MEETING,
]

PASSAGE_COMPLETION = [
    'Text:\n"""\n' + LIGHTHOUSE + '\n"""\n\nThe same text with "northern" changed to "southern":\n"""\n',
    'Note:\n"""\n' + MEETING + '\n"""\n\nThe same note, with the meeting on Tuesday:\n"""\n',
]

CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are some good habits for staying healthy while working from home?",
]

OPEN_COMPLETION = [
    "Once upon a time, in a small village by the sea,",
    "The printing press changed how ideas spread because",
]


@dataclass(frozen=True)
class Workload:
    name: str
    endpoint: str  # "chat" or "completions"
    prompts: list[str]
    stop: tuple[str, ...] = ()  # what a client sets on a completion that opens a fenced block


WORKLOADS = [
    Workload("code, chat", "chat", COPY_CHAT),
    Workload("code, completion", "completions", COPY_COMPLETION, ("```",)),
    Workload("passage, chat", "chat", PASSAGE_CHAT),
    Workload("passage, completion", "completions", PASSAGE_COMPLETION, ('"""',)),
    Workload("open-ended chat", "chat", CHAT),
    Workload("open-ended completion", "completions", OPEN_COMPLETION),
]

# the speculative stack's /metrics counters, read around each workload
COUNTERS = (
    "pagedkv_spec_decode_num_drafts_total",
    "pagedkv_spec_decode_num_draft_tokens_total",
    "pagedkv_spec_decode_num_accepted_tokens_total",
    "pagedkv_spec_decode_num_emitted_tokens_total",
)


def ask(
    url: str, endpoint: str, prompt: str, max_tokens: int, stop: tuple[str, ...] = ()
) -> tuple[list[int] | str, int, float]:
    """One greedy answer, ended where the model ends it (or at ``stop``), at most max_tokens: (its
    token ids where the server returns them, else its text; the generated token count from usage;
    seconds)."""
    body: dict[str, object] = {"max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    if stop:
        body["stop"] = list(stop)
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


def counters(url: str) -> list[float]:
    """The speculation counters (COUNTERS) from a pagedkv server's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:  # noqa: S310 - loopback
        lines = r.read().decode().splitlines()
    values = dict.fromkeys(COUNTERS, 0.0)
    for line in lines:
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in values:
            values[name] = float(line.rsplit(" ", 1)[1])
    return [values[n] for n in COUNTERS]


@dataclass
class Result:
    """One workload on one server in one round."""

    rate: float  # generated tokens per second
    tokens: int
    answers: list[list[int] | str]
    counted: list[float] | None = None  # the COUNTERS' increments (a speculating pagedkv server)


def one_round(server: Server, workloads: list[Workload], max_tokens: int, count: bool) -> dict[str, Result]:
    """Each workload's generated tokens per second on one server, its answers and (``count``) how
    its speculation went."""
    out = {}
    for w in workloads:
        before = counters(server.url) if count else None
        tokens, secs, answers = 0, 0.0, []
        for p in w.prompts:
            answer, n, s = ask(server.url, w.endpoint, p, max_tokens, w.stop)
            answers.append(answer)
            tokens += n
            secs += s
        counted = None
        if before is not None:
            counted = [b - a for a, b in zip(before, counters(server.url), strict=True)]
        out[w.name] = Result(tokens / secs, tokens, answers, counted)
    return out


# --in-flight's two mixes: (name, the workloads whose prompts it sends in turn)
MIXES = [
    ("copy-heavy", [w for w in WORKLOADS if not w.name.startswith("open-ended")]),
    ("open-ended", [w for w in WORKLOADS if w.name.startswith("open-ended")]),
]


def in_flight_rate(server: Server, n: int, total: int, workloads: list[Workload], max_tokens: int) -> float:
    """Generated tokens per second of ``total`` requests (the workloads' prompts in turn), sent in
    waves of ``n`` at once: the same requests at every ``n``."""
    prompts = [(w, p) for w in workloads for p in w.prompts]
    requests = [prompts[i % len(prompts)] for i in range(total)]
    tokens = 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        for i in range(0, total, n):
            wave = requests[i : i + n]
            done = pool.map(lambda r: ask(server.url, r[0].endpoint, r[1], max_tokens, r[0].stop), wave)
            tokens += sum(count for _, count, _ in done)
    return tokens / (time.perf_counter() - t0)


def warm_up(servers: list[Server]) -> list[Workload]:
    """One short answer from each server; the workloads they can all serve: the chat ones only
    where every server has a chat template (a base model's file may have none, and chat is then
    refused with 400)."""
    chat = True
    for s in servers:
        ask(s.url, "completions", OPEN_COMPLETION[0], 8)
        try:
            ask(s.url, "chat", CHAT[0], 8)
        except HttpError as e:
            if e.status != 400:
                raise
            chat = False
    if not chat:
        print("# no chat template: the chat workloads are left out", file=sys.stderr, flush=True)
    return [w for w in WORKLOADS if chat or w.endpoint != "chat"]


def in_flight_table(gguf: pathlib.Path, args: argparse.Namespace, sizes: list[int]) -> None:
    """Where speculation stops paying as the batch grows (the rule ``--speculative-max-num-seqs``
    sets): the default stack against one that speculates at every batch size, rounds alternating."""
    on = ("--speculative", "ngram", "--speculative-max-num-seqs", str(max(sizes)))
    servers: list[Server] = []
    try:
        servers = [start_pagedkv(gguf, args), start_pagedkv(gguf, args, on)]
        usable = warm_up(servers)
        mixes = [(mix, [w for w in ws if w in usable]) for mix, ws in MIXES]
        rates: dict[tuple[str, str, int], list[float]] = {}
        for r in range(args.runs):
            for n in sizes:
                for mix, workloads in mixes:
                    for s in servers if r % 2 == 0 else servers[::-1]:
                        rate = in_flight_rate(s, n, max(sizes), workloads, args.max_tokens)
                        rates.setdefault((s.name, mix, n), []).append(rate)
                        print(f"# round {r + 1} {n} in flight, {mix}, {s.name}: {rate:.1f} tok/s",
                              file=sys.stderr, flush=True)  # fmt: skip
    finally:
        for s in servers:
            s.stop()
    plain, spec = (s.name for s in servers)
    print(
        f"{gguf.name}, {max(sizes)} requests a mix in waves of n at once, greedy, answers ended by the "
        f"model (or the workload's stop string), at most {args.max_tokens} tokens, "
        f"median of {args.runs} rounds; plain: {plain}, speculative: {spec}\n"
    )
    print("| in flight | mix | plain tok/s | speculative tok/s | speculative / plain |")
    print("|---:|---|---:|---:|---:|")
    for n in sizes:
        for mix, _ in mixes:
            a, b = rates[plain, mix, n], rates[spec, mix, n]
            ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
            print(f"| {n} | {mix} | {statistics.median(a):.1f} | {statistics.median(b):.1f} | {ratio:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", help="the GGUF file (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--runs", type=int, default=3, help="rounds, each server in turn")
    p.add_argument("--max-tokens", type=int, default=256, help="the most tokens an answer may have")
    p.add_argument("--llama-server", help="also llama-server, plain and with --spec-type ngram-simple")
    p.add_argument("--speculative-model", help="also the default stack with this draft model")
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
        if args.speculative_model:  # beside the same default stack
            draft = start_pagedkv(gguf, args, ("--speculative-model", args.speculative_model))
            draft.name = f"pagedkv --speculative-model {pathlib.Path(args.speculative_model).name}"
            pairs.append((pairs[0][0], draft))
        if binary:
            pairs.append(
                (
                    start_llama(binary, gguf, "llama-server", "Q", args),
                    start_llama(binary, gguf, "llama-server --spec-type ngram-simple", "Q", args,
                                ("--spec-type", "ngram-simple")),
                )
            )  # fmt: skip
        servers = list({id(s): s for pair in pairs for s in pair}.values())
        workloads = warm_up(servers)
        runs: dict[str, list[dict[str, Result]]] = {s.name: [] for s in servers}
        speculating = [spec for plain, spec in pairs if plain is pairs[0][0]]  # pagedkv's
        for r in range(args.runs):
            for s in servers if r % 2 == 0 else servers[::-1]:
                runs[s.name].append(one_round(s, workloads, args.max_tokens, s in speculating))
                print(f"# round {r + 1} {s.name}: "
                      + ", ".join(f"{w} {v.rate:.1f} tok/s" for w, v in runs[s.name][-1].items()),
                      file=sys.stderr, flush=True)  # fmt: skip
    finally:
        for s in {id(s): s for pair in pairs for s in pair}.values():
            s.stop()
    print(
        f"{gguf.name}, one request at a time, greedy, answers ended by the model (or the workload's stop "
        f"string), at most {args.max_tokens} tokens, median of {args.runs} rounds\n"
    )
    print(
        "| workload | server | tokens a round | plain tok/s | speculative tok/s | speculative / plain | "
        "answers equal |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    for w in workloads:
        for plain, spec in pairs:
            a = [run[w.name].rate for run in runs[plain.name]]
            b = [run[w.name].rate for run in runs[spec.name]]
            ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
            same = all(
                pr[w.name].answers == sr[w.name].answers
                for pr, sr in zip(runs[plain.name], runs[spec.name], strict=True)
            )
            print(
                f"| {w.name} | {plain.name} / {spec.name} | {runs[plain.name][0][w.name].tokens} | "
                f"{statistics.median(a):.1f} | {statistics.median(b):.1f} | {ratio:.2f}x | {same} |"
            )
    for spec in speculating:
        print(f"\n{spec.name}, all rounds:\n")
        print("| workload | verification passes | proposed tokens | accepted | acceptance rate "
              "| tokens a pass |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|")
        for w in workloads:
            counted = [run[w.name].counted or [0.0] * len(COUNTERS) for run in runs[spec.name]]
            passes, proposed, accepted, emitted = (sum(c) for c in zip(*counted, strict=True))
            rate = accepted / proposed if proposed else 0.0
            per_pass = emitted / passes if passes else 0.0
            print(
                f"| {w.name} | {passes:.0f} | {proposed:.0f} | {accepted:.0f} | {rate:.2f} | {per_pass:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
