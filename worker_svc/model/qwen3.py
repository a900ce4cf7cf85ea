"""Qwen3 (``Qwen3ForCausalLM``): the Llama decoder (llama.py) with an RMSNorm over each head's q and
k before the rotary embedding, and ``head_dim`` from the config (not hidden / heads).

``attention_bias`` works as in Llama (all four attention projections). Its ``sliding_window``
only counts with ``use_sliding_window: true``, which is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.worker_svc.model import llama
from pagedkv.worker_svc.model.config import ModelConfig

FUSED = llama.FUSED


def check_hf_config(cfg: dict[str, Any]) -> None:
    llama.refuse_unsupported(cfg, "Qwen3")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return llama.checkpoint_shapes(cfg, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True)


def build(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> llama.LlamaModel:
    return llama.LlamaModel(cfg, weights)
