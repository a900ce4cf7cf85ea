"""Mistral (``MistralForCausalLM``): the Llama decoder (llama.py) without biases.

What sets Mistral apart is ``sliding_window``: refused when it is shorter than
``max_position_embeddings`` (Mistral 7B v0.1's 4096), accepted when null (v0.2 onwards) or at
least the context (it then never drops a token). llama.cpp converts Mistral to GGUF architecture
``llama``, which loads through llama.py.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.worker_svc.model import llama
from pagedkv.worker_svc.model.config import ModelConfig

FUSED = llama.FUSED


def check_hf_config(cfg: dict[str, Any]) -> None:
    llama.refuse_unsupported(cfg, "Mistral")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return llama.checkpoint_shapes(cfg, qkv_bias=False, o_bias=False, qk_norm=False)


def build(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> llama.LlamaModel:
    return llama.LlamaModel(cfg, weights)
