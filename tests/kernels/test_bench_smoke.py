"""bench/kernel_bench.py --smoke runs on CPU (interpreter vs reference) and writes its results."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU smoke test of the interpreter; on a GPU the bench runs for real"
)
def test_kernel_bench_smoke(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")  # smoke mode is for CPU
    env.pop("PAGEDKV_KERNEL_BACKEND", None)
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.kernel_bench",
            "--smoke",
            "--dtypes",
            "float32",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = (tmp_path / "results.md").read_text()
    for section in ("copy_bw", "decode", "prefill", "write_kv", "copy_blocks"):
        assert f"## {section}" in md
    assert "## errors" not in md
    assert (tmp_path / "results.json").exists()
    assert proc.stdout.rstrip().endswith(md.rstrip().splitlines()[-1])  # the table is printed last
