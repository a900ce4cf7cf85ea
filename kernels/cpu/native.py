"""The CPU backend's native kernels (``csrc/``): built at install, chosen by CPU features, torch ops.

The kernels: paged decode attention (``csrc/paged_decode.c``, used by ``kernels/cpu/attention.py``) and the
row-wise log-sum-exp of a step's logits (``csrc/logsumexp.c``, used by the worker's sampling for
each token's log-probability); and the fused elementwise parts of a decoder layer
(``csrc/layer_ops.c``: RMSNorm with the residual add, SiLU- and GELU-tanh-and-multiply, rotary
embedding with the per-head q/k norm and the KV write), wrapped by ``kernels/cpu/layer_ops.py``; and
the fp32 linear layer over weights packed at load (``csrc/linear.c``), wrapped by
``kernels/cpu/linear.py``; and the quantized linear layer over
int4 / int8 / K-quant weights (``csrc/quant_linear.c``), wrapped by ``kernels/cpu/quant_linear.py``;
and a decode step's decoder layers chained in one call over those same kernels
(``csrc/decode_layers.c``), set up by ``kernels/cpu/decode_layers.py``.

**Built at install** by ``setup.py`` (setuptools ``Extension``), one shared library per
instruction-set variant: on x86-64 ``x86_64`` (baseline), ``avx2`` (AVX2 + FMA) and ``avx512``
(AVX-512 F/BW/DQ/VL), elsewhere ``generic``. Nothing is compiled at run time. At the first call
the baseline library's ``pagedkv_cpu_level()`` (``csrc/cpu_features.c``: CPUID and the OS's
register support, through ``__builtin_cpu_supports``) says what the CPU can run, and the best
variant built is loaded with ``ctypes.CDLL`` (which releases the GIL during a call, so the
process's gRPC threads keep running). Why plain C through ctypes and not a torch C++ extension:
the kernels need no torch API, only pointers and strides, so they build in seconds without
torch or Python headers. Their OpenMP calls bind to the OpenMP runtime torch already loaded, so the
kernels and torch share one thread pool.

**Torch ops**: ``torch.ops.pagedkv.paged_decode`` and ``torch.ops.pagedkv.logsumexp_rows``
(``torch.library``), so they show by name in the profiler and compose with
``torch.compile`` (each has a fake implementation giving the output's metadata). Each checks its
arguments before touching memory (``ValueError``/``TypeError`` naming the argument): CPU tensors
of a dtype the kernel knows, in the layout it indexes; a device tensor's pointer is never read.

**Fallback**: when no variant was built (no C compiler at install), the CPU cannot run any that
was, or ``PAGEDKV_CPU_NATIVE=0``, ``available()`` is False and the callers keep their torch paths
(the CPU backend its gathers + SDPA, sampling ``torch.logsumexp``); one warning in the log says
why. ``kernel_path()`` names the path in use (WorkerInfo.cpu_kernel_path, the worker's start-up log).

- ``PAGEDKV_CPU_NATIVE``: ``auto`` (default: the best variant the CPU runs), ``0``/``off``, or a
  variant name to force it (refused, with the fallback, when the CPU cannot run it or it was not built).
"""

from __future__ import annotations

import ctypes
import importlib.util
import pathlib
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import structlog
import torch

from pagedkv import envs

log = structlog.get_logger(__name__)

ENV_SWITCH = "PAGEDKV_CPU_NATIVE"
DTYPES = (torch.float32, torch.bfloat16)
# Instruction-set variants built by setup.py, best first, and the pagedkv_cpu_level() each needs.
VARIANTS: dict[str, int] = {"avx512": 2, "avx2": 1, "x86_64": 0, "generic": 0}
BASELINES = ("x86_64", "generic")
TORCH_PATH = "torch"
# The kernel keeps one task's query and accumulator rows on its thread's stack (2 x group x head_dim
# floats): a bound well under the smallest OpenMP thread stack.
MAX_GROUP_X_HEAD_DIM = 16384
# An int8 cache row's bytes past head_dim: its fp32 scale (kernels/quant.py).
SCALE_BYTES = 4


