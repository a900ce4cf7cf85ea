"""CPU decode attention: the native kernel against the gather + SDPA bucket plans.

``kernels/cpu/attention.py`` has two decode paths. The native kernel (``kernels/cpu/native.py``) reads K/V
in place from the paged cache. Without it, a step is planned once: which sequences share one
gather + SDPA call (length buckets) and which shared prefixes are attended once for all their
members (cascade); every call has a fixed cost (a gather, an SDPA launch, Python), and the cascade
adds a merge, so those rules trade padding and duplicated prefix work against calls. This prints,
per batch shape, the time of a 4-layer step's decode attention (plan included) on five paths,
measured round-robin in one run, in a fresh random order each round (the machine is noisy):

- ``flat``: buckets bounded by ``PAD_FRACTION`` only, no cascade (the first CPU backend);
- ``cascade-always``: the same buckets plus a cascade for every group sharing ``MIN_SHARED_BLOCKS``;
- ``buckets``: the bucket rules ``kernels/cpu/attention.py`` uses without the native kernel (``PAD_TOKENS``
  of padding always allowed, a cascade only when it saves ``CASCADE_MIN_SAVED_TOKENS``);
- ``native-flat``: the native decode kernel alone, one call per layer, every member of a group
  computing its shared prefix again (the prefix's K/V read from cache after the first member);
- ``native``: the CPU backend's path with the native kernels available (what it runs when it can
  build them): the decode kernel, plus the native cascade when groups share prefixes that save
  ``NATIVE_CASCADE_MIN_SAVED_TOKENS``: each group's prefix once on the prefill kernel, merged into the
  members' own parts (two calls a layer).

Then, for GQA groups without a specialised copy before (3: SmolLM2's 9 query heads over 3 KV heads;
5, 6, 7), the native kernel's specialised (group, head_dim 64) copy against its generic copy
(``cpu_native.decode_generic_for_bench``) on the same batches, round-robin in the same run.

    python -m bench.cpu_decode_bench [--threads 2] [--reps 15] [--head-dims 64,128] [--gqa-groups 3,5,6,7]
                                     [--only-gqa] [--shapes N]
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.kernels.cpu import attention as cpu
from pagedkv.kernels.cpu import native as cpu_native

BLOCK = 16
NUM_KV_HEADS, NUM_HEADS, LAYERS = 2, 8, 4


@dataclass(slots=True)
class Shape:
    label: str
    num_seqs: int
    shared_blocks: int  # leading blocks every member of a group shares (0: no sharing)
    groups: int
    own_blocks: tuple[int, int]  # each sequence's own blocks past the shared ones (min, max)


SHAPES = [
    Shape("chat burst, 8 seqs, 3 prompts of 192 tok", 8, 12, 3, (2, 8)),
    Shape("chat burst, 48 seqs, 3 prompts of 192 tok", 48, 12, 3, (2, 8)),
    Shape("16 seqs, 4 prefixes of 432 tok, short own", 16, 27, 4, (1, 2)),
    Shape("64 seqs, 4 prefixes of 432 tok, short own", 64, 27, 4, (1, 2)),
    Shape("48 seqs, one 1024-tok prefix", 48, 64, 1, (1, 4)),
    Shape("48 seqs, two 2048-tok prefixes", 48, 128, 2, (1, 4)),
    Shape("8 seqs, one 2048-tok prefix", 8, 128, 1, (1, 4)),
    Shape("48 seqs, nothing shared, 40-480 tok", 48, 0, 1, (3, 30)),
]

# path -> (bucket rules, native kernel on)
RULES: dict[str, tuple[dict[str, float], bool]] = {
    "flat": ({"PAD_TOKENS": 0, "MIN_SHARED_BLOCKS": 10**9, "CASCADE_MIN_SAVED_TOKENS": 0}, False),
    "cascade-always": ({"PAD_TOKENS": 0, "CASCADE_MIN_SAVED_TOKENS": 0}, False),
    "buckets": ({}, False),
    "native-flat": ({"NATIVE_CASCADE_MIN_SAVED_TOKENS": 10**9}, True),
    "native": ({}, True),
}


def batch(shape: Shape, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Block tables (groups start with the same physical blocks, as prefix hits do), lengths, blocks used."""
    rnd = random.Random(seed)
    prefixes = [
        list(range(g * shape.shared_blocks, (g + 1) * shape.shared_blocks)) for g in range(shape.groups)
    ]
    nxt = shape.groups * shape.shared_blocks
    tables, lens = [], []
    for i in range(shape.num_seqs):
        own = rnd.randint(*shape.own_blocks)
        tables.append(prefixes[i % shape.groups] + list(range(nxt, nxt + own)))
        nxt += own
        lens.append((shape.shared_blocks + own - 1) * BLOCK + rnd.randint(1, BLOCK))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return bt, torch.tensor(lens, dtype=torch.int32), nxt


