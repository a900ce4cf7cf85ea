"""gpu_check.sh's first section: is this environment able to run the others? Seconds, not minutes.

    python -s -m bench.gpu.preflight [--gpu]     # exit 1 naming the first thing that is missing

Why: a borrowed GPU machine gives one short call. A missing wheel, a missing C compiler (Triton
compiles a launcher stub with it, against Python.h, on its first kernel), a Triton that cannot
compile, or CUDA IPC that does not work between two processes would each fail a later section after
minutes of its budget; here each fails in seconds, and gpu_check.sh stops the run with this
section's reason. Checks, in order, each printed as ``ok``/``FAILED`` with its time:

1. imports: every outside module the sections import (bench.gpu.imports), pytest and xdist included;
2. compiler: a C compiler (CC, else cc/gcc/clang, as Triton looks) builds a module against this
   interpreter's Python.h, and the module imports;
3. gpu detection: ``torch.cuda.is_available()`` (what gpu_check.sh falls back to without nvidia-smi)
   agrees with ``--gpu``;
4. triton: one tiny kernel compiled and run (on CPU: in Triton's interpreter), checked against torch;
5. ipc: one buffer exported by this process and written by a second one, read back here: a CuPy IPC
   handle with ``--gpu``, else the CPU stand-in (multiprocessing shared memory).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

IPC_BYTES = 2 << 20  # CuPy IPC handles name whole allocations: 2 MiB, the granularity
PATTERN = 0x5A


class CheckFailed(Exception):
    """A check's reason, printed as the section's last line."""


def check_imports(gpu: bool) -> str:
    from bench.gpu import imports

    failures = imports.check(None, gpu)
    if failures:
        raise CheckFailed("; ".join(failures))
    import pytest
    import xdist

    return f"{len(imports.modules())} modules; pytest {pytest.__version__}, xdist {xdist.__version__}"


def find_compiler() -> str | None:
    """The C compiler Triton would use: $CC, else the first of cc, gcc, clang on PATH."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def check_compiler() -> str:
    cc = find_compiler()
    if cc is None:
        raise CheckFailed("no C compiler (CC, cc, gcc, clang): Triton cannot build its launcher")
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        raise CheckFailed(f"no Python.h in {include}: Triton cannot build its launcher (python3-dev)")
    with tempfile.TemporaryDirectory(prefix="pagedkv-preflight-") as tmp:
        src = Path(tmp) / "preflight_ext.c"
        src.write_text(
            "#include <Python.h>\n"
            'static struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "preflight_ext", NULL, -1, NULL};\n'
            "PyMODINIT_FUNC PyInit_preflight_ext(void) { return PyModule_Create(&m); }\n"
        )
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        out = Path(tmp) / f"preflight_ext{suffix}"
        proc = subprocess.run(
            [cc, "-shared", "-fPIC", "-O0", f"-I{include}", str(src), "-o", str(out)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if proc.returncode != 0:
            raise CheckFailed(f"{cc} could not build against Python.h: {proc.stderr.strip()[-500:]}")
        sys.path.insert(0, tmp)
        try:
            __import__("preflight_ext")
        finally:
            sys.path.remove(tmp)
    return f"{cc}, {include / 'Python.h'}"


def check_gpu_detection(gpu: bool) -> str:
    import torch

    available = torch.cuda.is_available()
    smi = shutil.which("nvidia-smi")
    if available != gpu:
        raise CheckFailed(f"torch.cuda.is_available() is {available}, but gpu_check.sh decided GPU={gpu}")
    seen = torch.cuda.get_device_name(0) if available else "no CUDA device"
    return f"torch.cuda.is_available()={available} ({seen}); nvidia-smi {'at ' + smi if smi else 'absent'}"


def check_triton(gpu: bool) -> str:
    if not gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the decorator below runs
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def axpy(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):  # noqa: ANN001, N803 - Triton's style
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        y = tl.load(y_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, 2.0 * x + y, mask=mask)

    device = "cuda" if gpu else "cpu"
    g = torch.Generator(device=device).manual_seed(0)
    n = 1000
    x = torch.randn(n, device=device, generator=g)
    y = torch.randn(n, device=device, generator=g)
    out = torch.full_like(x, float("nan"))
    axpy[(triton.cdiv(n, 256),)](x, y, out, n, BLOCK=256)
    if gpu:
        torch.cuda.synchronize()
    if not torch.allclose(out, 2 * x + y):
        raise CheckFailed("the tiny Triton kernel's output differs from torch's")
    return f"triton {triton.__version__} on {device}{'' if gpu else ' (interpreter)'}"


def _child_cmd(kind: str, arg: str) -> list[str]:
    return [sys.executable, "-s", "-m", "bench.gpu.preflight", "--ipc-child", kind, arg]


def check_ipc(gpu: bool) -> str:
    if gpu:
        import cupy

        mem = cupy.cuda.Memory(IPC_BYTES)
        buf = cupy.ndarray((IPC_BYTES,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        buf.fill(0)
        cupy.cuda.runtime.deviceSynchronize()
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(mem.ptr)).hex()
        _run_child("cuda", handle)
        got = int((buf == PATTERN).sum())
        what = f"CuPy {cupy.__version__} IPC handle"
    else:
        from multiprocessing import shared_memory

        shm = shared_memory.SharedMemory(create=True, size=IPC_BYTES)
        try:
            shm.buf[:] = bytes(IPC_BYTES)
            _run_child("shm", shm.name)
            got = sum(1 for b in shm.buf if b == PATTERN)
        finally:
            shm.close()
            shm.unlink()
        what = "shared memory (the CPU stand-in; no GPU)"
    if got != IPC_BYTES:
        raise CheckFailed(
            f"{what}: the second process's writes are not visible here ({got} of {IPC_BYTES} bytes)"
        )
    return f"{what}: {IPC_BYTES >> 20} MiB written by a second process, read back here"


def _run_child(kind: str, arg: str) -> None:
    proc = subprocess.run(_child_cmd(kind, arg), capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise CheckFailed(f"the second process failed (rc={proc.returncode}): {proc.stderr.strip()[-800:]}")


def ipc_child(kind: str, arg: str) -> int:
    """The second process: open the first one's buffer, fill it with PATTERN, close it."""
    if kind == "cuda":
        import cupy

        ptr = cupy.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(arg))
        try:
            cupy.cuda.runtime.memset(ptr, PATTERN, IPC_BYTES)
            cupy.cuda.runtime.deviceSynchronize()
        finally:
            cupy.cuda.runtime.ipcCloseMemHandle(ptr)
    else:
        from multiprocessing import resource_tracker, shared_memory

        shm = shared_memory.SharedMemory(name=arg)
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # the creator unlinks
        shm.buf[:] = bytes([PATTERN]) * IPC_BYTES
        shm.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="gpu_check.sh found a GPU: check the CUDA forms")
    ap.add_argument("--ipc-child", nargs=2, metavar=("KIND", "ARG"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ipc_child:
        return ipc_child(*args.ipc_child)
    checks: list[tuple[str, Callable[[], str]]] = [
        ("imports", lambda: check_imports(args.gpu)),
        ("compiler", check_compiler),
        ("gpu detection", lambda: check_gpu_detection(args.gpu)),
        ("triton", lambda: check_triton(args.gpu)),
        ("ipc", lambda: check_ipc(args.gpu)),
    ]
    for name, fn in checks:
        t0 = time.monotonic()
        try:
            detail = fn()
        except Exception as e:  # noqa: BLE001 - any failure is the reason the run stops
            reason = str(e) if isinstance(e, CheckFailed) else f"{type(e).__name__}: {e}"
            print(f"FAILED {name} ({time.monotonic() - t0:.1f}s): {reason}", flush=True)
            print(f"preflight failed: {name}: {reason}", flush=True)
            return 1
        print(f"ok {name} ({time.monotonic() - t0:.1f}s): {detail}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
