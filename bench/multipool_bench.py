"""Several pagedkv pools on this machine, routed round-robin vs by cached-prefix overlap.

Each pool is a whole stack (block manager, cache host, worker: frontend/launch/local_stack.py, CPU
backend) driven in-process by its own continuous-batching engine on its own thread; each pool's
block manager publishes its KV events over ZeroMQ in vLLM's wire format
(block_manager_svc/kv_events_zmq.py), and the prefix-aware router (bench/kv_router.py)
consumes them, as llm-d's KV-cache indexer would: it scores each pool by how many leading blocks
of the prompt that pool holds (weight 3) and by load (weight 2).

Workload: groups of users share a long system prompt; each request is the group's system prompt
plus the user's own turn; requests from all groups arrive interleaved (Poisson, --rate per
second). Each pool's KV pool is too small to keep every group's system prompt cached, so
round-robin, which sends every group to every pool, keeps evicting, while routing a group to the
pool that already holds its prefix keeps hitting. The same requests, arrival times and fresh
pools are used for both policies.

Printed per policy: prefix hit rate (prompt tokens served from the prefix cache / prompt tokens,
per request as the block manager reported at admission), TTFT p50/p99 (arrival at the router to
the first token), and throughput (generated tokens and requests per second of wall time from the
first arrival to the last completion). Target: prefix-aware >= 1.5x round-robin's hit rate and a
lower TTFT p99. Exit status 1 when a target is missed.

    python -m bench.multipool_bench [--pools 2] [--groups 8] [--users 6] [--rate 6] [--smoke]

The pools share this machine's cores (they are not separate hosts): absolute times are this
machine's, under whatever else runs on it.
"""

from __future__ import annotations

import argparse
import pathlib
import queue
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from bench.kv_router import PoolSubscriber, PrefixAwareRouter, RoundRobinRouter
from bench.models import gqa_llama
from pagedkv.frontend.engine import EngineConfig, GenerationRequest
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.logging_setup import configure_logging


@dataclass(slots=True)
class Arrival:
    at_s: float
    request: GenerationRequest


@dataclass(slots=True)
class Result:
    policy: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    per_pool: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def ttft(self, q: float) -> float:
        xs = sorted(self.ttft_s)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def make_model(path: pathlib.Path, hidden: int, layers: int, vocab: int, seed: int) -> None:
    """A random Llama (transformers, offline) large enough that prefill costs real compute."""
    heads = max(2, hidden // 32)
    gqa_llama(
        path,
        vocab=vocab,
        hidden=hidden,
        layers=layers,
        heads=heads,
        intermediate=2 * hidden,
        seed=seed,
        head_dim=32,
    )


def make_workload(args: argparse.Namespace, vocab: int) -> list[Arrival]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(vocab) for _ in range(args.system_tokens)] for _ in range(args.groups)]
    reqs = []
    for g in range(args.groups):
        for u in range(args.users):
            for turn in range(args.turns):
                user = [rng.randrange(vocab) for _ in range(args.user_tokens)]
                reqs.append(
                    GenerationRequest(f"g{g}-u{u}-t{turn}", systems[g] + user, max_tokens=args.max_tokens)
                )
    rng.shuffle(reqs)
    t, out = 0.0, []
    for r in reqs:
        t += rng.expovariate(args.rate)
        out.append(Arrival(t, r))
    return out


class Pool:
    """One stack, its engine on a thread, its KV-event subscriber."""

    def __init__(self, name: str, args: argparse.Namespace, model: str) -> None:
        self.name = name
        overrides = {
            "kv_events_endpoint": "tcp://127.0.0.1:*",
            "kv_events_replay_endpoint": "tcp://127.0.0.1:*",
            "kv_events_topic": f"kv@{name}@bench",
            "eviction_policy": args.eviction_policy,
        }
        self.stack = LocalStack(
            StackConfig(
                model=model,
                num_gpu_blocks=args.blocks_per_pool,
                block_size=args.block_size,
                device="cpu",
                block_manager_overrides=overrides,
            )
        )
        self.engine = self.stack.engine(
            EngineConfig(max_num_seqs=args.max_num_seqs, max_batch_tokens=args.max_batch_tokens)
        )
        pub = self.stack.block_manager.kv_events
        assert pub is not None
        self.events = PoolSubscriber(pub.endpoint, pub.replay_endpoint, f"kv@{name}@bench")
        self.inbox: queue.Queue[tuple[GenerationRequest, float]] = queue.Queue()
        self.in_flight = 0
        self.first_token: dict[str, float] = {}
        self.arrived: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def warm_up(self, vocab: int) -> None:
        """Compile and allocate once before measuring (the warm-up's blocks are cleared after)."""
        self.engine.generate(
            [GenerationRequest(f"warm-{self.name}", list(range(min(vocab, 40))), max_tokens=2)]
        )
        self.stack.block_manager.servicer._core.reset_prefix_cache()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"pool-{self.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            while True:
                try:
                    req, at = self.inbox.get_nowait()
                except queue.Empty:
                    break
                self.arrived[req.request_id] = at
                engine.add_request(req)
            if not engine.has_work():
                time.sleep(0.001)
                continue
            for ev in engine.step():
                now = time.perf_counter()
                if ev.request_id not in self.first_token:
                    self.first_token[ev.request_id] = now
                if ev.finish_reason is not None:
                    self.done[ev.request_id] = now
                    self.in_flight -= 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.events.close()
        self.stack.close()


