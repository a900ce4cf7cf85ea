"""Worker layouts on one shared cache under a mixed workload: throughput, TTFT, TPOT.

    python -m bench.pd_bench                # the three layouts (and both thread settings of one worker)
    python -m bench.pd_bench --memory       # also resident memory per worker, 1 and 2 workers,
                                            # shared vs local weights
    python -m bench.pd_bench --layouts mixed,prefill+decode   # a subset (mixed, the baseline, always)

The workload (the same in every layout): ``--decoders`` short-prompt requests that decode
``--decode-tokens`` tokens each start at t=0; while they decode, ``--long`` long prompts
(``--long-prompt`` tokens, ``--long-tokens`` output tokens each) arrive every ``--long-every-s``
seconds. The model is a random Llama with hidden 512 and 6 layers (compute dominates), fp32 on CPU.

Layouts, each a real ``pagedkv up`` stack (block manager, cache host with shared weights, workers):
- ``mixed x1 (tN)``: one mixed worker on all CPUs with N torch threads (N = 1 and N = #CPUs; the
  better one is the baseline the ratios divide by);
- ``mixed x2``: two mixed workers, each pinned to its own CPUs; each iteration split by tokens;
- ``prefill+decode``: a prefill worker and a decode worker, each pinned to its own CPUs; the
  engine's decode pipeline never waits for a prefill chunk.

Columns: generated tok/s = all generated tokens / (last token time - first arrival); TTFT = first
token time - arrival, per request; TPOT = (last token time - first token time) / (tokens - 1), per
request with >= 2 tokens; ITL = gap between consecutive tokens of one request, over all gaps;
p50/p99 over requests (TTFT, TPOT) or gaps (ITL); idle = mean gap between the end of one
synchronous worker call and the start of the next (the engine and block manager's share of a
step; ``--overlap`` runs each layout again with the next decode slots reserved while the workers
compute). The engine, block manager and cache host share the machine's CPUs with the workers.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.frontend.clients.worker import WorkerClient
from pagedkv.frontend.engine import Engine, EngineConfig, GenerationRequest
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.processes import Stack
from pagedkv.ports import free_port_block


# ------------------------------------------------------------------------------ the model
def make_model(path: pathlib.Path, hidden: int, layers: int, vocab: int, seed: int = 0) -> pathlib.Path:
    """A random Llama checkpoint (config.json + model.safetensors), written with pagedkv's own
    loader's names."""
    from safetensors.torch import save_file

    from pagedkv.worker_svc.model.config import ModelConfig
    from pagedkv.worker_svc.model.weights import random_weights

    path.mkdir(parents=True, exist_ok=True)
    heads = hidden // 64
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": hidden * 3,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    (path / "config.json").write_text(json.dumps(cfg))
    mcfg = ModelConfig.from_dir(path)
    save_file(
        {
            k: v.contiguous()
            for k, v in random_weights(mcfg, torch.float32, torch.device("cpu"), seed).items()
        },
        str(path / "model.safetensors"),
    )
    return path


# ------------------------------------------------------------------------------ the stack


@dataclass(slots=True)
class Layout:
    name: str
    num_workers: int
    roles: tuple[str, ...] = ()
    pin: bool = False
    worker_args: tuple[str, ...] = ()
    overlap: bool = False  # EngineConfig.overlap_block_manager
    share_weights: bool = True  # False: the cache host shares none, every worker loads its own


LAYOUT_KEYS = ("mixed", "mixed-x2", "prefill+decode")  # --layouts: one mixed worker, two, prefill + decode


