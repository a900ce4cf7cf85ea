"""Block-manager round trips per engine iteration, with and without deferred appends.

Every decode iteration used to make one block-manager Step, only to append a slot per sequence.
With ``EngineConfig.defer_appends`` (the default) an iteration in which no block table changes
makes none: this counts Steps and iterations for one sequence and for many, on the in-process
stack with the built-in tiny model (the count does not depend on the model), each request a random
prompt and the same number of generated tokens.

    python -m bench.bm_round_trips [--sequences 1,32] [--max-tokens 128] [--block-size 16]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from frontend.engine import EngineConfig, GenerationRequest
from frontend.launch.config import StackConfig
from frontend.launch.local_stack import LocalStack
from pagedkv.logging_setup import configure_logging


@dataclass(slots=True, frozen=True)
class Row:
    sequences: int
    defer_appends: bool
    iterations: int
    steps: int

    @property
    def per_iteration(self) -> float:
        return self.steps / self.iterations


def measure(sequences: int, defer_appends: bool, max_tokens: int, block_size: int, seed: int = 0) -> Row:
    rng = random.Random(seed)
    blocks = sequences * -(-(200 + max_tokens) // block_size) + 64
    with LocalStack(StackConfig(num_gpu_blocks=blocks, block_size=block_size)) as stack:
        engine = stack.engine(EngineConfig(max_num_seqs=max(sequences, 1), defer_appends=defer_appends))
        try:
            requests = [
                GenerationRequest(
                    f"r{i}",
                    [rng.randrange(1, 200) for _ in range(rng.randrange(20, 200))],
                    max_tokens=max_tokens,
                )
                for i in range(sequences)
            ]
            engine.generate(requests)
            return Row(sequences, defer_appends, engine.stats.steps, engine.stats.bm_round_trips)
        finally:
            engine.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", default="1,32", help="comma-separated numbers of requests run at once")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens each request generates")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)
    configure_logging("warning", "console")
    print("| sequences | defer_appends | engine iterations | block-manager Steps | Steps per iteration |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in args.sequences.split(",")):
        for defer in (False, True):
            r = measure(n, defer, args.max_tokens, args.block_size)
            print(
                f"| {r.sequences} | {r.defer_appends} | {r.iterations} | {r.steps} | {r.per_iteration:.3f} |"
            )


if __name__ == "__main__":
    main()
