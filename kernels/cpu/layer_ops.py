"""The fused elementwise parts of a decoder layer on CPU (``csrc/layer_ops.c``), for fp32 tensors.

Why: around its four GEMMs a Llama layer runs about 25 small torch operators (RMSNorm alone is
eight), each with its dispatch and output allocation, on the few dozen rows of a decode step; on a
30-layer model of hidden 576 that is several milliseconds a step. Each function here is one call
doing the same arithmetic (the C file says how closely it matches torch's). The model decides
when to use them (``worker_svc/model/layer_ops.py``): CPU, fp32, the native library loaded.

Called through ctypes, not as ``torch.ops``: these run 90 times a step on a 30-layer model, and a
dispatcher round trip into Python costs about what the kernels themselves take on a decode step's
few rows (docs/kernels.md, "Torch ops", has the cost of a call through the op). The attention and
log-sum-exp kernels, called once per layer or step, are torch ops (``kernels/cpu/native.py``).
Arguments are checked before any pointer is used (``ValueError`` naming the argument); the checks
are attribute reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.kernels.cpu import native as cpu_native


def available() -> bool:
    """Whether the native library (with these functions) is loaded."""
    return cpu_native.library() is not None


def load() -> LayerKernels | None:
    """The fused operations bound to the loaded library, or None when it is unavailable. Bound once
    (per forward pass, by the model): the library lookup reads ``PAGEDKV_CPU_NATIVE``, which the
    90 calls of a step need not repeat."""
    lib = cpu_native.library()
    return LayerKernels(lib) if lib is not None else None


def _rows(name: str, t: torch.Tensor, width: int | None = None) -> None:
    """``t``: a 2-D fp32 CPU tensor with dense rows (of ``width`` columns when given)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu or t.dtype is not torch.float32 or t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(
            f"{name} must be a 2-D fp32 CPU tensor with dense rows, got {t.dtype} {tuple(t.shape)} "
            f"strides {t.stride()} on {t.device}"
        )
    if width is not None and t.shape[1] != width:
        raise ValueError(f"{name} must have {width} columns, got {t.shape[1]}")