class _DecodeArgs(ctypes.Structure):
    """Mirrors ``DecodeArgs`` in csrc/paged_decode.c (its size is checked at load)."""

    # Annotated: a mixed literal would be inferred as (str, type[object]) pairs.
    _fields_: ClassVar[list[tuple[str, type[ctypes.c_int64 | ctypes.c_float | ctypes.c_int]]]] = [
        (name, ctypes.c_int64)
        for name in (
            "num_seqs",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "block_size",
            "q_seq_stride",
            "q_head_stride",
            "o_seq_stride",
            "o_head_stride",
            "c_block_stride",
            "c_slot_stride",
            "c_head_stride",
            "bt_stride",
        )
    ] + [
        ("scale", ctypes.c_float),
        ("num_threads", ctypes.c_int),
        ("generic_only", ctypes.c_int),
        ("window", ctypes.c_int64),  # sliding window, 0: none
    ]


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_variant: str | None = None
_tried = False


def enabled() -> bool:
    """Whether the environment allows the native kernels (``PAGEDKV_CPU_NATIVE``, read per call)."""
    value = envs.get_str(ENV_SWITCH).lower()
    return value not in ("0", "off", "false", "no")


def artifact(variant: str) -> pathlib.Path | None:
    """The installed library of one variant (``kernels/_cpu_<variant>.<abi>.so``), or None when the
    install did not build it. Found like an extension module, so editable installs work too."""
    try:
        spec = importlib.util.find_spec(f"pagedkv.kernels.cpu._native_{variant}")
    except (ImportError, ValueError):
        return None
    return pathlib.Path(spec.origin) if spec is not None and spec.origin else None


def built_variants() -> list[str]:
    """The variants this install built, best first."""
    return [v for v in VARIANTS if artifact(v) is not None]


def cpu_level() -> int:
    """What the running CPU supports (2: AVX-512, 1: AVX2 + FMA, 0: baseline), asked of the
    baseline library (it runs on any CPU of its architecture). Raises OSError when none was built."""
    for name in BASELINES:
        path = artifact(name)
        if path is not None:
            lib = ctypes.CDLL(str(path))
            lib.pagedkv_cpu_level.restype = ctypes.c_int
            return int(lib.pagedkv_cpu_level())
    raise OSError(
        "the native kernels were not built at install (no C compiler then?): "
        "reinstall pagedkv with a C compiler present (gcc or clang with OpenMP)"
    )


def choose_variant(built: Sequence[str], level: int, requested: str) -> str:
    """The variant to load: ``requested`` (a name, or ``auto`` for the best built one the CPU runs).
    Raises OSError saying why none can be used."""
    if not built:
        raise OSError(
            "the native kernels were not built at install (no C compiler then?): "
            "reinstall pagedkv with a C compiler present (gcc or clang with OpenMP)"
        )
    if requested != "auto":
        if requested not in VARIANTS:
            raise OSError(f"{ENV_SWITCH}={requested!r} is not auto, off or one of {sorted(VARIANTS)}")
        if requested not in built:
            raise OSError(
                f"{ENV_SWITCH}={requested}: that variant was not built at install (built: {list(built)})"
            )
        if VARIANTS[requested] > level:
            raise OSError(f"{ENV_SWITCH}={requested}: this CPU cannot run it (cpu level {level})")
        return requested
    for name in built:
        if VARIANTS[name] <= level:
            return name
    raise OSError(f"no built variant ({list(built)}) runs on this CPU (cpu level {level})")