@contextlib.contextmanager
def running(
    layout: Layout,
    model: pathlib.Path,
    blocks: int,
    log_dir: pathlib.Path,
    device: str = "cpu",
    dtype: str = "float32",
) -> Iterator[Stack]:
    base = free_port_block(2 + layout.num_workers)
    opts = StackConfig(
        block_manager_port=base,
        cache_host_port=base + 1,
        worker_port=base + 2,
        num_workers=layout.num_workers,
        num_gpu_blocks=blocks,
        num_cpu_blocks=0,
        block_size=16,
        model=str(model),
        device=device,
        dtype=dtype,
        log_format="json",
        log_dir=str(log_dir / layout.name.replace(" ", "_")),
        shm_prefix=f"pagedkv-pdbench-{os.getpid()}",
        roles=layout.roles,
        pin_workers=layout.pin,
        worker_args=layout.worker_args,
        share_weights=layout.share_weights,
    )
    stack = Stack(opts, out=io.StringIO())
    try:  # start inside: a SIGTERM during start-up (SystemExit, see main) still stops what started
        stack.start()
        yield stack
    finally:
        leaked = stack.stop()
        if leaked:
            raise RuntimeError(f"shared memory left behind: {leaked}")


# ------------------------------------------------------------------------------ the workload
@dataclass(slots=True)
class Arrival:
    at_s: float
    request: GenerationRequest


