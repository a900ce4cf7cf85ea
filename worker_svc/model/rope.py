"""Rotary position embeddings, including linear ("rope_type": "linear": positions divided by the
factor, as Gemma 3's global layers use) and Llama 3's frequency scaling ("rope_type": "llama3").

The numbers follow Hugging Face's implementation operation for operation (inverse frequencies in
fp32, ``position * inv_freq`` in fp32, ``cat(freqs, freqs)``, rotate-half), so that the worker and
``transformers`` agree to the last bits in fp32 and greedy decoding picks the same tokens.
"""

from __future__ import annotations

import math

import torch

from pagedkv.worker_svc.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """fp32 ``[head_dim // 2]`` inverse frequencies, with linear or Llama 3 scaling when configured."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.freq_factors:  # a GGUF file's rope_freqs.weight: llama.cpp's form of the scaling below
        return inv_freq / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor = rope.factor
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num_tokens, head_dim]`` cos and sin for the given absolute positions."""
    freqs = positions[:, None].to(torch.float32) * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[num_tokens, num_heads, head_dim]`` by per-token cos/sin ``[num_tokens, head_dim]``."""
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    return (x * cos) + (_rotate_half(x) * sin)
