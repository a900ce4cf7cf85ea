"""Trace replay: the memory policies against seeded synthetic traces.

Three experiments, each deterministic for a seed, printed as tables; the exit
status is non-zero when a target is missed.

1. Utilization (ShareGPT-like): prompt and output lengths lognormal (means
   about 160 and 340 tokens, capped at 2048 together), Poisson arrivals,
   continuous batching. KV utilization = tokens held / token slots allocated,
   sampled every few steps, for pagedkv at block sizes 8/16/32 and for
   contiguous baselines on the same trace: reserve the max length (2048), the
   next power of two of the final length, exactly the final length (oracle).
   Target: >= 96% at block size 16.
2. Prefix caching under memory pressure: requests over a few hundred shared
   prefixes (system prompts, documents) with Zipf popularity, a unique
   question and an answer each, a pool far too small for all prefixes.
   Prefix-cache hit rate in tokens and the share of requests with any hit,
   for `lru` and `lru-size`. Target: lru-size >= lru on every trace, and
   >= 10% better (relative) on the mixed-size one.
3. Overload: more concurrent sequences than fit; half share a long system
   prompt, half have long private prompts; a small CPU pool; all requests
   queued at once and run to completion (the same work for every policy).
   Total preemption cost by the cost model, completed requests and steps
   taken for always-recompute, always-swap and the planner (auto). Target:
   the planner's cost <= the better fixed policy.
4. Overload, measured (``--engine``): experiment 3's cost is what the planner's
   own cost model says. This replays a scaled-down overload trace (same shape:
   half on a shared system prompt, half long private prompts, a small CPU pool,
   all queued at once) through the real engine on the CPU backend (in-process
   block manager, cache host and worker, the built-in tiny model, torch
   reference kernels) once per preemption mode, and reports wall time, tokens/s,
   the preemptions that happened, and whether the three modes produced the
   same greedy tokens. The cost model is first calibrated on this machine
   (prefill tokens/s and host-copy bandwidth of the tiny model's blocks) so
   the planner decides with real numbers. A few seconds to a minute.

    python -m bench.trace_replay [--seed 0] [--smoke] [--grpc] [--engine]

--smoke runs tiny traces (for the test suite; targets still checked, with a
looser utilization bar); --grpc drives experiment 2 through an in-process
gRPC server instead of the core.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass

from pagedkv.block_manager_svc.core import BlockManager, CoreConfig, ResourceExhausted, StepBatch
from pagedkv.block_manager_svc.core.prefix_cache import encode_tokens

VOCAB = 32_000
MAX_LEN = 2048


def lognormal_with_mean(rng: random.Random, mean: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)


# --- 1. utilization -------------------------------------------------------------


def sharegpt_trace(seed: int, num: int, rate: float) -> list[tuple[int, int, int]]:
    """(arrival step, prompt length, output length) per request."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(num):
        t += rng.expovariate(rate)
        prompt = max(1, min(MAX_LEN - 1, int(lognormal_with_mean(rng, 160, 1.0))))
        output = max(1, min(MAX_LEN - prompt, int(lognormal_with_mean(rng, 340, 1.0))))
        out.append((int(t), prompt, output))
    return out


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def run_utilization(seed: int, num: int, rate: float) -> dict[str, float]:
    trace = sharegpt_trace(seed, num, rate)
    results: dict[str, float] = {}
    baselines = {"max": 0.0, "pow2": 0.0, "oracle": 0.0}
    for bs in (8, 16, 32):
        bm = BlockManager(
            CoreConfig(
                num_gpu_blocks=2_000_000 // bs, block_size=bs, preemption_mode="off", eviction_policy="lru"
            )
        )
        pending = deque(enumerate(trace))
        # Sample the steady state: after warm-up, while requests still arrive
        # (the drain at the end holds only the longest requests).
        warmup, last_arrival = trace[len(trace) // 10][0], trace[-1][0]
        running: dict[str, tuple[int, int]] = {}  # seq -> (remaining outputs, final length)
        step = 0
        samples = 0
        ratio_sum = 0.0
        base_sums = dict.fromkeys(baselines, 0.0)
        while pending or running:
            while pending and pending[0][1][0] <= step:
                i, (_, prompt, output) = pending.popleft()
                sid = f"r{i}"
                bm.allocate(sid, prompt)
                running[sid] = (output, prompt + output)
            ids = list(running)
            if ids:
                bm.step(StepBatch(append_seq_ids=ids))
            finished = []
            for sid in ids:
                left, final = running[sid]
                if left == 1:
                    finished.append(sid)
                else:
                    running[sid] = (left - 1, final)
            if step % 8 == 0 and running and warmup <= step <= last_arrival:
                tokens = sum(bm.seqs[s].num_tokens for s in running)
                slots = bm.stats().num_used_blocks * bs
                ratio_sum += tokens / slots
                if bs == 16:
                    finals = [f for _, f in running.values()]
                    base_sums["max"] += tokens / (MAX_LEN * len(finals))
                    base_sums["pow2"] += tokens / sum(next_pow2(f) for f in finals)
                    base_sums["oracle"] += tokens / sum(finals)
                samples += 1
            for sid in finished:
                bm.free(sid)
                del running[sid]
            step += 1
        bm.check_invariants()
        results[f"paged-{bs}"] = ratio_sum / samples
        if bs == 16:
            for k in baselines:
                baselines[k] = base_sums[k] / samples
    results.update({f"contiguous-{k}": v for k, v in baselines.items()})
    return results


# --- 2. prefix caching ------------------------------------------------------------


@dataclass(slots=True)
class PrefixTrace:
    name: str
    prefixes: list[list[int]]
    requests: list[tuple[int, int, int]]  # (prefix index, question length, answer length)


def zipf_sampler(rng: random.Random, n: int, s: float):  # type: ignore[no-untyped-def]
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    order = list(range(n))
    rng.shuffle(order)  # popularity independent of size
    cum = []
    acc = 0.0
    for w in weights:
        acc += w
        cum.append(acc)

    def sample() -> int:
        import bisect

        return order[bisect.bisect_left(cum, rng.random() * acc)]

    return sample


def prefix_trace(name: str, seed: int, num_prefixes: int, num_requests: int, sizes: str) -> PrefixTrace:
    rng = random.Random(seed)
    prefixes = []
    for _ in range(num_prefixes):
        if sizes == "uniform":
            n = rng.randint(384, 640)
        else:  # mixed: short system prompts to long documents
            n = max(32, min(MAX_LEN, int(lognormal_with_mean(rng, 500, 1.2))))
        prefixes.append([rng.randrange(VOCAB) for _ in range(n)])
    sample = zipf_sampler(rng, num_prefixes, 1.0)
    requests = [(sample(), rng.randint(16, 96), rng.randint(16, 128)) for _ in range(num_requests)]
    return PrefixTrace(name, prefixes, requests)


class GrpcCore:
    """The few core calls experiment 2 makes, over gRPC (for --grpc)."""

    def __init__(self, **settings: object) -> None:
        import grpc

        from pagedkv.block_manager_svc.server import start_server
        from pagedkv.block_manager_svc.settings import BlockManagerSettings
        from pagedkv.v1 import block_manager_pb2 as pb
        from pagedkv.v1 import block_manager_pb2_grpc as pb_grpc

        self.pb, self.grpc = pb, grpc
        self.server = start_server(BlockManagerSettings(port=0, **settings))  # type: ignore[arg-type]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = pb_grpc.BlockManagerStub(self.channel)

    def allocate(self, seq_id: str, n: int, tokens: list[int]) -> int:
        try:
            r = self.stub.Allocate(self.pb.AllocateRequest(seq_id=seq_id, num_tokens=n, token_ids=tokens))
        except self.grpc.RpcError as e:
            if e.code() == self.grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise ResourceExhausted(e.details()) from None
            raise
        return r.num_cached_tokens

    def append(self, seq_id: str, n: int, tokens: list[int]) -> None:
        self.stub.Append(self.pb.AppendRequest(seq_id=seq_id, num_tokens=n, token_ids=tokens))

    def commit(self, seq_id: str, n: int) -> None:
        self.stub.Commit(self.pb.CommitRequest(seq_id=seq_id, num_computed_tokens=n))

    def free(self, seq_id: str) -> None:
        self.stub.Free(self.pb.FreeRequest(seq_id=seq_id))

    def hit_tokens(self) -> tuple[int, int]:
        s = self.stub.GetStats(self.pb.GetStatsRequest())
        return s.prefix_hit_tokens, s.prefix_query_tokens

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0)


