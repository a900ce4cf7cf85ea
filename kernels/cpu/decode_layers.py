"""A decode step's decoder layers as one native call (``csrc/decode_layers.c``).

Why: at one sequence a decode step is mostly calls. SmolLM2-135M makes nine kernel calls a layer
over 30 layers; from Python each pays its argument checks, an output tensor and a ctypes crossing,
which together take longer than reading the step's weights (docs/kernels.md, "A decode step in one
call", has the figures). ``DecodeChain`` hands the same kernels the same arguments in the same order
from C, so the step's results are those of the per-call path to the bit
(tests/kernels/cpu/test_decode_layers.py compares the two), at one crossing a step.

What it runs: Llama's layer (two norms, SiLU; Qwen2's biases; Qwen3's per-head q/k norm) and
Gemma 3's (four norms, GELU-tanh, per-head q/k norm, a local and a global rotary table, sliding
windows per layer, and KV-cache groups: each layer writes and reads through its own group's slots
and block tables, at its own place in the cache; worker_svc/model/kv_layout.py). Each layer says
which (``LayerWeights``).

When it applies (``DecodeChain.build`` and ``DecodeChain.takes``): every layer's four projections
on a native kernel (packed fp32, int4, int8 or K-quant), the step a decode step on the CPU backend
whose plans (one per group and window) are the plain native kernel (no shared-prefix cascade),
fp32 activations and an fp32 cache. Any other step (a prefill, a cascade, an 8-bit cache, CUDA, the
reference or Triton backend, ``PAGEDKV_CPU_NATIVE=0``) runs the per-call path, which stays the
reference for this one. The models (worker_svc/model/llama.py, gemma3.py) ask per step.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.kernels.cpu.attention import DecodePlan
from pagedkv.kernels.cpu.linear import PackedLinear
from pagedkv.kernels.cpu.quant_linear import NativeMatmul
from pagedkv.kernels.step import PagedStep

_KINDS = {"int4": 2, "int8": 3, "kquant": 4}  # csrc/decode_layers.c's LIN_*; packed fp32 is 1
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # csrc/decode_layers.c's ACT_*
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


class _Tables(ctypes.Structure):
    """Mirrors ``TableArgs``: one KV-cache group's slots, block tables and lengths under one window."""

    _fields_: ClassVar[list[tuple[str, Any]]] = [
        ("slots", _ptr),
        ("block_tables", _ptr),
        ("seq_lens", _ptr),
        ("bt_stride", _i64),
        ("window", _i64),
    ]


class _Layer(ctypes.Structure):
    """Mirrors ``LayerArgs``."""

    _fields_: ClassVar[list[tuple[str, Any]]] = (
        [
            (name, _ptr)
            for name in ("input_norm", "post_norm", "q_norm", "k_norm", "pre_ffn_norm", "post_ffn_norm")
        ]
        + [(name, _i64) for name in ("norms", "act", "rope", "tables", "cache_slot")]
        + [
            ("qkv", _Linear),
            ("o", _Linear),
            ("gate_up", _Linear),
            ("down", _Linear),
        ]
    )


class _Chain(ctypes.Structure):
    """Mirrors ``ChainArgs``."""

    _fields_: ClassVar[list[tuple[str, Any]]] = [
        (name, _i64)
        for name in ("num_layers", "num_tokens", "hidden", "num_heads", "num_kv_heads", "head_dim", "inter")
    ] + [
        ("eps", ctypes.c_float),
        ("num_threads", ctypes.c_int),
        ("cos", _ptr * 2),
        ("sin", _ptr * 2),
        ("cs_stride", _i64),
        ("tables", _ptr),
        ("kv_base", _ptr),
        ("layer_stride", _i64),
        ("kv_stride", _i64),
        ("attn", cpu_native._DecodeArgs),
    ]


_STRUCTS = (_Linear, _Tables, _Layer, _Chain)  # in pagedkv_decode_layers_sizes' order


Projection = PackedLinear | NativeMatmul


