"""Compile the Triton kernels for a GPU architecture on a machine without a GPU (e.g. sm_90 in CI).

Why: the interpreter (how CI runs the kernels on CPU) accepts programs a real GPU compiler rejects
(``tl.dot`` with K < 16, shared memory beyond the device's limit) and says nothing about register
spills. Triton compiles for a named ``GPUTarget`` without a device; this module drives the REAL
kernel wrappers (``pagedkv.kernels.decode``, ``pagedkv.kernels.prefill``,
``pagedkv.kernels.cache_ops``) with CPU tensors while a stand-in driver reports the target and every
launch is turned into a compile-only warm-up, so exactly the configurations the dispatch would pick
are compiled. ``cuobjdump --dump-resource-usage`` (bundled with the triton wheel) then reads
registers, local memory (spills) and static shared memory from each cubin; Triton's metadata gives
the dynamic shared memory.

    python -m pagedkv.kernels.aot [--arch 90] [--jobs 2] [--json out.json]

prints one row per configuration and exits non-zero when a kernel fails to compile, needs more
shared memory than the architecture has, or spills in a 16-bit path. Needs TRITON_INTERPRET unset
(the kernels must be ``JITFunction`` objects) and writes Triton's cache to a temporary directory
unless TRITON_CACHE_DIR is set. ``tests/kernels/test_compile_sm90.py`` runs it in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pagedkv import envs

# Usable shared memory per block (opt-in maximum) by compute capability, in bytes.
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
HEAD_DIMS = (64, 80, 96, 128, 256)
# Below 16 the tile is padded to 16 (tl.dot needs K >= 16 on a GPU; the interpreter does not care).
SMALL_HEAD_DIMS = (8,)
GROUPS = (1, 4, 8)
BLOCK_SIZE = 16
NUM_KV_HEADS = 2
# 8-bit caches (kernels/quant.py). The GQA group and the head_dims between 64 and 128 change no
# 8-bit code path (the group is not specialised on; 80 and 96 are the 16-bit configurations' masks),
# so 8-bit attention compiles at group 4, head_dim 64/128/256, with bf16 queries (a GPU model's
# default dtype), plus fp16 queries over int8 at 128: each configuration costs seconds of ptxas.
KV_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
KV_HEAD_DIMS = (64, 128, 256)
KV_EXTRA = (("float16", "int8", 128),)  # (query dtype, KV dtype, head_dim) beyond the bf16 ones


@dataclass(frozen=True, slots=True)
class Config:
    """One call of a kernel wrapper, as the dispatch would make it."""

    op: str  # decode | prefill | write_kv | copy_blocks
    dtype: str
    head_dim: int
    group: int = 1
    variant: str = ""  # decode: single|split; prefill: short|long; copy_blocks: contiguous|strided
    kv: str = "auto"  # the cache: "auto" (the query's dtype) or an 8-bit KV dtype (int8, fp8_e4m3)

    @property
    def name(self) -> str:
        parts = [self.op, self.dtype if self.kv == "auto" else f"{self.dtype}+{self.kv}", f"d{self.head_dim}"]
        if self.op in ("decode", "prefill"):
            parts.append(f"g{self.group}")
        if self.variant:
            parts.append(self.variant)
        return "/".join(parts)


@dataclass(slots=True)
class KernelUsage:
    """Resources of one compiled kernel (one cubin)."""

    kernel: str
    registers: int
    local_bytes: int  # per-thread local memory (cuobjdump LOCAL or STACK, the larger): spills
    shared_bytes: int  # dynamic (Triton) + static shared memory per block
    num_warps: int
    num_stages: int
    binary: str = ""  # Triton's hash of the compiled kernel: equal hashes = one binary


@dataclass(slots=True)
class Result:
    config: Config
    seconds: float
    kernels: list[KernelUsage] = field(default_factory=list)
    error: str = ""


def all_configs() -> list[Config]:
    """Every configuration the dispatch can choose for the supported dtypes, head dims and groups."""
    out: list[Config] = []
    for dt in DTYPES:
        for d in HEAD_DIMS:
            for g in GROUPS:
                out += [Config("decode", dt, d, g, v) for v in ("single", "split")]
                out += [Config("prefill", dt, d, g, v) for v in ("short", "long")]
            out.append(Config("write_kv", dt, d))
            out += [Config("copy_blocks", dt, d, 1, v) for v in ("contiguous", "strided")]
        for d in SMALL_HEAD_DIMS:
            out += [Config("decode", dt, d, 4, v) for v in ("single", "split")]
            out.append(Config("prefill", dt, d, 4, "short"))
    attention = [("bfloat16", kv, d) for kv in KV_DTYPES for d in KV_HEAD_DIMS] + list(KV_EXTRA)
    for dt, kv, d in attention:
        out += [Config("decode", dt, d, 4, v, kv) for v in ("single", "split")]
        out += [Config("prefill", dt, d, 4, v, kv) for v in ("short", "long")]
    for kv in KV_DTYPES:
        out += [Config("write_kv", dt, d, kv=kv) for d in KV_HEAD_DIMS for dt in DTYPES]
        out.append(Config("copy_blocks", "float16", 128, 1, "contiguous", kv))
    return out


# --- the stand-in driver ---------------------------------------------------------------------------


def _target_driver(arch: int) -> Any:  # a triton DriverBase, imported lazily (triton is untyped)
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class TargetOnlyDriver(DriverBase):  # type: ignore[misc]  # DriverBase is Any: triton is untyped
        """Reports a fixed target and a device key of its own; cannot load or launch anything."""

        DEVICE = f"aot-sm{arch}"  # its own key in each JITFunction's per-device caches

        @classmethod
        def is_active(cls) -> bool:
            return False

        def get_current_target(self) -> Any:
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self) -> str:
            return self.DEVICE

        def get_current_stream(self, device: object = None) -> int:
            return 0

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("compile-only driver")

        def get_benchmarker(self) -> Any:
            raise NotImplementedError("compile-only driver")

    return TargetOnlyDriver()


@contextlib.contextmanager
def compile_only(arch: int) -> Iterator[list[Any]]:
    """Within the block, launching a Triton kernel compiles it for ``arch`` and launches nothing.

    Yields the list the compiled kernels are appended to (in launch order).
    """
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    compiled: list[Any] = []
    real_run = JITFunction.run

    def warmup_run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(kernel)
        return kernel

    previous = driver._active  # None until something asked for a driver (none exists on CPU)
    driver.set_active(_target_driver(arch))
    JITFunction.run = warmup_run
    try:
        yield compiled
    finally:
        JITFunction.run = real_run
        driver._active = previous


# --- driving the real wrappers ------------------------------------------------------------------------


def _call(cfg: Config) -> None:
    """Call the wrapper the dispatch would call, with CPU tensors shaped like a real call."""
    from pagedkv.kernels import cache_ops, decode, prefill

    dt = DTYPES[cfg.dtype]
    hkv, d = NUM_KV_HEADS, cfg.head_dim
    num_blocks = 64
    if cfg.kv == "auto":
        kc = torch.empty((num_blocks, BLOCK_SIZE, hkv, d), dtype=dt)
    else:  # rows of head_dim 8-bit values and a 4-byte fp32 scale
        kc = torch.empty((num_blocks, BLOCK_SIZE, hkv, d + 4), dtype=KV_DTYPES[cfg.kv])
    vc = torch.empty_like(kc)
    if cfg.op == "decode":
        seqs = 2
        q = torch.empty((seqs, hkv * cfg.group, d), dtype=dt)
        bt = torch.zeros((seqs, 32), dtype=torch.int32)
        sl = torch.full((seqs,), 300, dtype=torch.int32)
        splits = 1 if cfg.variant == "single" else 4
        decode.paged_decode_attention(q, kc, vc, bt, sl, d**-0.5, max_seq_len=512, num_splits=splits)
    elif cfg.op == "prefill":
        # "short": at most 64 (token, head) rows, the small-tile branch; "long": the large tiles.
        q_len = max(1, 48 // cfg.group) if cfg.variant == "short" else 300
        q = torch.empty((q_len, hkv * cfg.group, d), dtype=dt)
        bt = torch.zeros((1, 32), dtype=torch.int32)
        qsl = torch.tensor([0, q_len], dtype=torch.int32)
        sl = torch.tensor([q_len + 20], dtype=torch.int32)
        prefill.paged_prefill_attention(q, kc, vc, bt, qsl, sl, d**-0.5, max_query_len=q_len)
    elif cfg.op == "write_kv":
        k = torch.empty((8, hkv, d), dtype=dt)
        cache_ops.write_kv_cache(k, torch.empty_like(k), kc, vc, torch.arange(8, dtype=torch.int64))
    elif cfg.op == "copy_blocks":
        if cfg.variant == "strided":  # a head-major cache seen token-major: not contiguous per block
            kc = torch.empty((num_blocks, hkv, BLOCK_SIZE, kc.shape[-1]), dtype=kc.dtype).transpose(1, 2)
            vc = torch.empty_like(kc)
        cache_ops.copy_blocks([kc], [vc], torch.tensor([[0, 1], [2, 3]], dtype=torch.int64))
    else:
        raise ValueError(cfg.op)


_USAGE_RE = re.compile(r"Function ([^:\s]+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(cubin: bytes) -> dict[str, tuple[int, int, int, int]]:
    """kernel name -> (registers, stack, static shared, local) from ``cuobjdump --dump-resource-usage``."""
    from triton import knobs

    tool = knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    return {m[1]: (int(m[2]), int(m[3]), int(m[4]), int(m[5])) for m in _USAGE_RE.finditer(text)}


def compile_config(cfg: Config, arch: int = 90) -> Result:
    """Compile one configuration for ``arch`` through its wrapper; never raises."""
    t0 = time.perf_counter()
    res = Result(cfg, 0.0)
    try:
        with compile_only(arch) as compiled:
            _call(cfg)
        for k in compiled:
            usage = resource_usage(k.asm["cubin"])
            for name, (regs, stack, static_shared, local) in usage.items():
                res.kernels.append(
                    KernelUsage(
                        kernel=name,
                        registers=regs,
                        local_bytes=max(local, stack),
                        shared_bytes=int(k.metadata.shared) + static_shared,
                        num_warps=int(k.metadata.num_warps),
                        num_stages=int(k.metadata.num_stages),
                        binary=str(k.hash),
                    )
                )
    except Exception as e:  # noqa: BLE001 - a compile error is a result, reported per config
        res.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:500]
    res.seconds = time.perf_counter() - t0
    return res


def problems(res: Result, arch: int = 90) -> list[str]:
    """Why a result is not acceptable: compile error, too much shared memory, spills in 16-bit paths."""
    if res.error:
        return [f"{res.config.name}: compile error: {res.error}"]
    if not res.kernels:
        return [f"{res.config.name}: nothing was compiled"]
    out = []
    limit = MAX_SHARED.get(arch)
    for k in res.kernels:
        if limit is not None and k.shared_bytes > limit:
            out.append(f"{res.config.name}: {k.kernel} needs {k.shared_bytes} B shared memory > {limit} B")
        if res.config.dtype != "float32" and k.local_bytes > 0:
            out.append(f"{res.config.name}: {k.kernel} spills ({k.local_bytes} B local memory per thread)")
    return out


def _worker_init() -> None:
    if envs.get_bool("TRITON_INTERPRET"):
        raise RuntimeError(
            "pagedkv.kernels.aot needs TRITON_INTERPRET unset (compiled, not interpreted, kernels)"
        )


def _compile_many(cfgs: list[Config], arch: int) -> list[Result]:
    _worker_init()
    return [compile_config(c, arch) for c in cfgs]


def run(configs: list[Config], arch: int = 90, jobs: int = 1) -> list[Result]:
    """Compile ``configs`` in ``jobs`` processes (configs that share kernels stay in one process)."""
    _worker_init()
    if jobs <= 1:
        return _compile_many(configs, arch)
    # Whole (op, dtype) families per process, largest first onto the least loaded: the in-memory
    # kernel cache then still dedupes configurations that specialise to the same binary.
    families: dict[tuple[str, str], list[Config]] = {}
    for c in configs:
        families.setdefault((c.op, c.dtype), []).append(c)
    buckets: list[list[Config]] = [[] for _ in range(jobs)]
    for fam in sorted(families.values(), key=len, reverse=True):
        min(buckets, key=len).extend(fam)
    with ProcessPoolExecutor(jobs) as pool:
        parts = list(pool.map(_compile_many, [b for b in buckets if b], [arch] * jobs))
    order = {c: i for i, c in enumerate(configs)}
    return sorted((r for p in parts for r in p), key=lambda r: order[r.config])


def table(results: list[Result]) -> str:
    """A markdown table: one row per configuration, its heaviest kernel's resources."""
    rows = [
        "| config | kernels | max regs | max local (B) | max shared (B) | warps/stages | s | error |",
        "|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in results:
        ks = r.kernels
        regs = max((k.registers for k in ks), default=0)
        local = max((k.local_bytes for k in ks), default=0)
        shared = max((k.shared_bytes for k in ks), default=0)
        ws = ",".join(sorted({f"{k.num_warps}/{k.num_stages}" for k in ks}))
        rows.append(
            f"| {r.config.name} | {len(ks)} | {regs} | {local} | {shared} | {ws} | {r.seconds:.2f} | "
            f"{r.error} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = Hopper, H100/H200)")
    ap.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    ap.add_argument("--only", default="", help="comma-separated substrings a config name must contain")
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args(argv)
    cfgs = all_configs()
    if args.only:
        keys = args.only.split(",")
        cfgs = [c for c in cfgs if any(k in c.name for k in keys)]
    own_cache = not envs.is_set("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="pagedkv-aot-") as tmp:
        if own_cache:
            envs.set_default("TRITON_CACHE_DIR", tmp)  # inherited by the worker processes
        t0 = time.perf_counter()
        results = run(cfgs, args.arch, args.jobs)
        wall = time.perf_counter() - t0
    bad = [p for r in results for p in problems(r, args.arch)]
    print(table(results))
    n_kernels = len({k.binary for r in results for k in r.kernels})
    print(
        f"\n{len(results)} configurations for sm_{args.arch} in {wall:.1f} s with {args.jobs} processes; "
        f"{n_kernels} distinct kernel binaries; {len(bad)} problems"
    )
    for p in bad:
        print("PROBLEM", p)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "arch": args.arch,
                    "wall_s": wall,
                    "jobs": args.jobs,
                    "problems": bad,
                    "results": [asdict(r) for r in results],
                },
                f,
                indent=1,
            )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