def with_rules(path: tuple[dict[str, float], bool], fn: Callable[[], object]) -> object:
    rules, native = path
    saved = {k: getattr(cpu, k) for k in rules}
    saved_env = os.environ.get(cpu_native.ENV_SWITCH)
    for k, v in rules.items():
        setattr(cpu, k, v)
    os.environ[cpu_native.ENV_SWITCH] = "auto" if native else "0"
    try:
        return fn()
    finally:
        for k, v in saved.items():
            setattr(cpu, k, v)
        if saved_env is None:
            os.environ.pop(cpu_native.ENV_SWITCH, None)
        else:
            os.environ[cpu_native.ENV_SWITCH] = saved_env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15, help="timed rounds per rule set (median reported)")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument(
        "--gqa-groups", default="3,5,6,7", help="groups for the specialised / generic table ('' skips)"
    )
    ap.add_argument("--only-gqa", action="store_true", help="only the specialised / generic table")
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="only the first N batch shapes")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not args.only_gqa:
        bucket_table(args)
    if args.gqa_groups and cpu_native.available():
        gqa_table(args, [int(g) for g in args.gqa_groups.split(",")])
    return 0


GQA_KV_HEADS, GQA_HEAD_DIM = 3, 64
GQA_SHAPES = [s for s in SHAPES if s.label.startswith(("chat burst, 48", "48 seqs, nothing"))]