@dataclass(slots=True, frozen=True)
class LayerWeights:
    """One decoder layer as the chain reads it: its norm weights and four projections, each a
    native kernel with its bias (None when the layer has none), and how the layer runs.

    ``q_norm`` / ``k_norm``: per-head RMSNorm weights of q and k before the rotary embedding (Qwen3,
    Gemma 3), or None. ``ffn_norms``: Gemma 3's norms before and after the MLP, which make the layer
    Gemma's (``post_norm`` then normalises the attention output, without the residual add, and the
    MLP output is normalised too); None: Llama's layer. ``activation``: a key of ``ACTIVATIONS``.
    ``rope``: which of the step's rotary tables the layer uses (the ``ropes`` index of
    ``DecodeChain.__call__``). ``window``: its sliding window (None: full attention). ``group``: its
    KV-cache group (the ``steps`` index: whose slots and block tables). ``cache_slot``: its index in
    the cache's first dimension (None: the layer's own index)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: tuple[Projection, torch.Tensor | None]
    o: tuple[Projection, torch.Tensor | None]
    gate_up: tuple[Projection, torch.Tensor | None]
    down: tuple[Projection, torch.Tensor | None]
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    ffn_norms: tuple[torch.Tensor, torch.Tensor] | None = None
    activation: str = "silu"
    rope: int = 0
    window: int | None = None
    group: int = 0
    cache_slot: int | None = None


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


def _ptr_of(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


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
    # The distinct (group, window) pairs the layers attend through: a layer's ``tables`` index.
    tables: list[tuple[int, int | None]]
    num_ropes: int  # rotary tables the layers read (1 or 2)
    cache_slots: int  # the cache's first dimension: one past the highest cache_slot

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
        sizes = (ctypes.c_int64 * len(_STRUCTS))()
        lib.pagedkv_decode_layers_sizes(sizes)
        if list(sizes) != [ctypes.sizeof(t) for t in _STRUCTS]:
            raise OSError("the decode chain's structs do not match decode_layers.py (stale build: reinstall)")
        if num_heads // num_kv_heads * head_dim > cpu_native.MAX_GROUP_X_HEAD_DIM:
            return None
        q_out = (num_heads + 2 * num_kv_heads) * head_dim
        shapes = {"qkv": (q_out, hidden), "o": (hidden, num_heads * head_dim),
                  "gate_up": (2 * inter, hidden), "down": (hidden, inter)}  # fmt: skip
        keep: list[torch.Tensor] = []
        structs = []
        tables: list[tuple[int, int | None]] = []
        for li, lw in enumerate(layers):
            norms = [(lw.input_norm, hidden), (lw.post_norm, hidden)]
            norms += [(t, head_dim) for t in (lw.q_norm, lw.k_norm) if t is not None]
            norms += [(t, hidden) for t in lw.ffn_norms or ()]
            if not all(_dense_fp32(t, n) for t, n in norms):
                return None
            if lw.activation not in ACTIVATIONS or lw.rope not in (0, 1) or lw.group < 0:
                return None
            if (lw.window is not None and lw.window < 1) or (lw.cache_slot is not None and lw.cache_slot < 0):
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
            key = (lw.group, lw.window)
            if key not in tables:
                tables.append(key)
            pre_ffn, post_ffn = lw.ffn_norms or (None, None)
            structs.append(
                _Layer(
                    lw.input_norm.data_ptr(), lw.post_norm.data_ptr(), _ptr_of(lw.q_norm), _ptr_of(lw.k_norm),
                    _ptr_of(pre_ffn), _ptr_of(post_ffn), 4 if lw.ffn_norms else 2, ACTIVATIONS[lw.activation],
                    lw.rope, tables.index(key), li if lw.cache_slot is None else lw.cache_slot, **lins,
                )
            )  # fmt: skip
        array = (_Layer * len(structs))(*structs)
        return cls(
            lib, array, keep, num_heads, num_kv_heads, head_dim, hidden, inter, eps, tables,
            1 + max(lw.rope for lw in layers), 1 + max(int(s.cache_slot) for s in structs),
        )  # fmt: skip

    def _plan(self, step: PagedStep, block_size: int, window: int | None) -> DecodePlan | None:
        """The plan the per-call path runs this step's decode rows with under ``window``, when it is
        the plain native kernel's; else None (the per-call path then decides, or raises)."""
        try:
            plan = step.decode_plan(block_size, window)
        except ValueError:  # a window the step's tables were not validated for: the per-call path raises
            return None
        if (
            isinstance(plan, DecodePlan)
            and plan.cascade is None
            and not plan.buckets_first
            and plan.native_tables is not None
            and plan.native_lens is not None
        ):
            return plan
        return None

    def takes(self, steps: Sequence[PagedStep], x: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether this step runs through the chain: ``steps`` (one per KV-cache group, each layer's
        ``group`` an index) decode steps on the CPU backend whose plans, under each layer's window,
        are the plain native kernel; fp32 rows and cache as the per-call path's fused kernels take
        them."""
        if not steps or any(
            s.backend_name != "cpu"
            or s.prefill is not None
            or s.decode is None
            or s.slot_mapping.dtype is not torch.int64
            or s.scale != steps[0].scale
            for s in steps
        ):
            return False
        if not (
            x.is_cpu
            and x.dtype is torch.float32
            and x.dim() == 2
            and x.shape[1] == self.hidden
            and x.is_contiguous()
            and kv_cache.is_cpu
            and kv_cache.dtype is torch.float32
            and kv_cache.dim() == 6
            and kv_cache.shape[0] == self.cache_slots
            and kv_cache.shape[4:] == (self.num_kv_heads, self.head_dim)
            and kv_cache.is_contiguous()
        ):
            return False
        for group, window in self.tables:
            if group >= len(steps):
                return False
            plan = self._plan(steps[group], kv_cache.shape[3], window)
            if plan is None or plan.num_seqs != x.shape[0]:
                return False
        return True

    def __call__(
        self,
        x: torch.Tensor,
        ropes: Sequence[tuple[torch.Tensor, torch.Tensor]],
        steps: Sequence[PagedStep],
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Run every layer on ``x`` (``[num_seqs, hidden]``, the residual stream, updated in place);
        returns the last layer's output, which the caller adds to ``x`` as the per-call path does.
        ``ropes``: the (cos, sin) tables the layers' ``rope`` index; ``steps``: the KV-cache groups'
        steps, which ``takes`` accepted."""
        n = x.shape[0]
        if len(ropes) < self.num_ropes:
            raise ValueError(f"the decode chain reads {self.num_ropes} rotary tables, got {len(ropes)}")
        tabs = [(c.contiguous(), s.contiguous()) for c, s in ropes[: self.num_ropes]]
        cos0 = tabs[0][0]
        for cos, sin in tabs:
            if cos.dtype is not torch.float32 or sin.dtype is not torch.float32:
                raise ValueError(f"the decode chain takes fp32 cos/sin, got {cos.dtype} {sin.dtype}")
            if cos.shape != (n, self.head_dim) or sin.shape != cos.shape:
                raise ValueError(f"cos/sin must be [{n}, {self.head_dim}], got {tuple(cos.shape)}")
        bs = kv_cache.shape[3]
        keep: list[torch.Tensor] = []  # the tensors the structs point into, alive through the call
        entries = []
        for group, window in self.tables:
            step = steps[group]
            plan = self._plan(step, bs, window)
            assert plan is not None and plan.native_tables is not None and plan.native_lens is not None
            slots = step.slot_mapping.contiguous()
            keep += [slots, plan.native_tables, plan.native_lens]
            entries.append(
                _Tables(
                    slots.data_ptr(), plan.native_tables.data_ptr(), plan.native_lens.data_ptr(),
                    plan.native_tables.stride(0), window or 0,
                )
            )  # fmt: skip
        tables = (_Tables * len(entries))(*entries)
        nt = torch.get_num_threads()
        attn = cpu_native._DecodeArgs(
            n, self.num_heads, self.num_kv_heads, self.head_dim, bs,
            self.num_heads * self.head_dim, self.head_dim,  # q [n, H, D], dense
            self.num_heads * self.head_dim, self.head_dim,  # out, the same
            kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4), 0,  # bt_stride: per layer
            steps[0].scale, nt, 0, 0,  # window: per layer
        )  # fmt: skip
        tabs += [tabs[0]] * (2 - len(tabs))  # the struct's second table, unread by a one-table model
        cos_ptrs = (_ptr * 2)(*(c.data_ptr() for c, _ in tabs))
        sin_ptrs = (_ptr * 2)(*(s.data_ptr() for _, s in tabs))
        args = _Chain(
            len(self.layers), n, self.hidden, self.num_heads, self.num_kv_heads, self.head_dim, self.inter,
            self.eps, nt, cos_ptrs, sin_ptrs, cos0.stride(0),
            ctypes.cast(tables, _ptr), kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1), attn,
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