class LocalCore:
    def __init__(self, **config: object) -> None:
        self.bm = BlockManager(CoreConfig(**config))  # type: ignore[arg-type]

    def allocate(self, seq_id: str, n: int, tokens: list[int]) -> int:
        return self.bm.allocate(seq_id, n, tokens).num_cached_tokens

    def append(self, seq_id: str, n: int, tokens: list[int]) -> None:
        self.bm.append(seq_id, n, tokens)

    def commit(self, seq_id: str, n: int) -> None:
        self.bm.commit(seq_id, n)

    def free(self, seq_id: str) -> None:
        self.bm.free(seq_id)

    def hit_tokens(self) -> tuple[int, int]:
        s = self.bm.stats()
        return s.prefix_hit_tokens, s.prefix_query_tokens

    def close(self) -> None:
        self.bm.check_invariants()


def run_prefix(
    trace: PrefixTrace, policy: str, num_blocks: int, concurrency: int, seed: int, use_grpc: bool
) -> dict[str, float]:
    bs = 16
    if use_grpc:
        core: GrpcCore | LocalCore = GrpcCore(
            num_gpu_blocks=num_blocks,
            block_size=bs,
            eviction_policy=policy,
            preemption_mode="off",
            watermark_fraction=0.0,
            log_level="warning",
        )
    else:
        core = LocalCore(
            num_gpu_blocks=num_blocks, block_size=bs, eviction_policy=policy, preemption_mode="off"
        )
    rng = random.Random(seed + 7)
    inflight: deque[str] = deque()
    any_hit = 0
    for i, (p, q, a) in enumerate(trace.requests):
        prompt = trace.prefixes[p] + [rng.randrange(VOCAB) for _ in range(q)]
        answer = [rng.randrange(VOCAB) for _ in range(a)]
        sid = f"q{i}"
        while True:
            try:
                cached = core.allocate(sid, len(prompt), prompt)
                break
            except ResourceExhausted:
                core.free(inflight.popleft())  # the oldest request finishes first
        any_hit += cached > 0
        inflight.append(sid)
        core.commit(sid, len(prompt))  # the prefill ran: its KV is written (only then a hit)
        while True:
            try:
                core.append(sid, len(answer), answer)
                break
            except ResourceExhausted:
                core.free(inflight.popleft())
        core.commit(sid, len(prompt) + len(answer))
        if len(inflight) > concurrency:
            core.free(inflight.popleft())
    hits, queried = core.hit_tokens()
    core.close()
    return {"hit_rate": hits / queried, "req_hit": any_hit / len(trace.requests)}


