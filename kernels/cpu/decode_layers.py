"""A decode step's decoder layers as one native call (``csrc/decode_layers.c``).

Why: at one sequence a decode step is mostly calls. SmolLM2-135M makes nine kernel calls a layer
over 30 layers; from Python each pays its argument checks, an output tensor and a ctypes crossing,
which together take longer than reading the step's weights (docs/kernels.md, "A decode step in one
call", has the figures). ``DecodeChain`` hands the same kernels the same arguments in the same order
from C, so the step's results are those of the per-call path to the bit
(tests/kernels/cpu/test_decode_layers.py compares the two), at one crossing a step.

When it applies (``DecodeChain.build`` and ``DecodeChain.takes``): every layer's four projections
on a native kernel (packed fp32, int4, int8 or K-quant), no per-head q/k norm, the step a decode
step on the CPU backend whose plan is the plain native kernel (no shared-prefix cascade), fp32
activations and an fp32 cache. Any other step (a prefill, a cascade, an 8-bit cache, CUDA, the
reference or Triton backend, ``PAGEDKV_CPU_NATIVE=0``) runs the per-call path, which stays the
reference for this one. The model (worker_svc/model/llama.py) asks per step.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.kernels.cpu.attention import DecodePlan
from pagedkv.kernels.cpu.linear import PackedLinear
from pagedkv.kernels.cpu.quant_linear import NativeMatmul
from pagedkv.kernels.step import PagedStep

_KINDS = {"int4": 2, "int8": 3, "kquant": 4}  # csrc/decode_layers.c's LIN_*; packed fp32 is 1
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Linear(ctypes.Structure):
    """Mirrors ``LinearArgs`` in csrc/decode_layers.c."""

    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("kind", _i64),
        ("n", _i64),
        ("k", _i64),
        ("w", _ptr),
        ("aux", _ptr),
        ("aux_int", _i64),
        ("bias", _ptr),
    ]


class _Layer(ctypes.Structure):
    """Mirrors ``LayerArgs``."""

    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
    ]


class _Chain(ctypes.Structure):
    """Mirrors ``ChainArgs``."""

    _fields_: ClassVar[list[tuple[str, Any]]] = [
        (name, _i64)
        for name in ("num_layers", "num_tokens", "hidden", "num_heads", "num_kv_heads", "head_dim", "inter")
    ] + [
        ("eps", ctypes.c_float),
        ("num_threads", ctypes.c_int),
        ("cos", _ptr),
        ("sin", _ptr),
        ("cs_stride", _i64),
        ("slots", _ptr),
        ("block_tables", _ptr),
        ("seq_lens", _ptr),
        ("kv_base", _ptr),
        ("layer_stride", _i64),
        ("kv_stride", _i64),
        ("attn", cpu_native._DecodeArgs),
    ]


Projection = PackedLinear | NativeMatmul


@dataclass(slots=True, frozen=True)
class LayerWeights:
    """One decoder layer as the chain reads it: its two norm weights and four projections, each a
    native kernel with its bias (None when the layer has none)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: tuple[Projection, torch.Tensor | None]
    o: tuple[Projection, torch.Tensor | None]
    gate_up: tuple[Projection, torch.Tensor | None]
    down: tuple[Projection, torch.Tensor | None]


def _linear(proj: Projection, bias: torch.Tensor | None) -> _Linear:
    if isinstance(proj, PackedLinear):  # its kernel adds its own bias
        b = proj.bias
        return _Linear(1, proj.out_features, proj.in_features, proj.packed.data_ptr(), None, 0,
                       b.data_ptr() if b is not None else None)  # fmt: skip
    bias_ptr = bias.contiguous().data_ptr() if bias is not None else None
    kind, w = proj.matrix.kind, proj.weights
    if kind == "int4":
        return _Linear(_KINDS[kind], proj.n, proj.k, w[0], w[1], 0, bias_ptr)
    if kind == "int8":  # (qweight, row stride, scales)
        return _Linear(_KINDS[kind], proj.n, proj.k, w[0], w[2], w[1], bias_ptr)
    return _Linear(_KINDS[kind], proj.n, proj.k, w[0], w[1], w[2], bias_ptr)  # (bytes, segments, count)


def _dense_fp32(t: torch.Tensor, n: int) -> bool:
    return t.is_cpu and t.dtype is torch.float32 and t.shape == (n,) and t.is_contiguous()


