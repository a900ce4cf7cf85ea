"""In-process benchmark of the allocator core on a scheduler-like workload.

65,536 blocks of 16 tokens; 256 running sequences with lognormal prompts
(around 600 tokens) and lognormal output lengths; every step appends one token
to each running sequence through `BlockManager.step` (the call the gRPC Step
makes), and finished sequences are freed and replaced by new ones in the same
step. Only time inside the allocator is measured (the free, the appends
and the admissions' Allocate calls); the harness's own bookkeeping is not. Three modes: no token ids (no prefix hashing), token ids (hashing), and
token ids with a shared 512-token system prompt (prefix hits). A naive
deque + dict + list allocator runs the same trace as the floor, side by side.

    python bench/core_bench.py [--steps 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import gc
import math
import pathlib
import random
import statistics
import sys
import time
from collections import deque

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from block_manager_svc.core import BlockManager, CoreConfig  # noqa: E402

NUM_BLOCKS = 65_536
BLOCK_SIZE = 16
RUNNING = 256
PREFIX_LEN = 512


class Workload:
    """A deterministic stream of (prompt tokens, output length) requests."""

    def __init__(self, seed: int, shared_prefix: bool) -> None:
        self.rng = random.Random(seed)
        self.prefix = [self.rng.randrange(32_000) for _ in range(PREFIX_LEN)] if shared_prefix else []

    def next_request(self) -> tuple[list[int], int]:
        rng = self.rng
        prompt_len = min(4096, max(8, int(rng.lognormvariate(math.log(600), 0.5))))
        out_len = min(2048, max(4, int(rng.lognormvariate(math.log(200), 0.6))))
        body = [rng.randrange(32_000) for _ in range(max(1, prompt_len - len(self.prefix)))]
        return self.prefix + body, out_len


class NaiveAllocator:
    """The floor: a deque of free ids, a dict of lists, no sharing or hashing."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.free = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}
        self.bs = block_size

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.bs)
        blocks = [self.free.popleft() for _ in range(n)]
        self.tables[seq_id] = blocks
        self.lens[seq_id] = num_tokens
        return blocks

    def step(self, seq_ids: list[str], frees: list[str]) -> list[int]:
        for s in frees:
            self.free.extend(self.tables.pop(s))
            del self.lens[s]
        new = []
        lens, tables, bs = self.lens, self.tables, self.bs
        for s in seq_ids:
            n = lens[s]
            if n % bs == 0:
                b = self.free.popleft()
                tables[s].append(b)
                new.append(b)
            lens[s] = n + 1
        return new