@dataclass(slots=True, frozen=True)
class LayerKernels:
    """The fused operations of ``csrc/layer_ops.c``, bound to the loaded library."""

    lib: Any  # the ctypes library (kernels/cpu/native.py sets the functions' argument types)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``weight * (x / sqrt(mean(x^2) + eps))`` row by row, into a new tensor. With ``delta``,
        ``x += delta`` first, in place (the residual add): ``x`` then holds the layer's running sum."""
        _rows("x", x)
        n, h = x.shape
        w = weight
        if not w.is_cpu or w.dtype is not torch.float32 or w.shape != (h,) or w.stride(0) != 1:
            raise ValueError(f"weight must be a dense fp32 CPU tensor of shape ({h},), got {tuple(w.shape)}")
        if delta is not None:
            _rows("delta", delta, h)
            if delta.shape[0] != n:
                raise ValueError(f"delta has {delta.shape[0]} rows, x {n}")
        out = torch.empty((n, h), dtype=torch.float32)
        if n:
            self.lib.pagedkv_rms_norm_f32(
                n,
                h,
                x.data_ptr(),
                x.stride(0),
                delta.data_ptr() if delta is not None else None,
                delta.stride(0) if delta is not None else 0,
                weight.data_ptr(),
                out.data_ptr(),
                h,
                eps,
                torch.get_num_threads(),
            )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of fused ``[n, 2 * inter]`` rows (gate first), as ``[n, inter]``."""
        return self._gated(self.lib.pagedkv_silu_mul_f32, gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` (torch's ``gelu`` with ``approximate="tanh"``, Gemma 3's GeGLU) of
        fused ``[n, 2 * inter]`` rows (gate first), as ``[n, inter]``."""
        return self._gated(self.lib.pagedkv_gelu_tanh_mul_f32, gate_up)

    @staticmethod
    def _gated(fn: Any, gate_up: torch.Tensor) -> torch.Tensor:
        _rows("gate_up", gate_up)
        n, two_inter = gate_up.shape
        if two_inter % 2:
            raise ValueError(f"gate_up must have an even number of columns, got {two_inter}")
        inter = two_inter // 2
        out = torch.empty((n, inter), dtype=torch.float32)
        if n:
            fn(
                n,
                inter,
                gate_up.data_ptr(),
                gate_up.stride(0),
                out.data_ptr(),
                inter,
                torch.get_num_threads(),
            )
        return out

    def rope_store(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        eps: float = 0.0,
    ) -> torch.Tensor:
        """Rotary embedding (rotate-half) of the q and k heads of fused ``[n, (H + 2 * Hkv) * D]`` rows.
        Returns q ``[n, H, D]``; each token's rotated k and its v go straight to cache slot
        ``slot_mapping[i]`` (``-1`` skips the token) of one layer's caches ``[blocks, block_size, Hkv, D]``.
        ``cos``/``sin``: ``[n, D]`` per token. Slot values are the step's, validated once per step
        (``kernels/step.py``); only their count and type are checked here. ``q_norm`` / ``k_norm``
        (``[D]`` fp32, each or both): every q / k head is RMS-normalised with that weight and ``eps``
        before its rotation (Qwen3's and Gemma 3's per-head norm; Gemma passes ``1 + w``)."""
        _rows("qkv", qkv)
        _rows("cos", cos)
        _rows("sin", sin)
        n = qkv.shape[0]
        kc, vc = key_cache, value_cache
        if kc.dim() != 4 or vc.shape != kc.shape or vc.stride() != kc.stride():
            raise ValueError(
                f"key_cache/value_cache must be alike [blocks, block_size, kv_heads, head_dim], got "
                f"{tuple(key_cache.shape)} / {tuple(value_cache.shape)}"
            )
        _, block_size, kv_heads, d = key_cache.shape
        if (
            not key_cache.is_cpu
            or key_cache.dtype is not torch.float32
            or value_cache.dtype is not torch.float32
            or key_cache.stride(3) != 1
        ):
            raise ValueError("key_cache/value_cache must be fp32 CPU tensors with dense head rows")
        if kv_heads != num_kv_heads or d % 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d:
            raise ValueError(
                f"qkv has {qkv.shape[1]} columns; {num_heads} query and {num_kv_heads} KV heads of the "
                f"cache's head_dim {d} (with {kv_heads} KV heads) need {(num_heads + 2 * num_kv_heads) * d}"
            )
        if cos.shape != (n, d) or sin.shape != (n, d):
            raise ValueError(f"cos/sin must be [{n}, {d}], got {tuple(cos.shape)} / {tuple(sin.shape)}")
        if cos.stride(0) != sin.stride(0):
            raise ValueError("cos and sin must have the same row stride")
        if not slot_mapping.is_cpu or slot_mapping.dtype is not torch.int64 or slot_mapping.shape != (n,):
            raise ValueError(
                f"slot_mapping must be int64 CPU [{n}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
            )
        for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
            if w is not None and (
                not w.is_cpu or w.dtype is not torch.float32 or w.shape != (d,) or w.stride(0) != 1
            ):
                raise ValueError(
                    f"{name} must be a dense fp32 CPU tensor of shape ({d},), got {tuple(w.shape)}"
                )
        if (q_norm is not None or k_norm is not None) and d > cpu_native.MAX_GROUP_X_HEAD_DIM:
            raise ValueError(
                f"head_dim {d} is over {cpu_native.MAX_GROUP_X_HEAD_DIM} (a head is normed on stack)"
            )
        slots = slot_mapping.contiguous()
        q = torch.empty((n, num_heads, d), dtype=torch.float32)
        if n:
            self.lib.pagedkv_rope_store_f32(
                n,
                num_heads,
                num_kv_heads,
                d,
                qkv.data_ptr(),
                qkv.stride(0),
                cos.data_ptr(),
                sin.data_ptr(),
                cos.stride(0),
                q.data_ptr(),
                key_cache.data_ptr(),
                value_cache.data_ptr(),
                block_size,
                key_cache.stride(0),
                key_cache.stride(1),
                key_cache.stride(2),
                slots.data_ptr(),
                q_norm.data_ptr() if q_norm is not None else None,
                k_norm.data_ptr() if k_norm is not None else None,
                eps,
                torch.get_num_threads(),
            )
        return q