# --- 3. overload ------------------------------------------------------------------


def overload_trace(seed: int, num: int) -> tuple[list[int], list[tuple[list[int], int]]]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(1024)]
    reqs = []
    for _ in range(num):
        if rng.random() < 0.5:  # chat on a long shared system prompt
            prompt = system + [rng.randrange(VOCAB) for _ in range(rng.randint(8, 64))]
        else:  # a long private document
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(512, 1536))]
        reqs.append((prompt, rng.randint(64, 512)))
    return system, reqs


def run_overload(
    mode: str, seed: int, num: int, num_blocks: int, num_cpu: int, steps: int
) -> dict[str, float]:
    _, reqs = overload_trace(seed, num)
    bm = BlockManager(
        CoreConfig(
            num_gpu_blocks=num_blocks,
            block_size=16,
            num_cpu_blocks=num_cpu,
            preemption_mode=mode,
            eviction_policy="lru-size",
            watermark_blocks=num_blocks // 100,
        )
    )
    rng = random.Random(seed + 3)
    waiting: deque[str] = deque()
    tokens: dict[str, list[int]] = {}
    left: dict[str, int] = {}
    for i, (prompt, out) in enumerate(reqs):
        sid = f"o{i}"
        tokens[sid] = list(prompt)
        left[sid] = out
        waiting.append(sid)
    swapped: deque[str] = deque()
    running: list[str] = []
    completed = 0

    def handle(preempted: list) -> None:  # type: ignore[type-arg]
        for p in preempted:
            running.remove(p.seq_id)
            if p.mode == "swap":
                swapped.append(p.seq_id)
            else:
                waiting.appendleft(p.seq_id)

    step = 0
    while (waiting or swapped or running) and step < steps:
        step += 1
        # Swapped sequences first, then new or re-queued ones (vLLM's order).
        while swapped:
            try:
                bm.swap_in(swapped[0])
            except ResourceExhausted:
                break
            running.append(swapped.popleft())
        while waiting and not swapped:
            sid = waiting[0]
            try:
                bm.allocate(sid, len(tokens[sid]), tokens[sid])
            except ResourceExhausted:
                break
            running.append(waiting.popleft())
        if not running:
            continue
        ids = list(running)  # arrival order: earlier sequences grow (and preempt) first
        new = [rng.randrange(VOCAB) for _ in ids]
        # The last worker step computed everything but each sequence's newest token.
        r = bm.step(
            StepBatch(
                append_seq_ids=ids,
                append_token_ids=encode_tokens(new),
                commit_seq_ids=ids,
                commit_num_computed_tokens=[bm.seqs[s].num_tokens - 1 if s in bm.seqs else 0 for s in ids],
            )
        )
        handle(r.preempted)
        for err in r.append_errors:
            sid = err.seq_id
            if sid in running and err.code.name == "RESOURCE_EXHAUSTED":
                # It is itself the lowest-ranked: the frontend preempts it.
                preempted, _ = bm.preempt(sid)
                handle(preempted)
        failed = {e.seq_id for e in r.append_errors}
        for sid, tok in zip(ids, new, strict=True):
            if sid in failed:
                continue
            if sid in bm.seqs:
                tokens[sid].append(tok)
                left[sid] -= 1
                if left[sid] == 0:
                    bm.free(sid)
                    running.remove(sid)
                    completed += 1
    bm.check_invariants()
    st = bm.stats()
    return {
        "cost_s": st.preemption_cost_s,
        "completed": completed,
        "swap": st.num_preemptions_swap,
        "recompute": st.num_preemptions_recompute,
        "steps": step,
    }


