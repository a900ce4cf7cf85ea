"""Running a bench/ script the way its smoke test does, and reading its markdown table back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(module: str, *args: str, timeout: float = 120) -> str:
    """``python -m bench.<module> args...`` from the repository root; its stdout, after asserting it
    exited 0. Without the suite's ``TRITON_INTERPRET``: a bench runs the kernels a user's run does
    (on CPU the native ones; Triton's interpreter would make it about ten times slower)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def data_rows(stdout: str) -> list[list[str]]:
    """The cells of each markdown table row whose first cell is a number (header and rule skipped)."""
    return [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in stdout.splitlines()
        if line.startswith("| ") and line[2].isdigit()
    ]
