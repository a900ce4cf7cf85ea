"""The worker layouts on a GPU: one mixed worker, two mixed workers, prefill + decode, on one cache.

    python -m bench.gpu.pd_check            # on a GPU machine; about 3-5 minutes
    python -m bench.gpu.pd_check --short    # the form bench/gpu_check.sh runs

A thin wrapper over bench/pd_bench.py with ``--device cuda --dtype bfloat16``. The full form uses a
model big enough for the GPU to matter (hidden 2048, 8 layers: a 2.2 GB fp32 checkpoint written
and loaded per layout), all three layouts, and each again with ``--overlap``: six stacks. The short
form is sized for gpu_check.sh's section budget: a small model (hidden 512, 4 layers, vocab 8192:
about 50 MB), two layouts (mixed x1 and prefill+decode: the baseline and the disaggregated one),
no ``--overlap``, fewer tokens. Every layout's cache host loads the weights once and the workers map
them by CUDA IPC. It prints pd_bench's table (throughput, TTFT, TPOT per layout, ratios to the single
worker) and how many requests' greedy tokens differ between layouts (bf16: batch shapes differ
between layouts, so a near-tie may flip; fp32 on CPU must show 0). Exit code 0 when every layout ran.
Arguments after the form's flags go to pd_bench (they override: argparse keeps the last value).

Without MPS the role processes time-slice the GPU; with the MPS control daemon running
(docs/worker.md "GPU: SM shares with CUDA MPS"), set CUDA_MPS_ACTIVE_THREAD_PERCENTAGE per worker.
"""

from __future__ import annotations

import sys

from bench import pd_bench

FULL = [
    "--device",
    "cuda",
    "--dtype",
    "bfloat16",
    "--hidden",
    "2048",
    "--layers",
    "8",
    "--vocab",
    "32000",
    "--decoders",
    "32",
    "--decode-tokens",
    "128",
    "--long",
    "8",
    "--long-prompt",
    "2048",
    "--long-every-s",
    "0.2",
    "--max-batch-tokens",
    "2048",
    "--num-gpu-blocks",
    "4096",
    "--overlap",
]
SHORT = [
    "--device",
    "cuda",
    "--dtype",
    "bfloat16",
    "--hidden",
    "512",
    "--layers",
    "4",
    "--vocab",
    "8192",
    "--decoders",
    "16",
    "--decode-tokens",
    "32",
    "--long",
    "2",
    "--long-prompt",
    "1024",
    "--long-every-s",
    "0.2",
    "--max-batch-tokens",
    "2048",
    "--num-gpu-blocks",
    "2048",
    "--layouts",
    "mixed,prefill+decode",
]


def pd_args(argv: list[str]) -> list[str]:
    """pd_bench's arguments for ``argv`` (``--short`` picks the short form; the rest passes through)."""
    rest = [a for a in argv if a != "--short"]
    return (SHORT if len(rest) < len(argv) else FULL) + rest


def main(argv: list[str] | None = None) -> int:
    return pd_bench.main(pd_args(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    pd_bench.exit_on_sigterm()
    raise SystemExit(main())
