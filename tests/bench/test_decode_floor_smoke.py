"""bench/decode_floor.py runs end to end on a small Q4_1 GGUF, its derived columns are its own
figures' arithmetic, and the file's model gives the same greedy tokens on either integer kernel."""

from __future__ import annotations

import pathlib
import re

import pytest

from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.kernels.cpu import quant_linear as cpu_quant_linear
from tests.bench.tables import run_bench
from tests.worker_svc.families import small_q4_1_llama

pytest.importorskip("gguf")


def _table(stdout: str, header: str) -> list[list[str]]:
    """The data rows of the markdown table whose header starts with ``header``."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header}"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


@pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built: nothing to compare")
def test_decode_floor_quick(tmp_path: pathlib.Path) -> None:
    hf, path = small_q4_1_llama(tmp_path, 3, "m.Q4_1.gguf")
    out = run_bench(
        "decode_floor",
        *("--model", str(path), "--threads", "1", "--tokens", "2", "--rounds", "2", "--reps", "1"),
        *("--rows", "1", "3"),
        timeout=300,
    )
    bw = float(re.search(r"read bandwidth ([\d.]+) GB/s", out).group(1))  # type: ignore[union-attr]
    steps = _table(out, "weights")
    words = cpu_quant_linear.word_products()  # then a row with them off: fp32 products, same x
    assert [r[1] for r in steps] == [
        "native",
        "native-int8+native-int4",
        "native-int8+native-int4",
        *(["native-int8+native-int4"] if words else []),
        "int8+int4",
    ]
    assert [r[0] for r in steps][1 : 4 if words else 3] == [
        "the file's own quantization",
        "the file's own quantization, per-call layers",
        *(["the file's own quantization, fp32 products"] if words else []),
    ]
    for _, _, mb, floor_ms, flat_ms, read_ms, step_ms, ratio, read_ratio, gbs in steps:
        assert abs(float(floor_ms) - float(mb) / bw) <= 0.01 + 0.06 * float(floor_ms)  # MB / (GB/s) = ms
        assert abs(float(ratio.rstrip("x")) - float(step_ms) / float(floor_ms)) <= 0.01 + 0.06 * float(
            ratio[:-1]
        )
        assert float(read_ms) > 0 and float(flat_ms) > 0
        assert abs(float(read_ratio.rstrip("x")) - float(step_ms) / float(read_ms)) <= 0.01 + 0.06 * float(
            read_ratio[:-1]
        )
        assert abs(float(gbs) - float(mb) / float(step_ms)) <= 0.01 + 0.06 * float(gbs)
    assert "every path (one call, per call, fp32 products, torch's ops), same greedy tokens: True" in out
    kernels = _table(out, "linear kernel")
    labels = [r[0].split(" (")[0] for r in kernels]
    tiles = words and cpu_quant_linear.tile_products()  # the int4 rows as alone again, tiles off
    each = [
        "native fp32",
        "native int4",
        *(["native int4, AMX tiles off"] if tiles else []),
        *(["native int4, rows as alone"] if words else []),
        *(["native int4, rows as alone, AMX tiles off"] if tiles else []),
        "torch int4 op",
        "native int8",
        *(["native int8, rows as alone"] if words else []),
        "torch int8 op",
    ]
    assert labels == each * 2 and [r[1] for r in kernels] == ["1"] * len(each) + ["3"] * len(each)
    for _, _, mb, ms, gbs, ratio in kernels:
        assert abs(float(gbs) - float(mb) / float(ms)) <= 0.01 + 0.06 * float(gbs)
        assert abs(float(ratio.rstrip("x")) - float(ms) / (float(mb) / bw)) <= 0.01 + 0.06 * float(ratio[:-1])