def run(mode: str, steps: int, seed: int, eviction_policy: str = "lru") -> dict[str, float]:
    """Returns per-step timings and block-op counts for one mode."""
    use_ids = mode in ("hash", "hash+prefix")
    work = Workload(seed, shared_prefix=(mode == "hash+prefix"))
    naive = mode == "naive"
    if naive:
        alloc: NaiveAllocator | BlockManager = NaiveAllocator(NUM_BLOCKS, BLOCK_SIZE)
    else:
        alloc = BlockManager(
            CoreConfig(num_gpu_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, eviction_policy=eviction_policy)
        )
    remaining: dict[str, int] = {}
    next_id = 0
    block_ops = 0
    rng = random.Random(seed + 1)

    def admit() -> float:
        """Admit one request; returns the seconds spent inside the allocator."""
        nonlocal next_id, block_ops
        prompt, out_len = work.next_request()
        sid = f"seq-{next_id}"
        next_id += 1
        t0 = time.perf_counter()
        if naive:
            block_ops += len(alloc.allocate(sid, len(prompt)))  # type: ignore[union-attr]
        else:
            r = alloc.allocate(sid, len(prompt), prompt if use_ids else None)  # type: ignore[union-attr]
            block_ops += len(r.block_ids)
        elapsed = time.perf_counter() - t0
        remaining[sid] = out_len
        return elapsed

    for _ in range(RUNNING):
        admit()
    times: list[float] = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(steps):
            # Scheduler-side bookkeeping (not timed): who finished, who runs.
            finished = [s for s, left in remaining.items() if left == 0]
            for s in finished:
                del remaining[s]
            seq_ids = list(remaining)
            tokens = [rng.randrange(32_000) for _ in seq_ids] if use_ids else None
            t0 = time.perf_counter()
            if naive:
                new_blocks = alloc.step(seq_ids, finished)  # type: ignore[union-attr]
                elapsed = time.perf_counter() - t0
                block_ops += len(new_blocks)
            else:
                res = alloc.step(seq_ids, None, tokens, finished)  # type: ignore[union-attr]
                elapsed = time.perf_counter() - t0
                if res.append_errors or res.free_errors:
                    raise RuntimeError(f"step failed: {res.append_errors[:1]} {res.free_errors[:1]}")
                block_ops += len(res.new_block_ids) + sum(res.released)
            for s in seq_ids:
                remaining[s] -= 1
            for _ in finished:
                elapsed += admit()
            times.append(elapsed)
    finally:
        gc.enable()
    times.sort()
    total = sum(times)
    out = {
        "mean_us": total / steps * 1e6,
        "p50_us": statistics.median(times) * 1e6,
        "p99_us": times[int(0.99 * (steps - 1))] * 1e6,
        "block_ops_per_s": block_ops / total,
    }
    if not naive:
        st = alloc.stats()  # type: ignore[union-attr]
        out["hit_rate"] = st.prefix_hit_tokens / st.prefix_query_tokens if st.prefix_query_tokens else 0.0
        alloc.check_invariants()  # type: ignore[union-attr]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # (key, mode, eviction policy, label, target µs). The pool fills with cached prefix blocks after
    # about a thousand steps; from then on every new block is an eviction, which is where the two
    # eviction policies differ (the service default is lru-size).
    modes: list[tuple[str, str, str, str, float | None]] = [
        ("naive", "naive", "lru", "naive deque+dict+list (floor)", None),
        ("nohash", "nohash", "lru", "pagedkv, no token ids", 150.0),
        ("hash", "hash", "lru", "pagedkv, token ids (hashing), lru", 300.0),
        ("hash+prefix", "hash+prefix", "lru", "pagedkv, hashing + shared 512-token prefix, lru", 300.0),
        ("hash/lru-size", "hash", "lru-size", "pagedkv, token ids (hashing), lru-size", 300.0),
        ("hash+prefix/lru-size", "hash+prefix", "lru-size", "pagedkv, hashing + prefix, lru-size", 300.0),
    ]
    results: dict[str, dict[str, float]] = {}
    for key, mode, policy, _, _ in modes:
        results[key] = run(mode, args.steps, args.seed, policy)
    print(f"core benchmark: {NUM_BLOCKS} blocks x {BLOCK_SIZE}, {RUNNING} running seqs, {args.steps} steps")
    print(f"| {'mode':<48} | {'mean µs/step':>12} | {'p50':>8} | {'p99':>8} | {'block ops/s':>12} | "
          f"{'vs naive':>8} | {'hit rate':>8} | {'target':>8} |")
    print("|" + "|".join("-" * w for w in (50, 14, 10, 10, 14, 10, 10, 10)) + "|")
    floor = results["naive"]["mean_us"]
    ok = True
    for key, _, _, label, target in modes:
        r = results[key]
        verdict = ""
        if target is not None:
            passed = r["mean_us"] < target
            ok &= passed
            verdict = f"<{target:.0f} {'ok' if passed else 'MISS'}"
        print(f"| {label:<48} | {r['mean_us']:>12.1f} | {r['p50_us']:>8.1f} | {r['p99_us']:>8.1f} | "
              f"{r['block_ops_per_s']:>12,.0f} | {r['mean_us'] / floor:>7.2f}x | "
              f"{r.get('hit_rate', 0.0):>8.1%} | {verdict:>8} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
