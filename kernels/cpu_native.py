"""The CPU backend's native kernels (``csrc/``): built on first use, called by ctypes.

Two kernels: paged decode attention (``csrc/paged_decode.c``, used by ``kernels/cpu.py``) and the
row-wise log-sum-exp of a step's logits (``csrc/logsumexp.c``, used by the worker's sampling for
each token's log-probability).

Why a small C file and not a torch extension: the kernel needs no torch API, only pointers and
strides, so it compiles in about a second with the system C compiler (a torch C++ extension takes
a minute of header parsing) and needs nothing at install time. It is compiled with
``-march=native`` for the machine it runs on, into a cache keyed by the source, the flags, the
compiler and the CPU, and loaded with ``ctypes.CDLL`` (which releases the GIL during the call, so
the process's gRPC threads keep running). Its OpenMP calls bind to the OpenMP runtime torch already
loaded (``libgomp.so.1``, or Intel's ``libiomp5`` when preloaded: it provides the same symbols), so
the kernels and torch share one thread pool.

When there is no C compiler, the build fails, or ``PAGEDKV_CPU_NATIVE=0``, ``available()`` is False
and the callers keep their torch paths (the CPU backend its gathers + SDPA, sampling
``torch.logsumexp``); one warning in the log says why. Environment:

- ``PAGEDKV_CPU_NATIVE``: ``auto`` (default: build and use it when possible) or ``0``/``off``.
- ``PAGEDKV_NATIVE_CACHE``: where built libraries go (default ``$XDG_CACHE_HOME/pagedkv`` or
  ``~/.cache/pagedkv``; the system temp directory when that is not writable).
- ``CC``: the C compiler (default ``cc``, else ``gcc``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import structlog
import torch

log = structlog.get_logger(__name__)

CSRC = pathlib.Path(__file__).with_name("csrc")
SOURCES = (CSRC / "paged_decode.c", CSRC / "logsumexp.c")
HEADERS = (CSRC / "fastexp.h",)
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
ENV_SWITCH = "PAGEDKV_CPU_NATIVE"
ENV_CACHE = "PAGEDKV_NATIVE_CACHE"
DTYPES = (torch.float32, torch.bfloat16)


class _DecodeArgs(ctypes.Structure):
    """Mirrors ``DecodeArgs`` in csrc/paged_decode.c (its size is checked at load)."""

    _fields_ = [(name, ctypes.c_int64) for name in (
        "num_seqs", "num_heads", "num_kv_heads", "head_dim", "block_size",
        "q_seq_stride", "q_head_stride", "o_seq_stride", "o_head_stride",
        "c_block_stride", "c_slot_stride", "c_head_stride", "bt_stride",
    )] + [("scale", ctypes.c_float), ("num_threads", ctypes.c_int)]


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def enabled() -> bool:
    """Whether the environment allows the native kernel (``PAGEDKV_CPU_NATIVE``, read per call)."""
    value = os.environ.get(ENV_SWITCH, "auto").strip().lower()
    return value not in ("0", "off", "false", "no")


def _compiler() -> str | None:
    cc = os.environ.get("CC", "").strip()
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> pathlib.Path:
    explicit = os.environ.get(ENV_CACHE, "").strip()
    if explicit:
        return pathlib.Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "pagedkv"


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and flags (Linux), else the platform."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _build(cc: str) -> pathlib.Path:
    """Compile the kernels (or find them built): returns the shared library's path."""
    texts = [f.read_bytes() for f in (*SOURCES, *HEADERS)]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([*texts, " ".join(CFLAGS).encode(), version.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:20]
    target = None
    for directory in (_cache_dir(), pathlib.Path(tempfile.gettempdir()) / "pagedkv-native"):
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(directory, os.W_OK) or (directory / f"cpu_kernels-{key}.so").exists():
            target = directory / f"cpu_kernels-{key}.so"
            break
    if target is None:
        raise OSError("no writable directory for the native kernel (set PAGEDKV_NATIVE_CACHE)")
    if target.exists():
        return target
    # Build next to the target and rename: processes starting together never load a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *CFLAGS, "-o", tmp, *map(str, SOURCES)], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise OSError(f"{cc} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("native_kernels_built", path=str(target))
    return target


def _load() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler found (set CC, or install gcc)")
    lib = ctypes.CDLL(str(_build(cc)))
    lib.pagedkv_decode_args_size.restype = ctypes.c_int64
    if lib.pagedkv_decode_args_size() != ctypes.sizeof(_DecodeArgs):
        raise OSError("the built kernels' argument layout does not match kernels/cpu_native.py")
    for name in ("pagedkv_decode_f32", "pagedkv_decode_bf16"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_DecodeArgs)] + [ctypes.c_void_p] * 6
    lib.pagedkv_logsumexp_f32.restype = None
    lib.pagedkv_logsumexp_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                          ctypes.c_void_p, ctypes.c_int]
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on the first call; None when disabled or unavailable."""
    global _lib, _tried
    if not enabled():
        return None
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                _lib = _load()
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("native_kernel_unavailable", reason=str(exc),
                            fallback="gather + SDPA (kernels/cpu.py)")
                _lib = None
            _tried = True
    return _lib


def available() -> bool:
    return library() is not None


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether ``decode`` takes these tensors: CPU, one dtype it knows, head_dim contiguous, the two
    caches laid out alike."""
    return (
        query.device.type == "cpu" and key_cache.device.type == "cpu"
        and query.dtype in DTYPES and query.dtype == key_cache.dtype == value_cache.dtype
        and query.stride(-1) == 1 and key_cache.stride(-1) == 1
        and key_cache.stride() == value_cache.stride()
    )


def decode(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
) -> torch.Tensor:
    """Paged decode attention into ``out`` (``[num_seqs, num_heads, head_dim]``, the query's dtype).

    ``block_tables`` and ``seq_lens`` must be int32 and contiguous (``DecodePlan`` keeps them so);
    the caches are one layer's ``[num_blocks, block_size, num_kv_heads, head_dim]``. Caller checks
    ``supports`` and that the library is available."""
    lib = library()
    assert lib is not None
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    args = _DecodeArgs(
        num_seqs, num_heads, num_kv_heads, head_dim, block_size,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        scale, torch.get_num_threads(),
    )
    fn = lib.pagedkv_decode_f32 if query.dtype == torch.float32 else lib.pagedkv_decode_bf16
    rc = fn(ctypes.byref(args), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr())
    if rc != 0:
        raise MemoryError("native decode kernel: could not allocate its scratch memory")
    return out


def logsumexp_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(logits, dim=-1)`` of 2-D fp32 CPU logits (rows contiguous), by the native
    kernel when it is available, else by torch. Same value up to fp32 rounding."""
    lib = library()
    if (lib is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.stride(1) != 1 or logits.shape[1] == 0):
        return torch.logsumexp(logits, dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.float32)
    lib.pagedkv_logsumexp_f32(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0),
                              out.data_ptr(), torch.get_num_threads())
    return out
