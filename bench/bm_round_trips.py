"""Block-manager round trips per engine iteration: every iteration, deferred appends, and deferred
appends with blocks granted ahead.

Every decode iteration used to make one block-manager Step, only to append a slot per sequence.
With ``EngineConfig.defer_appends`` (the default) an iteration in which no block table changes
makes none; with ``EngineConfig.grant_ahead_tokens`` (on by default) a Step made anyway also grants
the sequences near the end of their blocks their next block, so crossing a block boundary needs no
Step either. With ``EngineConfig.decode_steps`` (multi-step decode, 4 by default) an iteration also
serves several tokens of each sequence. This counts Steps and iterations for one sequence and for
many, on the in-process stack with the built-in tiny model (the count does not depend on the
model), each request a random prompt and the same number of generated tokens. The modes run one
after the other on one stack per row group, on the same requests, with the prefix cache emptied
between them.

    python -m bench.bm_round_trips [--sequences 1,32] [--max-tokens 128] [--block-size 16]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from pagedkv.arith import ceil_div
from pagedkv.defaults import DECODE_STEPS
from pagedkv.frontend.engine import EngineConfig, GenerationRequest
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.logging_setup import configure_logging

# (label, EngineConfig fields): the three ways an engine can talk to the block manager, one decode
# step an iteration; then the default, which also runs several decode steps in one worker call.
MODES: dict[str, dict[str, object]] = {
    "every iteration": {"defer_appends": False, "decode_steps": 1},
    "deferred appends": {"defer_appends": True, "grant_ahead_tokens": 0, "decode_steps": 1},
    "deferred + granted ahead": {"defer_appends": True, "decode_steps": 1},
    f"deferred + granted ahead + {DECODE_STEPS} decode steps a call": {"defer_appends": True},
}


@dataclass(slots=True, frozen=True)
class Row:
    sequences: int
    mode: str
    iterations: int
    steps: int
    blocks_granted: int
    tokens: int

    @property
    def per_iteration(self) -> float:
        return self.steps / self.iterations


def requests(sequences: int, max_tokens: int, seed: int = 0) -> list[GenerationRequest]:
    rng = random.Random(seed)
    return [
        GenerationRequest(
            f"r{i}", [rng.randrange(1, 200) for _ in range(rng.randrange(20, 200))], max_tokens=max_tokens
        )
        for i in range(sequences)
    ]


def measure(sequences: int, max_tokens: int, block_size: int, modes: list[str]) -> list[Row]:
    """Each mode's engine on one stack, the same requests, the prefix cache emptied before each."""
    blocks = sequences * (ceil_div(200 + max_tokens, block_size) + 1) + 64
    rows = []
    with LocalStack(StackConfig(num_gpu_blocks=blocks, block_size=block_size)) as stack:
        for mode in modes:
            engine = stack.engine(EngineConfig(max_num_seqs=max(sequences, 1), **MODES[mode]))  # type: ignore[arg-type]
            try:
                engine.bm.reset_prefix_cache()
                engine.generate(requests(sequences, max_tokens))
                s = engine.stats
                granted, tokens = s.blocks_granted_ahead, s.generated_tokens
                rows.append(Row(sequences, mode, s.steps, s.bm_round_trips, granted, tokens))
            finally:
                engine.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", default="1,32", help="comma-separated numbers of requests run at once")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens each request generates")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    configure_logging("warning", "console")
    print(
        "| sequences | block-manager calls | engine iterations | block-manager Steps | Steps per iteration "
        "| blocks granted ahead | Steps per generated token |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.sequences.split(",")):
        for r in measure(n, args.max_tokens, args.block_size, modes):
            print(
                f"| {r.sequences} | {r.mode} | {r.iterations} | {r.steps} | {r.per_iteration:.3f} "
                f"| {r.blocks_granted} | {r.steps / r.tokens:.3f} |"
            )


if __name__ == "__main__":
    main()