# --- 4. overload through the engine, measured --------------------------------------

ENGINE_GPU_BLOCKS, ENGINE_CPU_BLOCKS = 96, 48


def engine_overload_trace(seed: int, num: int, vocab: int) -> list[tuple[list[int], int]]:
    """Experiment 3's shape, scaled to the tiny model: (prompt, output length) per request."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(256)]
    reqs = []
    for _ in range(num):
        if rng.random() < 0.5:
            prompt = system + [rng.randrange(vocab) for _ in range(rng.randint(4, 24))]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(128, 320))]
        reqs.append((prompt, rng.randint(24, 96)))
    return reqs


def calibrate_cost_model() -> dict[str, float]:
    """The cost-model settings that describe this machine and the tiny model (block manager flags)."""
    import torch

    from pagedkv.frontend.engine import GenerationRequest
    from pagedkv.frontend.launch.config import StackConfig
    from pagedkv.frontend.launch.local_stack import LocalStack
    from pagedkv.worker_svc.model.config import load_model_config

    cfg = load_model_config(None)
    block_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * 16  # K+V, fp32, 16 tokens
    src = torch.randn(ENGINE_CPU_BLOCKS, block_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first call pays torch's start-up
    best = math.inf
    for _ in range(50):  # the fastest of many: what the machine can do, not how busy it is right now
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    link = src.numel() * 4 / best
    with LocalStack(StackConfig(num_gpu_blocks=64, device="cpu", kernel_backend="reference")) as stack:
        engine = stack.engine()
        prompt = [1 + i % 250 for i in range(384)]
        engine.generate([GenerationRequest("warm", prompt[:64], max_tokens=1)])
        best = math.inf
        for i in range(3):
            t0 = time.perf_counter()
            engine.generate([GenerationRequest(f"cal{i}", [1 + i] + prompt, max_tokens=1)])  # no prefix hit
            best = min(best, time.perf_counter() - t0)
        prefill = (len(prompt) + 1) / best
    return {
        "kv_bytes_per_block": block_bytes,
        "host_link_gb_per_s": link / 1e9,
        "prefill_tokens_per_s": prefill,
    }


def run_overload_engine(mode: str, seed: int, num: int, cost_model: dict[str, float]) -> dict[str, object]:
    from pagedkv.frontend.engine import EngineConfig, GenerationRequest
    from pagedkv.frontend.launch.config import StackConfig
    from pagedkv.frontend.launch.local_stack import LocalStack

    overrides: dict[str, object] = {"preemption_mode": mode, "eviction_policy": "lru-size", **cost_model}
    with LocalStack(
        StackConfig(
            num_gpu_blocks=ENGINE_GPU_BLOCKS,
            num_cpu_blocks=ENGINE_CPU_BLOCKS,
            device="cpu",
            kernel_backend="reference",
            block_manager_overrides=overrides,
        )
    ) as stack:
        engine = stack.engine(EngineConfig(max_num_seqs=64, max_batch_tokens=256))
        reqs = [
            GenerationRequest(f"r{i}", p, max_tokens=n)
            for i, (p, n) in enumerate(engine_overload_trace(seed, num, engine.vocab_size))
        ]
        t0 = time.perf_counter()
        outs = engine.generate(reqs)
        wall = time.perf_counter() - t0
        st = engine.stats
        model_cost = stack.block_manager.servicer._core.stats().preemption_cost_s
    return {
        "wall_s": wall,
        "generated": st.generated_tokens,
        "computed": st.computed_tokens,
        "swap": st.preempted_swap,
        "recompute": st.preempted_recompute,
        "model_cost_s": model_cost,
        "completed": sum(1 for o in outs if o.finished),
        "steps": st.steps,
        "tokens": [c.token_ids for o in outs for c in o.completions],
    }


def report_overload_engine(seed: int, num: int, repeats: int = 2) -> bool:
    """Experiment 4's table (best wall time of ``repeats`` runs per mode: the same work each time, so
    the fastest run is the least disturbed by other load); True when every mode completed
    everything with the same tokens."""
    cal = calibrate_cost_model()
    print(
        f"4. Overload through the engine, measured ({num} requests all queued at once, {ENGINE_GPU_BLOCKS} "
        "GPU "
        f"blocks, {ENGINE_CPU_BLOCKS} CPU blocks; CPU backend, tiny model; cost model calibrated here: "
        "prefill "
        f"{cal['prefill_tokens_per_s']:,.0f} tokens/s, host copy {cal['host_link_gb_per_s']:.1f} GB/s; "
        f"best of {repeats} runs)"
    )
    print(
        "| policy           | wall s | generated tokens/s | tokens computed | swaps | recomputes | "
        "model cost (s) | completed |"
    )
    print(
        "|------------------|--------|--------------------|-----------------|-------|------------|"
        "----------------|-----------|"
    )
    res = {}
    for mode, label in (
        ("recompute", "always recompute"),
        ("swap", "always swap"),
        ("auto", "planner (auto)"),
    ):
        runs = [run_overload_engine(mode, seed, num, cal) for _ in range(repeats)]
        r = res[mode] = min(runs, key=lambda x: x["wall_s"])  # type: ignore[arg-type, return-value]
        r["tokens_stable"] = all(x["tokens"] == runs[0]["tokens"] for x in runs)
        print(
            f"| {label:<16} | {r['wall_s']:>6.2f} | {r['generated'] / r['wall_s']:>18,.0f} | "  # type: ignore[operator]
            f"{r['computed']:>15} | {r['swap']:>5} | {r['recompute']:>10} | {r['model_cost_s']:>14.4f} | "
            f"{r['completed']:>9} |"
        )
    same = res["recompute"]["tokens"] == res["swap"]["tokens"] == res["auto"]["tokens"] and all(
        r["tokens_stable"] for r in res.values()
    )
    done = all(r["completed"] == num for r in res.values())
    fastest = min(res, key=lambda m: res[m]["wall_s"])  # type: ignore[arg-type, return-value]
    print(
        f"greedy tokens identical across the three modes: {'yes' if same else 'NO'}; all completed: "
        f"{'yes' if done else 'NO'}; fastest measured: {fastest} (the planner is judged by this, not by its "
        "model; "
        "a shared machine makes wall times noisy)"
    )
    return same and done


# --- main -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny traces, for tests")
    parser.add_argument("--grpc", action="store_true", help="drive experiment 2 through a gRPC server")
    parser.add_argument(
        "--engine",
        action="store_true",
        help="also replay an overload trace through the engine on the CPU backend and time "
        "swap vs recompute vs planner (experiment 4)",
    )
    parser.add_argument("--engine-requests", type=int, default=24, help="requests in experiment 4")
    parser.add_argument(
        "--engine-repeats", type=int, default=2, help="runs per mode in experiment 4 (best counts)"
    )
    args = parser.parse_args(argv)
    smoke = args.smoke
    ok = True
    t0 = time.perf_counter()

    # 1
    num = 300 if smoke else 2000
    util = run_utilization(args.seed, num, rate=0.5 if smoke else 0.6)
    bar = 0.93 if smoke else 0.96
    print(f"1. KV utilization, ShareGPT-like trace ({num} requests, seed {args.seed}): tokens held / slots")
    print("| allocator                          | utilization | vLLM paper |")
    print("|------------------------------------|-------------|------------|")
    paper = {
        "contiguous-max": "20.4%",
        "contiguous-pow2": "26.8%",
        "contiguous-oracle": "38.2%",
        "paged-16": "96.3%",
    }
    labels = {
        "contiguous-max": "contiguous, reserve 2048 (max)",
        "contiguous-pow2": "contiguous, next power of 2",
        "contiguous-oracle": "contiguous, exact final length",
        "paged-8": "pagedkv, block 8",
        "paged-16": "pagedkv, block 16",
        "paged-32": "pagedkv, block 32",
    }
    for k in ("contiguous-max", "contiguous-pow2", "contiguous-oracle", "paged-8", "paged-16", "paged-32"):
        print(f"| {labels[k]:<34} | {util[k]:>10.1%} | {paper.get(k, ''):>10} |")
    passed = util["paged-16"] >= bar
    ok &= passed
    print(f"target: block 16 >= {bar:.0%}: {'ok' if passed else 'MISS'}\n")

    # 2
    n_req = 2000 if smoke else 4000
    n_pre = 150 if smoke else 300
    traces = [
        (prefix_trace("uniform sizes", args.seed, n_pre, n_req, "uniform"), 0.15),
        (prefix_trace("mixed sizes", args.seed + 1, n_pre, n_req, "mixed"), 0.15),
    ]
    print(
        f"2. Prefix caching under memory pressure ({n_req} requests over {n_pre} prefixes, Zipf 1.0"
        f"{', via gRPC' if args.grpc else ''})"
    )
    print("| trace         | pool blocks | policy   | hit rate (tokens) | requests with a hit |")
    print("|---------------|-------------|----------|-------------------|---------------------|")
    for trace, share in traces:
        distinct = sum(len(p) for p in trace.prefixes) // 16
        blocks = max(MAX_LEN // 16 * 3, int(distinct * share))
        res = {pol: run_prefix(trace, pol, blocks, 8, args.seed, args.grpc) for pol in ("lru", "lru-size")}
        for pol, r in res.items():
            print(
                f"| {trace.name:<13} | {blocks:>11} | {pol:<8} | {r['hit_rate']:>17.1%} | "
                f"{r['req_hit']:>19.1%} |"
            )
        need = 1.10 if trace.name.startswith("mixed") else 1.0
        passed = res["lru-size"]["hit_rate"] >= need * res["lru"]["hit_rate"]
        ok &= passed
        print(
            f"target ({trace.name}): lru-size >= {need:.2f} x lru: "
            f"{res['lru-size']['hit_rate'] / res['lru']['hit_rate']:.2f}x {'ok' if passed else 'MISS'}"
        )
    print()

    # 3
    n_over = 120 if smoke else 400
    steps = 30_000
    print(
        f"3. Overload ({n_over} requests all queued at once, 1024 GPU blocks, 512 CPU blocks; run to "
        "completion)"
    )
    print("| policy           | preemption cost (s) | swaps | recomputes | completed | steps |")
    print("|------------------|---------------------|-------|------------|-----------|-------|")
    over = {}
    for mode, label in (
        ("recompute", "always recompute"),
        ("swap", "always swap"),
        ("auto", "planner (auto)"),
    ):
        r = over[mode] = run_overload(mode, args.seed, n_over, 1024, 512, steps)
        print(
            f"| {label:<16} | {r['cost_s']:>19.3f} | {r['swap']:>5} | {r['recompute']:>10} | "
            f"{r['completed']:>9} | {r['steps']:>5} |"
        )
    best = min(over["recompute"]["cost_s"], over["swap"]["cost_s"])
    passed = over["auto"]["cost_s"] <= best + 1e-9 and all(r["completed"] == n_over for r in over.values())
    ok &= passed
    print(f"target: planner cost <= best fixed ({best:.3f} s): {'ok' if passed else 'MISS'}")
    if args.engine:
        print()
        ok &= report_overload_engine(args.seed, args.engine_requests, args.engine_repeats)
    print(f"\n(total {time.perf_counter() - t0:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
