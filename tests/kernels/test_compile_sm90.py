"""Every kernel configuration the dispatch can choose compiles for Hopper (sm_90), without a GPU.

Why: the interpreter that runs the kernel tests on CPU accepts programs the GPU compiler rejects
(``tl.dot`` with K < 16 was one) and says nothing about shared memory or register spills.
``pagedkv.kernels.aot`` compiles through the real wrappers for ``GPUTarget("cuda", 90, 32)`` and reads each
cubin with ``cuobjdump``; this test fails on a compile error, on shared memory above the H200's
227 KB, or on spills in a 16-bit path. It runs in a subprocess because the suite sets
TRITON_INTERPRET=1 (the kernels must be compiled, not interpreted), with Triton's cache in tmp_path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
from pagedkv.kernels import aot  # noqa: E402 - needs triton

ROOT = Path(__file__).resolve().parents[2]


def _cuobjdump_available() -> bool:
    try:
        from triton import knobs

        return bool(knobs.nvidia.cuobjdump.path)
    except Exception:  # noqa: BLE001 - no NVIDIA backend in this triton build
        return False


needs_nvidia_tools = pytest.mark.skipif(
    not _cuobjdump_available(), reason="triton without its NVIDIA backend tools"
)


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    env.pop("TRITON_INTERPRET", None)
    env.pop("PAGEDKV_KERNEL_BACKEND", None)
    return env


@needs_nvidia_tools
# 282 configurations: 367 s with 2 processes on 2 cores shared with other work (the 48 8-bit ones
# alone 150 s); deselect with -m "not slow"
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_dispatch_configuration_compiles_for_sm90(tmp_path: Path) -> None:
    jobs = max(1, min(4, os.cpu_count() or 1))
    out = tmp_path / "aot.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv.kernels.aot",
            "--arch",
            "90",
            "--jobs",
            str(jobs),
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=1150,
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert report["problems"] == []
    by_name = {aot.Config(**r["config"]).name: r for r in report["results"]}
    expected = aot.all_configs()
    assert set(by_name) == {c.name for c in expected}
    ops = {c.op for c in expected}
    assert ops == {"decode", "prefill", "write_kv", "copy_blocks"}
    assert {c.dtype for c in expected} == {"float16", "bfloat16", "float32"}
    assert {c.head_dim for c in expected} >= {8, 64, 80, 96, 128, 256}
    assert {c.group for c in expected if c.op == "prefill"} >= {1, 4, 8}
    assert {c.kv for c in expected} == {"auto", "int8", "fp8_e4m3"}
    for c in expected:
        r = by_name[c.name]
        assert not r["error"], (c.name, r["error"])
        names = {k["kernel"] for k in r["kernels"]}
        if c.op == "decode" and c.variant == "split":
            assert names == {"_decode_split_kernel", "_decode_reduce_kernel"}, c.name
        else:
            assert len(names) == 1, (c.name, names)
        for k in r["kernels"]:
            assert 0 < k["registers"] <= 255
            assert k["shared_bytes"] <= aot.MAX_SHARED[90]
    print(proc.stdout[-400:])  # the summary line: configurations, wall time, processes


@needs_nvidia_tools
@pytest.mark.timeout(300)
def test_a_dot_with_k_below_16_is_reported_as_a_compile_error(tmp_path: Path) -> None:
    """The bug class this check exists for: the interpreter runs it, sm_90 cannot compile it."""
    script = tmp_path / "bad_dot.py"
    script.write_text(
        textwrap.dedent("""
        import json, sys, torch, triton, triton.language as tl
        from pagedkv.kernels import aot

        @triton.jit
        def bad_dot(x_ptr, K: tl.constexpr):
            r = tl.arange(0, 16)
            a = tl.load(x_ptr + r[:, None] * K + tl.arange(0, K)[None, :])
            tl.store(x_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, tl.trans(a)).to(tl.float16))

        def call(cfg):
            k = int(cfg.head_dim)
            bad_dot[(1,)](torch.empty(256, dtype=torch.float16), K=k)

        aot._call = call
        out = {}
        for k in (8, 16):
            r = aot.compile_config(aot.Config("decode", "float16", k))
            out[k] = {"error": r.error, "problems": aot.problems(r), "kernels": len(r.kernels)}
        json.dump(out, sys.stdout)
    """)
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["8"]["error"] and res["8"]["problems"] and res["8"]["kernels"] == 0
    assert res["16"]["error"] == "" and res["16"]["problems"] == [] and res["16"]["kernels"] == 1


def _result(dtype: str, **usage: int) -> aot.Result:
    k = aot.KernelUsage(
        kernel="_k",
        registers=usage.get("registers", 100),
        local_bytes=usage.get("local", 0),
        shared_bytes=usage.get("shared", 1024),
        num_warps=4,
        num_stages=3,
    )
    return aot.Result(aot.Config("prefill", dtype, 128, 4, "long"), 1.0, [k])


def test_problems_names_each_limit() -> None:
    assert aot.problems(_result("float16")) == []
    assert aot.problems(_result("float16", shared=232448)) == []
    assert "232449 B shared memory > 232448 B" in aot.problems(_result("bfloat16", shared=232449))[0]
    assert "spills (8 B" in aot.problems(_result("float16", local=8))[0]
    assert aot.problems(_result("float32", local=1024)) == []  # float32 may spill: reported, not failed
    assert (
        "compile error: boom"
        in aot.problems(aot.Result(aot.Config("write_kv", "float16", 64), 0.0, error="boom"))[0]
    )
    assert "nothing was compiled" in aot.problems(aot.Result(aot.Config("write_kv", "float16", 64), 0.0))[0]


def test_configs_cover_the_dispatch_matrix() -> None:
    cfgs = aot.all_configs()
    assert len(cfgs) == len(set(cfgs))
    for dt in ("float16", "bfloat16", "float32"):
        for d in (64, 80, 96, 128, 256):
            for g in (1, 4, 8):
                for v in ("single", "split"):
                    assert aot.Config("decode", dt, d, g, v) in cfgs
                for v in ("short", "long"):
                    assert aot.Config("prefill", dt, d, g, v) in cfgs
            assert aot.Config("write_kv", dt, d) in cfgs
            assert aot.Config("copy_blocks", dt, d, 1, "strided") in cfgs


def test_configs_cover_the_8bit_caches() -> None:
    """Decode (single, split), prefill (short, long tiles), the quantizing write and the byte copy on
    int8 and fp8_e4m3 caches, with bf16 queries at every 8-bit head_dim and fp16 ones over int8."""
    cfgs = aot.all_configs()
    for kv in ("int8", "fp8_e4m3"):
        for d in (64, 128, 256):
            for v in ("single", "split"):
                assert aot.Config("decode", "bfloat16", d, 4, v, kv) in cfgs
            for v in ("short", "long"):
                assert aot.Config("prefill", "bfloat16", d, 4, v, kv) in cfgs
            for dt in ("float16", "bfloat16", "float32"):
                assert aot.Config("write_kv", dt, d, kv=kv) in cfgs
        assert aot.Config("copy_blocks", "float16", 128, 1, "contiguous", kv) in cfgs
    assert aot.Config("decode", "float16", 128, 4, "split", "int8") in cfgs
    assert (
        aot.Config("prefill", "bfloat16", 64, 4, "long", "fp8_e4m3").name
        == "prefill/bfloat16+fp8_e4m3/d64/g4/long"
    )
