"""bench/kv_dtype_bench.py runs end to end on small sizes, and its figures are its own arithmetic:
blocks per GiB from the capacity module, ratios from its own columns, more blocks for int8 at one budget."""

from __future__ import annotations

import re

from pagedkv import kv_capacity
from tests.bench.tables import run_bench


def test_kv_dtype_bench_quick() -> None:
    out = run_bench(
        "kv_dtype_bench",
        "--parts",
        "capacity,trace,decode",
        "--threads",
        "1",
        "--requests",
        "80",
        "--budget-mib",
        "64",
        "--contexts",
        "64",
        "--rounds",
        "1",
        "--batch",
        "1",
    )
    smol = {
        m[1]: int(m[3].replace(",", ""))
        for m in re.finditer(r"^SmolLM2-135M\s+(\S+)\s+([\d,]+)\s+([\d,]+)", out, re.M)
    }
    assert smol == {
        kv: kv_capacity.blocks_per_gib(kv_capacity.block_bytes(30, 3, 64, 16, name, mb))
        for kv, name, mb in (
            ("fp32", "auto", 4),
            ("bf16", "auto", 2),
            ("int8", "int8", 4),
            ("fp8_e4m3", "fp8_e4m3", 4),
        )
    }
    blocks = {
        m[1]: int(m[2].replace(",", ""))
        for m in re.finditer(r"^(fp32|bf16|int8)\s+([\d,]+)\s+[\d.]+\s+[\d.]+%", out, re.M)
    }
    assert blocks["int8"] > 3.5 * blocks["fp32"] and blocks["bf16"] == 2 * blocks["fp32"]
    row = re.search(r"^\s+64\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", out, re.M)
    assert row is not None
    fp32, int8, ratio = (float(x) for x in row.groups())
    # the ratio column is the two time columns' quotient, up to their printed rounding (0.005 ms each)
    assert abs(int8 / fp32 - ratio) <= 0.005 + ratio * (0.005 / int8 + 0.005 / fp32)
