"""The worker layouts on a GPU: one mixed worker, two mixed workers, prefill + decode, on one cache.

    python bench/gpu_pd_check.py            # on a GPU machine; about 3-5 minutes (gpu_check.sh runs a short form)

A thin wrapper over bench/pd_bench.py with ``--device cuda --dtype bfloat16`` and a model big
enough for the GPU to matter (hidden 2048, 8 layers). Every layout's cache host loads the weights
once and the workers map them by CUDA IPC. It prints pd_bench's table (throughput, TTFT, TPOT per
layout, ratios to the single worker) and how many requests' greedy tokens differ between layouts
(bf16: batch shapes differ between layouts, so a near-tie may flip; fp32 on CPU must show 0).
Exit code 0 when every layout ran.

Without MPS the role processes time-slice the GPU; with the MPS control daemon running
(docs/worker.md "GPU: SM shares with CUDA MPS"), set CUDA_MPS_ACTIVE_THREAD_PERCENTAGE per worker.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import pd_bench  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    defaults = ["--device", "cuda", "--dtype", "bfloat16", "--hidden", "2048", "--layers", "8",
                "--vocab", "32000", "--decoders", "32", "--decode-tokens", "128", "--long", "8",
                "--long-prompt", "2048", "--long-every-s", "0.2", "--max-batch-tokens", "2048",
                "--num-gpu-blocks", "4096", "--overlap"]
    return pd_bench.main(defaults + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    raise SystemExit(main())