@dataclass(slots=True)
class DecodeChain:
    """The model's layers resolved once into the structs ``pagedkv_decode_layers_f32`` reads."""

    lib: Any
    layers: Any  # ctypes array of _Layer
    keep: list[torch.Tensor]  # the contiguous biases the structs point into
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    inter: int
    eps: float

    @classmethod
    def build(
        cls,
        layers: list[LayerWeights],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        hidden: int,
        inter: int,
        eps: float,
    ) -> DecodeChain | None:
        """The chain, or None when it does not apply to these layers (no native library, or a
        tensor not as the kernels read it)."""
        lib = cpu_native.library()
        if lib is None or not layers or num_heads % num_kv_heads:
            return None
        if num_heads // num_kv_heads * head_dim > cpu_native.MAX_GROUP_X_HEAD_DIM:
            return None
        q_out = (num_heads + 2 * num_kv_heads) * head_dim
        shapes = {"qkv": (q_out, hidden), "o": (hidden, num_heads * head_dim),
                  "gate_up": (2 * inter, hidden), "down": (hidden, inter)}  # fmt: skip
        keep: list[torch.Tensor] = []
        structs = []
        for lw in layers:
            if not (_dense_fp32(lw.input_norm, hidden) and _dense_fp32(lw.post_norm, hidden)):
                return None
            lins = {}
            for name, (n, k) in shapes.items():
                proj, bias = getattr(lw, name)
                if isinstance(proj, PackedLinear):
                    ok = (proj.out_features, proj.in_features) == (n, k) and bias is None
                else:
                    ok = (
                        isinstance(proj, NativeMatmul)
                        and proj.matrix.kind in _KINDS
                        and (proj.n, proj.k) == (n, k)
                    )
                if not ok or (bias is not None and not _dense_fp32(bias, n)):
                    return None
                if bias is not None:
                    keep.append(bias)
                lins[name] = _linear(proj, bias)
            structs.append(_Layer(lw.input_norm.data_ptr(), lw.post_norm.data_ptr(), **lins))
        array = (_Layer * len(structs))(*structs)
        return cls(lib, array, keep, num_heads, num_kv_heads, head_dim, hidden, inter, eps)

    def takes(self, step: PagedStep, x: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether this step runs through the chain: a decode step on the CPU backend whose plan is
        the plain native kernel, fp32 rows and cache as the per-call path's fused kernels take them."""
        d = step.decode
        if step.backend_name != "cpu" or step.prefill is not None or d is None:
            return False
        plan = d.plan
        return (
            isinstance(plan, DecodePlan)
            and plan.cascade is None
            and not plan.buckets_first
            and plan.native_tables is not None
            and plan.native_lens is not None
            and x.is_cpu
            and x.dtype is torch.float32
            and x.dim() == 2
            and x.shape == (plan.num_seqs, self.hidden)
            and x.is_contiguous()
            and kv_cache.is_cpu
            and kv_cache.dtype is torch.float32
            and kv_cache.dim() == 6
            and kv_cache.shape[0] == len(self.layers)
            and kv_cache.shape[4:] == (self.num_kv_heads, self.head_dim)
            and kv_cache.is_contiguous()
            and step.slot_mapping.dtype is torch.int64
        )

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: PagedStep, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """Run every layer on ``x`` (``[num_seqs, hidden]``, the residual stream, updated in place);
        returns the last layer's output, which the caller adds to ``x`` as the per-call path does.
        The step must be one ``takes`` accepted."""
        d = step.decode
        assert d is not None and isinstance(d.plan, DecodePlan)
        tables, lens = d.plan.native_tables, d.plan.native_lens
        assert tables is not None and lens is not None
        n = x.shape[0]
        if cos.dtype is not torch.float32 or sin.dtype is not torch.float32 or cos.shape != sin.shape:
            raise ValueError(f"the decode chain takes fp32 cos/sin of one shape, got {cos.dtype} {sin.dtype}")
        cos, sin = cos.contiguous(), sin.contiguous()
        slots = step.slot_mapping.contiguous()
        nt = torch.get_num_threads()
        bs = kv_cache.shape[3]
        attn = cpu_native._DecodeArgs(
            n, self.num_heads, self.num_kv_heads, self.head_dim, bs,
            self.num_heads * self.head_dim, self.head_dim,  # q [n, H, D], dense
            self.num_heads * self.head_dim, self.head_dim,  # out, the same
            kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4), tables.stride(0),
            step.scale, nt, 0,
        )  # fmt: skip
        args = _Chain(
            len(self.layers), n, self.hidden, self.num_heads, self.num_kv_heads, self.head_dim, self.inter,
            self.eps, nt, cos.data_ptr(), sin.data_ptr(), cos.stride(0), slots.data_ptr(),
            tables.data_ptr(), lens.data_ptr(), kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1),
            attn,
        )  # fmt: skip
        delta = torch.empty((n, self.hidden), dtype=torch.float32)
        rc = self.lib.pagedkv_decode_layers_f32(
            ctypes.byref(args), self.layers, x.data_ptr(), delta.data_ptr()
        )
        if rc == -1:
            raise MemoryError("the decode chain could not allocate its scratch memory")
        if rc == -2:
            raise ValueError("native decode: arguments rejected")
        if rc != 0:
            raise RuntimeError(f"the decode chain failed (status {rc})")
        return delta