def _load() -> tuple[ctypes.CDLL, str]:
    built = built_variants()
    level = cpu_level() if built else 0
    variant = choose_variant(built, level, envs.get_str(ENV_SWITCH).lower())
    path = artifact(variant)
    assert path is not None
    lib = ctypes.CDLL(str(path))
    lib.pagedkv_decode_args_size.restype = ctypes.c_int64
    if lib.pagedkv_decode_args_size() != ctypes.sizeof(_DecodeArgs):
        raise OSError(
            f"{path.name}: its argument layout does not match kernels/cpu/native.py (stale build: reinstall)"
        )
    for name in ("pagedkv_decode_f32", "pagedkv_decode_bf16"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_DecodeArgs)] + [ctypes.c_void_p] * 6
    # Entry points: the argument struct, then this many pointers.
    for name, pointers in (
        ("pagedkv_prefill_f32", 7),
        ("pagedkv_decode_f32_lse", 7),
        ("pagedkv_prefill_prefix_f32", 9),
        # int8 caches (kernels/quant.py)
        ("pagedkv_decode_i8", 6),
        ("pagedkv_decode_i8_lse", 7),
        ("pagedkv_prefill_i8", 7),
        ("pagedkv_prefill_prefix_i8", 9),
    ):
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise OSError(f"{path.name} lacks {name} (stale build: reinstall)") from None
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_DecodeArgs)] + [ctypes.c_void_p] * pointers
    i64, ptr, f32, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    functions = {
        # The fused layer operations (csrc/layer_ops.c, kernels/cpu/layer_ops.py).
        "pagedkv_rms_norm_f32": [i64, i64, ptr, i64, ptr, i64, ptr, ptr, i64, f32, cint],
        "pagedkv_silu_mul_f32": [i64, i64, ptr, i64, ptr, i64, cint],
        "pagedkv_gelu_tanh_mul_f32": [i64, i64, ptr, i64, ptr, i64, cint],
        # (..., slots, q_norm, k_norm, eps, num_threads): the norms NULL for none.
        "pagedkv_rope_store_f32": [i64, i64, i64, i64, ptr, i64, ptr, ptr, i64, ptr]
        + [ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr, f32, cint],
        # The packed-weight linear layer (csrc/linear.c, kernels/cpu/linear.py).
        "pagedkv_linear_pack_f32": [i64, i64, ptr, i64, ptr, cint],
        "pagedkv_linear_f32": [i64, i64, i64, ptr, i64, ptr, ptr, ptr, i64, cint],
        "pagedkv_linear_packed_numel": [i64, i64],
        # The quantized linear layer (csrc/quant_linear.c, kernels/cpu/quant_linear.py).
        # (..., num_threads, arith): arith is quant_linear.py's ARITH_*.
        "pagedkv_q4_linear": [i64, i64, i64, ptr, i64, ptr, ptr, ptr, i64, cint, cint],
        "pagedkv_q8_linear": [i64, i64, i64, ptr, i64, ptr, i64, ptr, ptr, i64, cint, cint],
        "pagedkv_kq_linear": [i64, i64, i64, ptr, i64, ptr, ptr, i64, ptr, i64, cint, cint],
        "pagedkv_kq_rows": [i64, ptr, i64, ptr, ptr, i64, ptr, i64],
        "pagedkv_quant_linear_simd": [],
        "pagedkv_quant_words": [cint],
        "pagedkv_quant_amx": [cint],
        # Quantize on write into an int8 cache (csrc/paged_decode.c).
        "pagedkv_write_kv_i8": [i64, i64, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64]
        + [ptr, cint],
        # A decode step's decoder layers in one call (csrc/decode_layers.c, kernels/cpu/decode_layers.py).
        "pagedkv_decode_layers_f32": [ptr, ptr, ptr, ptr],
        "pagedkv_decode_layers_sizes": [ptr],
        # Row-wise log-sum-exp, with each row's argmax when asked (csrc/logsumexp.c).
        "pagedkv_logsumexp_argmax_f32": [ptr, i64, i64, i64, ptr, ptr, cint],
        # A plain read of memory spans (csrc/read_spans.c, bench/decode_floor.py).
        "pagedkv_read_spans": [i64, ptr, ptr, cint],
    }
    # What the functions return (the rest return nothing): a size, or a status / flag.
    results = {"pagedkv_linear_packed_numel": ctypes.c_int64, "pagedkv_read_spans": ctypes.c_uint64} | {
        name: ctypes.c_int
        for name in functions
        if name
        in (
            "pagedkv_q4_linear",
            "pagedkv_q8_linear",
            "pagedkv_kq_linear",
            "pagedkv_quant_linear_simd",
            "pagedkv_quant_words",
            "pagedkv_quant_amx",
            "pagedkv_decode_layers_f32",
        )
    }
    for name, argtypes in functions.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise OSError(f"{path.name} lacks {name} (stale build: reinstall)") from None
        fn.restype = results.get(name)
        fn.argtypes = argtypes
    return lib, variant


def library() -> ctypes.CDLL | None:
    """The loaded kernel library (chosen at the first call); None when disabled or unavailable."""
    global _lib, _variant, _tried
    if not enabled():
        return None
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                _lib, _variant = _load()
                log.info("native_kernels_loaded", variant=_variant, path=str(artifact(_variant)))
            except OSError as exc:
                log.warning(
                    "native_kernel_unavailable",
                    reason=str(exc),
                    fallback="torch (gather + SDPA in kernels/cpu/attention.py, torch.logsumexp)",
                )
                _lib, _variant = None, None
            _tried = True
    return _lib


def available() -> bool:
    return library() is not None


def active_variant() -> str | None:
    """The loaded variant's name (``avx512``, ``avx2``, ``x86_64``, ``generic``), None on torch."""
    return _variant if library() is not None else None


def kernel_path() -> str:
    """The CPU kernel path in use, for logs and WorkerInfo: ``native-<variant>`` or ``torch``."""
    variant = active_variant()
    return f"native-{variant}" if variant else TORCH_PATH