def gqa_table(args: argparse.Namespace, groups: list[int]) -> None:
    """The native kernel's specialised copy for (group, head_dim 64) against its generic copy."""
    print(
        f"\n# native decode, {GQA_KV_HEADS} KV heads x head_dim {GQA_HEAD_DIM}, {LAYERS} layers, fp32, "
        f"{args.threads} threads, variant {cpu_native.active_variant()}; median ms of {args.reps} "
        f"round-robin rounds"
    )
    print("\n| group (heads) | batch | generic copy ms | specialised copy ms | specialised / generic |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for group in groups:
            for shape in GQA_SHAPES:
                bt, lens, used = batch(shape)
                gen = torch.Generator().manual_seed(group)
                kc = torch.randn(used + 1, BLOCK, GQA_KV_HEADS, GQA_HEAD_DIM, generator=gen)
                vc = torch.randn(used + 1, BLOCK, GQA_KV_HEADS, GQA_HEAD_DIM, generator=gen)
                q = torch.randn(shape.num_seqs, group * GQA_KV_HEADS, GQA_HEAD_DIM, generator=gen)
                out = torch.empty_like(q)
                fns = {"generic": cpu_native.decode_generic_for_bench, "specialised": cpu_native.decode}

                # The inputs are bound now (default argument), not looked up at call time (B023).
                def step(
                    fn: Callable[..., torch.Tensor],
                    inputs: tuple[Any, ...] = (q, kc, vc, bt, lens, GQA_HEAD_DIM**-0.5, out),
                ) -> torch.Tensor:
                    for _ in range(LAYERS):
                        fn(*inputs)
                    return inputs[-1]

                generic = step(fns["generic"]).clone()
                torch.testing.assert_close(step(fns["specialised"]), generic, rtol=1e-5, atol=1e-5)
                times: dict[str, list[float]] = {name: [] for name in fns}
                for _ in range(args.reps):
                    for name, fn in fns.items():
                        t0 = time.perf_counter()
                        step(fn)
                        times[name].append(time.perf_counter() - t0)
                med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
                print(
                    f"| {group} ({group * GQA_KV_HEADS}/{GQA_KV_HEADS}) | {shape.label} | "
                    f"{med['generic']:.2f} | "
                    f"{med['specialised']:.2f} | {med['specialised'] / med['generic']:.2f}x |",
                    flush=True,
                )


def bucket_table(args: argparse.Namespace) -> None:
    print(
        f"# CPU decode attention, {LAYERS} layers + plan, {NUM_HEADS} heads / {NUM_KV_HEADS} KV heads, "
        f"block {BLOCK}, fp32, {args.threads} threads; median ms of {args.reps} round-robin rounds"
    )
    if not cpu_native.available():
        print(
            f"# the native kernels are unavailable ({cpu_native.kernel_path()} path, see the log): no native "
            "column",
            file=sys.stderr,
        )
        del RULES["native"], RULES["native-flat"]
    print(
        f"# buckets: PAD_FRACTION={cpu.PAD_FRACTION} PAD_TOKENS={cpu.PAD_TOKENS} "
        f"MIN_SHARED_BLOCKS={cpu.MIN_SHARED_BLOCKS} CASCADE_MIN_SAVED_TOKENS={cpu.CASCADE_MIN_SAVED_TOKENS}"
    )
    ratios = [("buckets", "flat"), ("buckets", "cascade-always")] + (
        [("native", "buckets"), ("native", "native-flat")] if "native" in RULES else []
    )
    print(
        "\n| head_dim | batch | "
        + " | ".join(f"{r} ms (calls)" for r in RULES)
        + " | "
        + " | ".join(f"{a} / {b}" for a, b in ratios)
        + " |"
    )
    print("|---|---|" + "---|" * (len(RULES) + len(ratios)))
    with torch.inference_mode():
        for head_dim in (int(x) for x in args.head_dims.split(",")):
            for shape in SHAPES[: args.shapes]:
                bt, lens, used = batch(shape)
                gen = torch.Generator().manual_seed(head_dim)
                kc = torch.randn(used + 1, BLOCK, NUM_KV_HEADS, head_dim, generator=gen)
                vc = torch.randn(used + 1, BLOCK, NUM_KV_HEADS, head_dim, generator=gen)
                q = torch.randn(shape.num_seqs, NUM_HEADS, head_dim, generator=gen)
                want = None
                calls: dict[str, str] = {}
                steps: dict[str, Callable[[], None]] = {}
                for name, rules in RULES.items():
                    # Everything the step reads is bound now (default arguments), so a step called after
                    # this loop runs on the inputs it was built for, whatever the loops did since (B023).
                    def step(
                        rules: tuple[dict[str, float], bool] = rules,
                        inputs: tuple[Any, ...] = (q, kc, vc, bt, lens, head_dim),
                    ) -> torch.Tensor:
                        q, kc, vc, bt, lens, head_dim = inputs

                        def run() -> torch.Tensor:
                            plan = cpu.plan_decode(bt, lens, BLOCK)
                            out = torch.empty_like(q)
                            for _ in range(LAYERS):
                                cpu.paged_decode_attention(
                                    q, kc, vc, bt, lens, head_dim**-0.5, out=out, plan=plan
                                )
                            return out

                        return with_rules(rules, run)  # type: ignore[return-value]

                    got = step()
                    if want is None:
                        want = got
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # same attention, any rules
                    plan = with_rules(rules, functools.partial(cpu.plan_decode, bt, lens, BLOCK))
                    calls[name] = (
                        ("2" if plan.cascade is not None else "1")  # type: ignore[attr-defined]
                        if plan.native_tables is not None  # type: ignore[attr-defined]
                        else f"{len(plan.buckets)}+{len(plan.shared)}"  # type: ignore[attr-defined]
                    )
                    steps[name] = step
                times: dict[str, list[float]] = {name: [] for name in RULES}
                order = list(steps.items())
                rnd = random.Random(head_dim)
                for _ in range(args.reps):
                    # A fresh order each round: a path that always ran after another one's gathers (or
                    # after the same data) would always find the caches in the same state.
                    rnd.shuffle(order)
                    for name, step in order:
                        t0 = time.perf_counter()
                        step()
                        times[name].append(time.perf_counter() - t0)
                med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
                cells = " | ".join(f"{med[n]:.2f} ({calls[n]})" for n in RULES)
                cells += " | " + " | ".join(f"{med[a] / med[b]:.2f}x" for a, b in ratios)
                print(f"| {head_dim} | {shape.label} | {cells} |", flush=True)
    print(
        "\n(calls per layer: buckets + cascaded prefixes; the native kernels one call, two with the cascade)"
    )


if __name__ == "__main__":
    sys.exit(main())