def workload(args: argparse.Namespace, vocab: int) -> list[Arrival]:
    g = torch.Generator().manual_seed(args.seed)

    def prompt(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    out = [
        Arrival(0.0, GenerationRequest(f"d{i}", prompt(args.decode_prompt), max_tokens=args.decode_tokens))
        for i in range(args.decoders)
    ]
    out += [
        Arrival(
            args.long_start_s + i * args.long_every_s,
            GenerationRequest(f"p{i}", prompt(args.long_prompt), max_tokens=args.long_tokens),
        )
        for i in range(args.long)
    ]
    return out


@dataclass(slots=True)
class Result:
    layout: str
    generated: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    idle_ms: float = 0.0
    tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.generated / self.wall_s


def pct(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def drive(stack: Stack, arrivals: list[Arrival], layout: Layout, max_batch_tokens: int) -> Result:
    """Add each request at its arrival time, step the engine, time every token."""
    bm = BlockManagerClient(stack.services[0].address)
    workers = [WorkerClient(s.address) for s in stack.services[2:]]
    engine = Engine(
        bm,
        workers,
        EngineConfig(
            max_num_seqs=256,
            max_batch_tokens=max_batch_tokens,
            timeout_s=60,
            overlap_block_manager=layout.overlap,
        ),
    )
    try:
        pending = sorted(arrivals, key=lambda a: a.at_s)
        arrived: dict[str, float] = {}
        times: dict[str, list[float]] = {}
        t0 = time.perf_counter()
        while pending or engine.has_work():
            now = time.perf_counter() - t0
            while pending and pending[0].at_s <= now:
                a = pending.pop(0)
                engine.add_request(a.request)
                arrived[a.request.request_id] = time.perf_counter()
                times[a.request.request_id] = []
            if not engine.has_work():
                time.sleep(max(0.0, pending[0].at_s - now))
                continue
            for ev in engine.step():
                times[ev.request_id].append(time.perf_counter())
        end = max(t for ts in times.values() for t in ts)
        res = Result(layout.name, sum(len(ts) for ts in times.values()), end - t0)
        for rid, ts in times.items():
            res.ttft_s.append(ts[0] - arrived[rid])
            if len(ts) >= 2:
                res.tpot_s.append((ts[-1] - ts[0]) / (len(ts) - 1))
                res.itl_s.extend(b - a for a, b in zip(ts, ts[1:], strict=False))
        st = engine.stats
        res.idle_ms = 1e3 * st.worker_idle_s / max(1, st.worker_idle_gaps)
        res.tokens = {rid: engine.outputs[rid].completions[0].token_ids for rid in times}
        return res
    finally:
        engine.close()
        bm.close()
        for w in workers:
            w.close()


# ------------------------------------------------------------------------------ memory
def smaps_rollup(pid: int) -> dict[str, int]:
    """Rss / Pss (kB) of a process; Pss splits each shared page among the processes mapping it."""
    out: dict[str, int] = {}
    for line in pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] in ("Rss:", "Pss:", "Pss_Shmem:", "Shared_Clean:", "Private_Dirty:"):
            out[parts[0].rstrip(":")] = int(parts[1])
    return out


def memory_table(model: pathlib.Path, blocks: int, log_dir: pathlib.Path) -> str:
    """RSS / PSS of the cache host and each worker after a short generation, 1 and 2 workers, with
    the cache host's shared weights (default) and with a private copy loaded by each worker (the
    cache host started with --no-share-weights). "all" is the sum over the cache host and workers:
    what the deployment costs; the step from 1 to 2 workers is what one more worker costs."""
    rows = ["| weights | workers | process | RSS MiB | PSS MiB |", "|---|---:|---|---:|---:|"]
    for weights in ("shared", "local"):
        for n in (1, 2):
            layout = Layout(f"mem-{weights}-{n}", n, share_weights=weights == "shared")
            with running(layout, model, blocks, log_dir) as stack:
                # Generate first: a page counts in RSS/PSS only once touched (every weight is read
                # by a forward pass; a loaded checkpoint may still sit in the page cache).
                warm = [
                    Arrival(0.0, GenerationRequest(f"m{i}", [1 + i] * 64, max_tokens=8)) for i in range(4)
                ]
                drive(stack, warm, layout, 512)
                total = 0
                for svc in stack.services[1:]:
                    assert svc.process is not None
                    m = smaps_rollup(svc.process.pid)
                    total += m["Pss"]
                    rows.append(
                        f"| {weights} | {n} | {svc.name} | {m['Rss'] / 1024:.0f} | {m['Pss'] / 1024:.0f} |"
                    )
                rows.append(f"| {weights} | {n} | **all** | | **{total / 1024:.0f}** |")
    return "\n".join(rows)


# ------------------------------------------------------------------------------ main
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--decoders", type=int, default=16, help="short-prompt requests decoding from t=0")
    p.add_argument("--decode-prompt", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--long", type=int, default=6, help="long prompts arriving while the others decode")
    p.add_argument("--long-prompt", type=int, default=256)
    p.add_argument("--long-tokens", type=int, default=8)
    p.add_argument("--long-start-s", type=float, default=0.3)
    p.add_argument("--long-every-s", type=float, default=0.4)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--num-gpu-blocks", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device", default="cpu", help="cpu, or cuda (bench/gpu_pd_check.py): no CPU pinning then"
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--memory", action="store_true", help="also measure RSS/PSS per process (1 and 2 workers)")
    p.add_argument("--memory-only", action="store_true", help="only the memory table")
    p.add_argument(
        "--overlap",
        action="store_true",
        help="also run every layout with EngineConfig(overlap_block_manager=True): idle gap before/after",
    )
    p.add_argument(
        "--x1-threads",
        default="1,all",
        help="on CPU: the torch thread counts of the mixed x1 layouts (all = every CPU)",
    )
    p.add_argument(
        "--layouts",
        default=",".join(LAYOUT_KEYS),
        help=f"comma-separated subset of {','.join(LAYOUT_KEYS)} (mixed is the baseline: always run)",
    )
    p.add_argument("--json", default="", help="write the results here too")
    args = p.parse_args(argv)
    wanted = {k.strip() for k in args.layouts.split(",") if k.strip()}
    if not wanted <= set(LAYOUT_KEYS) or "mixed" not in wanted:
        p.error(f"--layouts {args.layouts!r}: a subset of {','.join(LAYOUT_KEYS)} that includes mixed")

    ncpu = len(os.sched_getaffinity(0))
    cpu = args.device == "cpu"
    threads = sorted({ncpu if t.strip() == "all" else int(t) for t in args.x1_threads.split(",")})
    layouts = (
        [Layout(f"mixed x1 (t{t})", 1, worker_args=("--num-threads", str(t))) for t in threads]
        if cpu
        else [Layout("mixed x1", 1)]
    )
    if "mixed-x2" in wanted:
        layouts.append(Layout("mixed x2", 2, pin=cpu))
    if "prefill+decode" in wanted:
        layouts.append(Layout("prefill+decode", 2, roles=("prefill", "decode"), pin=cpu))
    if args.overlap:
        layouts += [
            Layout(f"{x.name} +overlap", x.num_workers, x.roles, x.pin, x.worker_args, overlap=True)
            for x in list(layouts)
        ]
    with tempfile.TemporaryDirectory(prefix="pd-bench-") as tmp:
        model = make_model(
            pathlib.Path(tmp) / f"llama-h{args.hidden}-l{args.layers}", args.hidden, args.layers, args.vocab
        )
        if args.memory_only:
            print(memory_table(model, args.num_gpu_blocks, pathlib.Path(tmp) / "logs"))
            return 0
        arrivals = workload(args, args.vocab)
        results: list[Result] = []
        for layout in layouts:
            with running(
                layout, model, args.num_gpu_blocks, pathlib.Path(tmp) / "logs", args.device, args.dtype
            ) as stack:
                results.append(drive(stack, arrivals, layout, args.max_batch_tokens))
            print(f"  ran {layout.name}: {results[-1].tok_s:.1f} tok/s", file=sys.stderr, flush=True)
        mem = (
            memory_table(model, args.num_gpu_blocks, pathlib.Path(tmp) / "logs")
            if args.memory and cpu
            else ""
        )

    singles = [r for r in results if r.layout.startswith("mixed x1") and not r.layout.endswith("+overlap")]
    base = max(singles, key=lambda r: r.tok_s)
    differ = max(sum(r.tokens[k] != base.tokens[k] for k in base.tokens) for r in results)
    print(
        f"model hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, {args.dtype} on "
        f"{args.device}, "
        f"{ncpu} CPUs; "
        f"{args.decoders} decoders ({args.decode_prompt}+{args.decode_tokens} tokens) + {args.long} long "
        "prompts "
        f"({args.long_prompt}+{args.long_tokens}) every {args.long_every_s}s; baseline = {base.layout}; "
        f"requests whose greedy tokens differ from the baseline's (most in any layout): {differ}"
    )
    print(
        "| layout | generated tok/s | x single | TTFT p50 / p99 ms | TPOT p50 / p99 ms | x single TPOT p99 | "
        "ITL p99 ms | idle gap ms |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.layout} | {r.tok_s:.1f} | {r.tok_s / base.tok_s:.2f} | "
            f"{1e3 * pct(r.ttft_s, 50):.0f} / {1e3 * pct(r.ttft_s, 99):.0f} | "
            f"{1e3 * pct(r.tpot_s, 50):.1f} / {1e3 * pct(r.tpot_s, 99):.1f} | "
            f"{pct(r.tpot_s, 99) / pct(base.tpot_s, 99):.2f} | {1e3 * pct(r.itl_s, 99):.0f} | "
            f"{r.idle_ms:.2f} |"
        )
    if mem:
        print()
        print(mem)
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(
                [
                    {
                        "layout": r.layout,
                        "tok_s": r.tok_s,
                        "ttft_p50_s": pct(r.ttft_s, 50),
                        "ttft_p99_s": pct(r.ttft_s, 99),
                        "tpot_p50_s": pct(r.tpot_s, 50),
                        "tpot_p99_s": pct(r.tpot_s, 99),
                        "itl_p99_s": pct(r.itl_s, 99),
                        "idle_ms": r.idle_ms,
                    }
                    for r in results
                ],
                indent=1,
            )
        )
    return 0


def exit_on_sigterm() -> None:
    """SIGTERM (gpu_check.sh's section timeout) unwinds like Ctrl-C: the running stack's ``with``
    stops its services, which run in sessions of their own and would otherwise outlive this process.
    For the scripts' entry points only (a library caller keeps its own signal handling)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


if __name__ == "__main__":
    exit_on_sigterm()
    raise SystemExit(main())