def _cache_ok(dt: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """A cache dtype the kernels read with this query dtype: the same, or int8 rows with fp32."""
    return cache_dtype is dt or (cache_dtype is torch.int8 and dt is torch.float32)


def _row_extra(cache: torch.Tensor) -> int:
    """Bytes an int8 cache row holds past head_dim (its scale); 0 for a float cache."""
    return SCALE_BYTES if cache.dtype is torch.int8 else 0


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether ``decode`` takes these tensors: CPU, one dtype it knows (or an int8 cache, kernels/
    quant.py, with an fp32 query), head_dim contiguous, the two caches laid out alike (the planned
    index tensors are the caller's, and right by construction). Asked on every layer's call, hence the
    plain attribute reads (``is_cpu``, ``is`` on dtypes)."""
    qs, ks, dt = query.shape, key_cache.shape, query.dtype
    return (
        query.is_cpu
        and key_cache.is_cpu
        and value_cache.is_cpu
        and (dt is torch.float32 or dt is torch.bfloat16)
        and _cache_ok(dt, key_cache.dtype)
        and value_cache.dtype is key_cache.dtype
        and len(qs) == 3
        and len(ks) == 4
        and qs[2] == ks[3] - _row_extra(key_cache)
        and query.stride(-1) == 1
        and key_cache.stride(-1) == 1
        and value_cache.shape == ks
        and value_cache.stride() == key_cache.stride()
        and ks[2] > 0
        and qs[1] % ks[2] == 0
        and qs[1] // ks[2] * qs[2] <= MAX_GROUP_X_HEAD_DIM
    )


def _tensor(name: str, t: object, dim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """``t`` as a CPU tensor of ``dim`` dimensions, one of ``dtypes``, innermost dimension dense."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor for the native kernel, got device {t.device}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    return t


def check_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Raise ``ValueError``/``TypeError`` naming the argument unless the decode kernel can index
    these tensors (what ``supports`` accepts, plus the index tensors and ``out``). Metadata only:
    the values of ``block_tables`` and ``seq_lens`` are validated by kernels/checks.py upstream.

    Why two parts: this runs on every layer's call, so the accepting case is one expression
    (``is_cpu`` is also true for fake CPU tensors under torch.compile); only a rejected call pays
    for finding which argument to name."""
    q, k, v, bt, sl, o = query, key_cache, value_cache, block_tables, seq_lens, out
    try:
        qs, ks, dt, i32 = q.shape, k.shape, q.dtype, torch.int32
        if (
            q.is_cpu
            and k.is_cpu
            and v.is_cpu
            and bt.is_cpu
            and sl.is_cpu
            and o.is_cpu
            and (dt is torch.float32 or dt is torch.bfloat16)
            and _cache_ok(dt, k.dtype)
            and v.dtype is k.dtype
            and o.dtype is dt
            and bt.dtype is i32
            and sl.dtype is i32
            and len(qs) == 3
            and len(ks) == 4
            and bt.dim() == 2
            and sl.dim() == 1
            and q.stride(-1) == 1
            and k.stride(-1) == 1
            and o.stride(-1) == 1
            and bt.stride(-1) == 1
            and sl.stride(-1) == 1
            and v.shape == ks
            and v.stride() == k.stride()
            and o.shape == qs
            and qs[2] == ks[3] - _row_extra(k)
            and ks[2] > 0
            and qs[1] % ks[2] == 0
            and qs[1] // ks[2] * qs[2] <= MAX_GROUP_X_HEAD_DIM
            and len(bt) == qs[0]
            and len(sl) == qs[0]
        ):
            return
    except (AttributeError, TypeError):
        pass
    _explain_decode(q, k, v, bt, sl, o)


def _explain_decode(
    query: object, key_cache: object, value_cache: object, block_tables: object, seq_lens: object, out: object
) -> None:
    """Raise the error naming the first argument ``check_decode`` rejects."""
    q = _tensor("query", query, 3, DTYPES)
    cache_dtypes = (q.dtype, torch.int8) if q.dtype is torch.float32 else (q.dtype,)
    k = _tensor("key_cache", key_cache, 4, cache_dtypes)
    v = _tensor("value_cache", value_cache, 4, (k.dtype,))
    bt = _tensor("block_tables", block_tables, 2, (torch.int32,))
    sl = _tensor("seq_lens", seq_lens, 1, (torch.int32,))
    o = _tensor("out", out, 3, (q.dtype,))
    num_seqs, num_heads, head_dim = q.shape
    if k.shape[3] - _row_extra(k) != head_dim:
        raise ValueError(f"key_cache head_dim {k.shape[3] - _row_extra(k)} != query head_dim {head_dim}")
    if v.shape != k.shape or v.stride() != k.stride():
        raise ValueError(
            f"value_cache must have key_cache's shape and strides, got {tuple(v.shape)} / "
            f"{v.stride()} vs {tuple(k.shape)} / {k.stride()}"
        )
    if k.shape[2] == 0 or num_heads % k.shape[2]:
        raise ValueError(f"query's {num_heads} heads must be a multiple of key_cache's {k.shape[2]} KV heads")
    if num_heads // k.shape[2] * head_dim > MAX_GROUP_X_HEAD_DIM:
        raise ValueError(
            f"query: GQA group x head_dim {num_heads // k.shape[2] * head_dim} exceeds {MAX_GROUP_X_HEAD_DIM}"
        )
    if bt.shape[0] != num_seqs or sl.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables {tuple(bt.shape)} and seq_lens {tuple(sl.shape)} must have query's {num_seqs} rows"
        )
    if o.shape != q.shape:
        raise ValueError(f"out must have query's shape {tuple(q.shape)}, got {tuple(o.shape)}")
    raise ValueError("native decode: arguments rejected")  # unreachable while the two checks agree


def _paged_decode_impl(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    sliding_window: int = 0,
) -> None:
    check_decode(query, key_cache, value_cache, block_tables, seq_lens, out)
    _call_decode(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        scale,
        out,
        generic_only=False,
        window=sliding_window,
    )


def _paged_decode_fake(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    sliding_window: int = 0,
) -> None:
    check_decode(query, key_cache, value_cache, block_tables, seq_lens, out)


def _kernel_args(
    num_seqs: int,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    generic_only: bool,
    window: int = 0,
) -> _DecodeArgs:
    """The argument struct both kernels take (``csrc/paged_decode.c``, ``csrc/paged_prefill.c``):
    shapes and strides of checked tensors; ``query``/``out`` strides are per token row; ``window``
    a sliding window (0: none)."""
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    return _DecodeArgs(
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        scale,
        torch.get_num_threads(),
        int(generic_only),
        window,
    )


def _required_library() -> ctypes.CDLL:
    """The loaded library, or RuntimeError for a caller that did not check ``available()``."""
    lib = library()
    if lib is None:
        raise RuntimeError(
            f"the native CPU kernels are unavailable ({kernel_path()} path): check available()"
        )
    return lib


def _launch(fn: Any, args: _DecodeArgs, *tensors: torch.Tensor, invalid: str = "") -> None:
    """One attention kernel call on checked tensors: its return code as an exception (-1: scratch
    memory could not be allocated; -2: index values it refused, ``invalid`` says which; nothing
    written either way)."""
    rc = fn(ctypes.byref(args), *(t.data_ptr() for t in tensors))
    if rc == -2:
        raise ValueError(invalid)
    if rc != 0:
        raise MemoryError(f"native kernel {fn.__name__}: could not allocate its scratch memory")


def _call_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    generic_only: bool,
    window: int = 0,
) -> None:
    """The ctypes call, on checked arguments."""
    lib = _required_library()
    num_seqs = query.shape[0]
    if num_seqs == 0:
        return
    args = _kernel_args(
        num_seqs, query, key_cache, block_tables, scale, out, generic_only=generic_only, window=window
    )
    if key_cache.dtype is torch.int8:
        fn = lib.pagedkv_decode_i8
    else:
        fn = lib.pagedkv_decode_f32 if query.dtype == torch.float32 else lib.pagedkv_decode_bf16
    _launch(fn, args, query, key_cache, value_cache, block_tables, seq_lens, out)


def decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Paged decode attention into ``out`` (``[num_seqs, num_heads, head_dim]``, the query's dtype),
    through ``torch.ops.pagedkv.paged_decode``; returns ``out``. ``sliding_window``: each query
    (at position ``seq_len - 1``) sees its last that many keys, read from the block holding the first
    of them on (blocks before it are never read).

    ``block_tables`` and ``seq_lens`` must be int32 with dense rows (``DecodePlan`` keeps them so);
    the caches are one layer's ``[num_blocks, block_size, num_kv_heads, head_dim]``. Raises
    ``ValueError``/``TypeError`` for tensors the kernel cannot take, ``RuntimeError`` when the
    kernels are unavailable (callers check ``supports`` and ``available`` and keep torch's path)."""
    if sliding_window is None:
        torch.ops.pagedkv.paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, out)
    else:
        torch.ops.pagedkv.paged_decode(
            query, key_cache, value_cache, block_tables, seq_lens, scale, out, sliding_window
        )
    return out


def prefill_supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether ``prefill`` takes these tensors: what the decode kernel takes, fp32, head_dim a
    multiple of 16 (csrc/paged_prefill.c reads rows 16 floats at a time)."""
    return (
        query.dtype is torch.float32
        and query.dim() == 3
        and query.shape[2] % 16 == 0
        and supports(query, key_cache, value_cache)
    )


def prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal paged prefill attention (``csrc/paged_prefill.c``) into ``out``; returns ``out``.
    ``sliding_window``: a row at position ``p`` sees keys ``p - sliding_window + 1 .. p`` only; keys
    are read from the block holding a task's first row's first key on.

    ``query``/``out``: ``[tokens, num_heads, head_dim]`` fp32, sequence ``i``'s rows at
    ``query_start_loc[i]:query_start_loc[i + 1]`` (int32, ``num_seqs + 1``); ``block_tables``
    ``[num_seqs, max_blocks]`` and ``seq_lens`` ``[num_seqs]`` int32 with dense rows; each sequence's
    rows are its last ones, so row ``r`` of ``q_len`` sees ``seq_len - q_len + r + 1`` keys. The
    index values are validated once per step upstream (kernels/checks.py); this checks the tensors
    (``ValueError``/``TypeError`` naming the argument). A ctypes call, not a torch op: it runs once per
    layer of a prefill step and needs no dispatcher."""
    if not prefill_supports(query, key_cache, value_cache):
        raise ValueError(
            "native prefill takes fp32 CPU tensors (or int8 caches) with head_dim a multiple of 16 and "
            f"the decode kernel's layouts; got query {query.dtype} {tuple(query.shape)}"
        )
    bt = _tensor("block_tables", block_tables, 2, (torch.int32,))
    qsl = _tensor("query_start_loc", query_start_loc, 1, (torch.int32,))
    sl = _tensor("seq_lens", seq_lens, 1, (torch.int32,))
    o = _tensor("out", out, 3, (torch.float32,))
    if o.shape != query.shape:
        raise ValueError(f"out must have query's shape {tuple(query.shape)}, got {tuple(o.shape)}")
    num_seqs = sl.shape[0]
    if bt.shape[0] != num_seqs or qsl.shape[0] != num_seqs + 1:
        raise ValueError(
            f"block_tables {tuple(bt.shape)} and query_start_loc {tuple(qsl.shape)} must match seq_lens' "
            f"{num_seqs} sequences (query_start_loc has one more entry)"
        )
    lib = _required_library()
    if num_seqs == 0 or query.shape[0] == 0:
        return out
    if int(qsl[0]) < 0 or int(qsl[-1]) > query.shape[0]:
        raise ValueError(f"query_start_loc must lie within query's {query.shape[0]} rows, got {qsl.tolist()}")
    args = _kernel_args(
        num_seqs, query, key_cache, bt, scale, out, generic_only=False, window=sliding_window or 0
    )
    _launch(
        lib.pagedkv_prefill_i8 if key_cache.dtype is torch.int8 else lib.pagedkv_prefill_f32,
        args,
        query,
        key_cache,
        value_cache,
        bt,
        qsl,
        sl,
        out,
        invalid="query_start_loc/seq_lens: a sequence has more new rows than tokens, or fewer than 0",
    )
    return out


def cascade(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    own_tables: torch.Tensor,
    own_lens: torch.Tensor,
    prefix_tables: torch.Tensor,
    prefix_starts: torch.Tensor,
    prefix_lens: torch.Tensor,
    row_map: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Decode attention with shared prefixes attended once per group (cascade); returns ``out``.

    Every sequence's own part first: the decode kernel over ``own_tables``/``own_lens`` (each row's
    blocks past its group's prefix, its whole table when it is in no group), with each (row, head)'s
    log-sum-exp. Then each group's prefix: prefix ``i`` (``prefix_tables[i]``, ``prefix_lens[i]``
    tokens) is a "sequence" of the prefill kernel whose query rows are ``row_map[prefix_starts[i]:
    prefix_starts[i + 1]]``, every row seeing every prefix key (its queries come after the prefix), its
    result merged into ``out[row]`` by the two log-sum-exps. The prefix's K/V is read once for the group
    and its products run as small matrix products, where the decode kernel computed them per member.
    Same tensors as ``prefill`` takes (``prefill_supports``); index tensors int32 with dense rows."""
    if not prefill_supports(query, key_cache, value_cache):
        raise ValueError(
            "native cascade takes fp32 CPU tensors (or int8 caches) with head_dim a multiple of 16 and "
            f"the decode kernel's layouts; got query {query.dtype} {tuple(query.shape)}"
        )
    i8 = key_cache.dtype is torch.int8
    check_decode(query, key_cache, value_cache, own_tables, own_lens, out)
    pt = _tensor("prefix_tables", prefix_tables, 2, (torch.int32,))
    ps = _tensor("prefix_starts", prefix_starts, 1, (torch.int32,))
    pl = _tensor("prefix_lens", prefix_lens, 1, (torch.int32,))
    rm = _tensor("row_map", row_map, 1, (torch.int32,))
    groups, num_seqs = pl.shape[0], query.shape[0]
    if pt.shape[0] != groups or ps.shape[0] != groups + 1:
        raise ValueError(
            f"prefix_tables {tuple(pt.shape)} and prefix_starts {tuple(ps.shape)} must match prefix_lens' "
            f"{groups} prefixes (prefix_starts has one more entry)"
        )
    if groups and (int(ps[0]) != 0 or int(ps[-1]) != rm.shape[0]):
        raise ValueError(f"prefix_starts must run from 0 to row_map's {rm.shape[0]} rows, got {ps.tolist()}")
    if groups and int(pl.min()) < 1:
        raise ValueError(f"prefix_lens: a prefix is empty, got {pl.tolist()}")
    if rm.shape[0] and (int(rm.min()) < 0 or int(rm.max()) >= num_seqs):
        raise ValueError(f"row_map must name rows of query's {num_seqs}, got {rm.tolist()}")
    lib = _required_library()
    if num_seqs == 0:
        return out
    lse = torch.empty(num_seqs, query.shape[1], dtype=torch.float32)
    args = _kernel_args(num_seqs, query, key_cache, own_tables, scale, out, generic_only=False)
    own = lib.pagedkv_decode_i8_lse if i8 else lib.pagedkv_decode_f32_lse
    _launch(own, args, query, key_cache, value_cache, own_tables, own_lens, out, lse)
    if groups == 0:
        return out
    args = _kernel_args(groups, query, key_cache, pt, scale, out, generic_only=False)
    _launch(
        lib.pagedkv_prefill_prefix_i8 if i8 else lib.pagedkv_prefill_prefix_f32,
        args,
        query,
        key_cache,
        value_cache,
        pt,
        ps,
        pl,
        out,
        rm,
        lse,
        invalid="prefix_starts/prefix_lens: a prefix is empty or has a negative row count",
    )
    return out


def write_kv_i8(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Quantize token i's K/V rows into int8 cache slot ``slots[i]`` (int64; -1 skips), each row's
    values and scale as ``kernels/quant.py`` computes them (the same bytes). ``key``/``value`` fp32
    ``[tokens, kv_heads, head_dim]`` with dense rows; the caches one layer's int8
    ``[blocks, block_size, kv_heads, head_dim + 4]``, laid out alike. Validated upstream
    (kernels/checks.py); the library must be available."""
    lib = _required_library()
    n, h, d = key.shape
    sl = slots.contiguous()
    lib.pagedkv_write_kv_i8(
        n,
        h,
        d,
        key_cache.shape[1],
        key.data_ptr(),
        key.stride(0),
        key.stride(1),
        value.data_ptr(),
        value.stride(0),
        value.stride(1),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        sl.data_ptr(),
        torch.get_num_threads(),
    )


def decode_generic_for_bench(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """``decode`` forced onto the kernel's generic (group, head_dim) copy: only for measuring and
    testing the specialised copies against it (bench/cpu_decode_bench.py, tests)."""
    check_decode(query, key_cache, value_cache, block_tables, seq_lens, out)
    _call_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, out, generic_only=True)
    return out


def check_logsumexp(logits: torch.Tensor) -> None:
    """Raise ``ValueError``/``TypeError`` naming ``logits`` unless the kernel can read it."""
    t = _tensor("logits", logits, 2, (torch.float32,))
    if t.shape[1] == 0:
        raise ValueError("logits must have at least one column")


def _call_logsumexp(logits: torch.Tensor, argmax: torch.Tensor | None) -> torch.Tensor:
    """The ctypes call on checked logits: the rows' log-sum-exp (and their argmax into ``argmax``)."""
    lib = _required_library()
    out = torch.empty(logits.shape[0], dtype=torch.float32)
    lib.pagedkv_logsumexp_argmax_f32(
        logits.data_ptr(),
        logits.shape[0],
        logits.shape[1],
        logits.stride(0),
        out.data_ptr(),
        None if argmax is None else argmax.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def _logsumexp_impl(logits: torch.Tensor) -> torch.Tensor:
    check_logsumexp(logits)
    return _call_logsumexp(logits, None)


def _logsumexp_argmax_impl(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_logsumexp(logits)
    argmax = torch.empty(logits.shape[0], dtype=torch.int64)
    return _call_logsumexp(logits, argmax), argmax


def _logsumexp_argmax_fake(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_logsumexp(logits)
    return logits.new_empty(logits.shape[0]), logits.new_empty(logits.shape[0], dtype=torch.int64)


def _logsumexp_fake(logits: torch.Tensor) -> torch.Tensor:
    check_logsumexp(logits)
    return logits.new_empty(logits.shape[0])


# The torch ops. Why torch.library.Library and not torch.library.custom_op: custom_op's Python
# wrapper adds a cost per call larger than the one-sequence decode kernel itself, paid by every
# layer of every step (docs/kernels.md, "Torch ops", has the figures). The implementation
# is registered for every backend (CompositeExplicitAutograd), so a CUDA tensor reaches
# check_decode and gets its ValueError instead of a dispatcher error; the fake implementation
# (register_fake, also used for meta tensors) gives torch.compile the output's metadata.
_LIB = torch.library.Library("pagedkv", "DEF")
_LIB.define(
    "paged_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    "Tensor seq_lens, float scale, Tensor(a!) out, int sliding_window=0) -> ()"
)
_LIB.impl("paged_decode", _paged_decode_impl, "CompositeExplicitAutograd")
torch.library.register_fake("pagedkv::paged_decode", _paged_decode_fake, lib=_LIB)
_LIB.define("logsumexp_rows(Tensor logits) -> Tensor")
_LIB.impl("logsumexp_rows", _logsumexp_impl, "CompositeExplicitAutograd")
torch.library.register_fake("pagedkv::logsumexp_rows", _logsumexp_fake, lib=_LIB)
_LIB.define("logsumexp_argmax_rows(Tensor logits) -> (Tensor, Tensor)")
_LIB.impl("logsumexp_argmax_rows", _logsumexp_argmax_impl, "CompositeExplicitAutograd")
torch.library.register_fake("pagedkv::logsumexp_argmax_rows", _logsumexp_argmax_fake, lib=_LIB)


def _native_rows(logits: torch.Tensor) -> bool:
    """Whether the row kernels take these logits: 2-D fp32 on CPU, rows contiguous, the library there."""
    return (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.stride(1) == 1
        and logits.shape[1] > 0
        and library() is not None
    )


def logsumexp_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(logits, dim=-1)`` of 2-D fp32 CPU logits (rows contiguous), by
    ``torch.ops.pagedkv.logsumexp_rows`` when the kernels are available, else by torch. Same value
    up to fp32 rounding."""
    if not _native_rows(logits):
        return torch.logsumexp(logits, dim=-1)
    out: torch.Tensor = torch.ops.pagedkv.logsumexp_rows(logits)  # torch.ops is untyped
    return out


def logsumexp_argmax_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(torch.logsumexp(logits, -1), torch.argmax(logits, -1))`` from the same two passes over
    each row, by ``torch.ops.pagedkv.logsumexp_argmax_rows``; None where the kernels cannot take
    the logits (then the caller computes both its own way). The argmax is exactly torch's (first
    index of the maximum; the first NaN of a row holding one), the log-sum-exp up to fp32 rounding."""
    if not _native_rows(logits):
        return None
    lse, idx = torch.ops.pagedkv.logsumexp_argmax_rows(logits)  # torch.ops is untyped
    return lse, idx


def read_spans(tensors: Sequence[torch.Tensor], num_threads: int) -> int:
    """Read every byte of ``tensors`` (CPU, contiguous), in order, each split over ``num_threads``
    threads, with no arithmetic but a wrapping sum of 64-bit words (plus tail bytes), returned so the
    reads happen (``csrc/read_spans.c``). For benchmarks: the time a decode step's weight tensors
    take to stream (``bench/decode_floor.py``). RuntimeError without the library; ValueError for a
    tensor the kernel cannot read."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"tensors[{i}] must be a contiguous CPU tensor")
    lib = _required_library()
    n = len(tensors)
    ptrs = (ctypes.c_void_p * max(n, 1))(*(t.data_ptr() for t in tensors))
    sizes = (ctypes.c_int64 * max(n, 1))(*(t.numel() * t.element_size() for t in tensors))
    return int(lib.pagedkv_read_spans(n, ptrs, sizes, num_threads))
