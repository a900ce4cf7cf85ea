"""The elementwise parts of a decoder layer: RMSNorm (with the residual add), SiLU- and
GELU-tanh-and-multiply, and the rotary embedding (after the per-head q/k norm, where a model has
one) with the KV write. One decision, made once per forward pass: fused native kernels
(``kernels/cpu/layer_ops.py``) or the torch composition.

Why a choice: on CPU in fp32, with the step's attention on the CPU backend and the native library
loaded, the fused kernels do in one call what torch does in about 25 small operators a layer
(bench/layer_ops_bench.py measures both on a layer of the real small-model shape). Everywhere
else (CUDA, bf16, the reference or Triton backend, ``PAGEDKV_CPU_NATIVE=0``) the torch composition
runs: it is Hugging Face's arithmetic, and the reference the fused path is tested against
(tests/worker_svc/model/test_layer_ops.py).

Both paths share one contract: ``rms_norm`` with a ``delta`` adds it to ``x`` in place first, so
``x`` is the layer's running residual sum; ``rope_store`` returns q and writes k and v to the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedkv.kernels.cpu import layer_ops as cpu_layer_ops
from pagedkv.kernels.step import PagedStep
from pagedkv.worker_svc.model.rope import apply_rotary


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: statistics in fp32, scale in the input dtype (as Hugging Face does)."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass(slots=True, frozen=True)
class LayerOps:
    """The layer's elementwise operations: fused (``kernels`` bound to the native library, on CPU
    fp32) or, with ``kernels`` None, as torch operators."""

    kernels: cpu_layer_ops.LayerKernels | None

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x += delta`` in place when ``delta`` is given, then RMSNorm(x) as a new tensor."""
        if self.kernels is not None:
            return self.kernels.rms_norm(x, weight, eps, delta)
        if delta is not None:
            x.add_(delta)
        return torch_rms_norm(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of fused ``[n, 2 * inter]`` rows."""
        if self.kernels is not None:
            return self.kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` of fused ``[n, 2 * inter]`` rows (Gemma 3's GeGLU)."""
        if self.kernels is not None:
            return self.kernels.gelu_tanh_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rope_store(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        step: PagedStep,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        eps: float = 0.0,
    ) -> torch.Tensor:
        """Rotated q ``[n, num_heads, head_dim]``; rotated k and v written to the step's cache slots.
        With ``q_norm`` and ``k_norm`` (Qwen3, Gemma 3 in fp32: Gemma passes ``1 + w``) each q and k
        head is RMS-normalised first (``torch_rms_norm``'s formula)."""
        if self.kernels is not None and key_cache.dtype is qkv.dtype:  # an 8-bit cache quantizes below
            return self.kernels.rope_store(
                qkv, cos, sin, num_heads, num_kv_heads, key_cache, value_cache, step.slot_mapping,
                q_norm, k_norm, eps,
            )  # fmt: skip
        q, k, v = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
        if q_norm is not None:
            q = torch_rms_norm(q, q_norm, eps)
        if k_norm is not None:
            k = torch_rms_norm(k, k_norm, eps)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        step.write_kv_cache(k, v, key_cache, value_cache)
        return q


def split_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of the fused ``[n, (H + 2 * Hkv) * D]`` projection as q, k, v heads."""
    n, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].reshape(n, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].reshape(n, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].reshape(n, num_kv_heads, head_dim)
    return q, k, v


def choose(x: torch.Tensor, step: PagedStep) -> LayerOps:
    """Fused when the step runs on the CPU backend in fp32 and the native library is loaded."""
    fusable = (
        x.is_cpu
        and x.dtype is torch.float32
        and step.backend_name == "cpu"
        and step.slot_mapping.dtype is torch.int64
    )
    return LayerOps(kernels=cpu_layer_ops.load() if fusable else None)
