"""Qwen2 (``Qwen2ForCausalLM``): the Llama decoder (llama.py) with biases on q, k and v (none on o).

Qwen2's config.json has no ``attention_bias`` field: the q/k/v biases are always there. Its
``sliding_window`` only counts with ``use_sliding_window: true``, which is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.worker_svc.model import llama
from pagedkv.worker_svc.model.config import ModelConfig

FUSED = llama.FUSED


def check_hf_config(cfg: dict[str, Any]) -> None:
    llama.refuse_unsupported(cfg, "Qwen2")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return llama.checkpoint_shapes(cfg, qkv_bias=True, o_bias=False, qk_norm=False)


def build(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> llama.LlamaModel:
    return llama.LlamaModel(cfg, weights)
