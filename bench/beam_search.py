"""Beam search on forked blocks against n independent sequences: the KV blocks each holds.

One in-process stack (``LocalStack``: block manager, cache host, worker and engine as `pagedkv up`
builds them) on the model, prefix caching off so that only forks can share a block. For each beam
width n: one request with ``use_beam_search`` (GenerationRequest.beam, width n, no end token so
every beam runs --max-tokens), then the same prompt as n independent greedy requests of the same
length, then those n again on a stack with prefix caching on (what sharing by content alone gives).
Each row reports the most blocks the block manager held at once (read with GetStats after every
engine iteration) and the mean over the iterations, the copy-on-write copies the beams made, and
the blocks held once the requests were over (0: nothing leaks).

The beams share every block of their common prefix (the prompt's, and what they generated alike)
and copy only the block where they part; n independent sequences hold n copies of everything, and
with prefix caching they share the prompt's full blocks but not its last partial one, nor anything
they generate.

    python -m bench.beam_search [--model FILE_OR_DIR | --tiny] [--widths 2,4,8]
                                [--prompt-tokens 96] [--max-tokens 64] [--block-size 16]
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
from dataclasses import dataclass

from bench.kv_dtype_bench import smollm2_gguf
from pagedkv.frontend.engine import BeamParams, Engine, GenerationRequest
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.logging_setup import configure_logging

TEXT = (
    "The lighthouse stood at the edge of the cliff, its lamp turning slowly through the fog. "
    "Every night the keeper climbed the spiral stairs, trimmed the wick and watched the ships "
    "pass far below, counting their lights and writing their names in a worn leather book. "
)


@dataclass(slots=True, frozen=True)
class Held:
    """Blocks the block manager held while requests ran: the most at once, the mean over the
    engine's iterations, the copy-on-write copies made, and what was left once they were over."""

    peak: int
    mean: float
    cow_copies: int
    after: int


def measure(engine: Engine, requests: list[GenerationRequest]) -> Held:
    cow0 = engine.bm.get_stats().num_cow_copies
    for r in requests:
        engine.add_request(r)
    used: list[int] = []
    while engine.has_work():
        engine.step()
        used.append(engine.bm.get_stats().num_used_blocks)
    engine.flush()
    for r in requests:
        engine.release_request(r.request_id)
    s = engine.bm.get_stats()
    return Held(max(used), statistics.fmean(used), s.num_cow_copies - cow0, s.num_used_blocks)


def prompt_ids(model: str | None, vocab: int, length: int) -> list[int]:
    """``length`` tokens of English text where the model has a tokenizer, else seeded random ids."""
    if model is not None:
        from pagedkv.frontend.serve.text import load_model_text

        text = load_model_text(model)
        if text.tokenizer is not None:
            ids = text.encode(TEXT * (1 + length // 40), False)
            return [int(t) for t in ids[:length]]
    rng = random.Random(0)
    return [rng.randrange(1, vocab) for _ in range(length)]


def stack(model: str | None, block_size: int, prefix_caching: bool) -> LocalStack:
    return LocalStack(
        StackConfig(
            model=model,
            device="cpu",
            block_size=block_size,
            num_gpu_blocks=1024,
            block_manager_overrides={"enable_prefix_caching": prefix_caching},
        )
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the packaged SmolLM2)")
    p.add_argument("--tiny", action="store_true", help="the built-in tiny random Llama instead (quick)")
    p.add_argument("--widths", default="2,4,8", help="beam widths n, comma-separated (at most 10)")
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens every beam and sequence generates")
    p.add_argument("--block-size", type=int, default=16)
    a = p.parse_args(argv)
    configure_logging("warning", "console")
    packaged = smollm2_gguf()
    model = None if a.tiny else a.model or (str(packaged) if packaged is not None else None)
    widths = [int(w) for w in a.widths.split(",")]
    bs, length = a.block_size, a.max_tokens
    rows = []
    with stack(model, bs, prefix_caching=False) as st:
        engine = st.engine()
        prompt = prompt_ids(model, engine.vocab_size, a.prompt_tokens)
        for n in widths:
            beam = measure(engine, [GenerationRequest(f"beam{n}", prompt, length, n=n, beam=BeamParams())])
            apart = measure(engine, [GenerationRequest(f"seq{n}-{i}", prompt, length) for i in range(n)])
            rows.append([n, beam, apart])
    with stack(model, bs, prefix_caching=True) as st:
        engine = st.engine()
        for row in rows:
            n = row[0]
            reqs = [GenerationRequest(f"cached{n}-{i}", prompt, length) for i in range(n)]
            row.append(measure(engine, reqs))
    print(
        f"model {pathlib.Path(model).name if model else 'the built-in tiny Llama'}, block size {bs}, "
        f"prompt {len(prompt)} tokens, "
        f"{length} generated per beam or sequence (no end token)\n"
    )
    print(
        "| n | beam search: peak blocks (mean) | n independent: peak (mean) | beam / independent "
        "| n independent, prefix cache on: peak (mean) | beams' copy-on-write copies "
        "| blocks held after (beam, independent, cached) |"
    )
    print("|---|---|---|---|---|---|---|")
    for n, beam, apart, cached in rows:
        print(
            f"| {n} | {beam.peak} ({beam.mean:.1f}) | {apart.peak} ({apart.mean:.1f}) "
            f"| {beam.peak / apart.peak:.2f} | {cached.peak} ({cached.mean:.1f}) | {beam.cow_copies} "
            f"| {beam.after}, {apart.after}, {cached.after} |"
        )


if __name__ == "__main__":
    main()