def run_policy(
    policy: str, args: argparse.Namespace, model: str, vocab: int, workload: list[Arrival]
) -> Result:
    pools = [Pool(f"pool{i}", args, model) for i in range(args.pools)]
    try:
        for p in pools:
            p.warm_up(vocab)
        time.sleep(0.3)  # the warm-up's events (and the reset) reach the router
        router = (
            RoundRobinRouter(len(pools))
            if policy == "round-robin"
            else PrefixAwareRouter([p.events for p in pools], args.block_size)
        )
        for p in pools:
            p.start()
        res = Result(policy, per_pool=[0] * len(pools))
        t0 = time.perf_counter()
        for a in workload:
            delay = t0 + a.at_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            i = router.pick(a.request.prompt, [p.in_flight for p in pools])
            pools[i].in_flight += 1
            res.per_pool[i] += 1
            pools[i].inbox.put((a.request, time.perf_counter()))
        deadline = time.perf_counter() + args.timeout_s
        while sum(len(p.done) for p in pools) < len(workload):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{policy}: requests still running after {args.timeout_s} s")
            time.sleep(0.01)
        end = max(max(p.done.values()) for p in pools if p.done)
        res.wall_s = end - t0
        for p in pools:
            for rid, at in p.arrived.items():
                out = p.engine.outputs[rid]
                res.requests += 1
                res.prompt_tokens += len(out.prompt)
                res.cached_tokens += out.num_cached_tokens
                res.generated_tokens += sum(len(c.token_ids) for c in out.completions)
                res.ttft_s.append(p.first_token[rid] - at)
        return res
    finally:
        for p in pools:
            p.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pools", type=int, default=2)
    ap.add_argument("--groups", type=int, default=8, help="system prompts (user groups)")
    ap.add_argument("--users", type=int, default=6, help="users per group")
    ap.add_argument("--turns", type=int, default=1, help="requests per user")
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rate", type=float, default=6.0, help="arrivals per second (Poisson)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--blocks-per-pool",
        type=int,
        default=80,
        help="KV blocks per pool (80: about 4 of the 8 system prompts fit beside running requests)",
    )
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--eviction-policy", default="lru", choices=["lru", "lru-size"])
    ap.add_argument("--model", default="", help="model directory (default: build a random Llama)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--smoke", action="store_true", help="a small run for the test suite")
    args = ap.parse_args(argv)
    configure_logging("warning", "console")
    if args.smoke:
        args.groups, args.users, args.system_tokens, args.user_tokens = 4, 3, 64, 8
        args.max_tokens, args.rate, args.blocks_per_pool, args.hidden, args.layers = 2, 20.0, 28, 64, 2
    with tempfile.TemporaryDirectory(prefix="multipool-model-") as tmp:
        model = args.model
        if not model:
            make_model(pathlib.Path(tmp), args.hidden, args.layers, args.vocab, args.seed)
            model = tmp
        from pagedkv.worker_svc.model.config import load_model_config

        vocab = load_model_config(model).vocab_size
        workload = make_workload(args, vocab)
        results = [run_policy(p, args, model, vocab, workload) for p in ("round-robin", "prefix-aware")]

    print(
        f"{args.pools} pools x {args.blocks_per_pool} blocks of {args.block_size}; {args.groups} groups x "
        f"{args.users} users x {args.turns} turns = {len(workload)} requests; system prompt "
        f"{args.system_tokens} + user {args.user_tokens} tokens, {args.max_tokens} generated; "
        f"Poisson {args.rate}/s; model hidden {args.hidden}, {args.layers} layers (CPU)"
    )
    print(
        f"{'policy':<14}{'hit rate':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'tok/s':>9}{'req/s':>8}"
        f"  requests per pool"
    )
    for r in results:
        print(
            f"{r.policy:<14}{r.hit_rate:>10.1%}{r.ttft(0.5) * 1e3:>13.1f}{r.ttft(0.99) * 1e3:>13.1f}"
            f"{r.generated_tokens / r.wall_s:>9.1f}{r.requests / r.wall_s:>8.2f}  {r.per_pool}"
        )
    rr, pa = results
    ratio = pa.hit_rate / rr.hit_rate if rr.hit_rate else float("inf")
    print(f"prefix-aware / round-robin: hit rate x{ratio:.2f}, TTFT p99 x{pa.ttft(0.99) / rr.ttft(0.99):.2f}")
    if args.smoke:  # a dozen requests: too few for a stable p99, so only the hit rate is judged
        ok = ratio >= 1.5
        print("smoke target (hit rate >= 1.5x):", "met" if ok else "MISSED")
        return 0 if ok else 1
    ok = ratio >= 1.5 and pa.ttft(0.99) < rr.ttft(0.99)
    print("targets (hit rate >= 1.5x, lower TTFT p99):", "met" if ok else "MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
