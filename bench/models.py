"""The one builder of the random Llama checkpoints the benchmarks run (no download, no tokenizer).

Why transformers writes them: the checkpoint is then exactly what a user would point ``--model``
at (config.json + safetensors), and the benchmarks that compare against transformers load the same
files. Each benchmark keeps its own shape; what they share (the seed, fp32, an untied head unless
asked, sharp distributions when asked) is decided here once.
"""

from __future__ import annotations

import pathlib
from typing import Any


def llama_config(
    *,
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    max_positions: int = 4096,
    **extra: Any,
) -> Any:  # -> transformers.LlamaConfig
    """A ``LlamaConfig`` with an untied head; ``extra`` sets any other field (``head_dim``,
    ``initializer_range``: larger than HF's 0.02 gives sharp next-token distributions, no greedy
    near-ties; ``tie_word_embeddings``, ``rope_theta``, ...)."""
    from transformers import LlamaConfig

    fields: dict[str, Any] = {"tie_word_embeddings": False, **extra}
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        **fields,
    )


def save_random_llama(path: pathlib.Path, config: Any, seed: int = 0) -> pathlib.Path:
    """Random weights (``torch.manual_seed(seed)``) for ``config``, saved to ``path``; the directory
    name is the name `pagedkv serve` gives the model."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


def gqa_llama(
    path: pathlib.Path,
    *,
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    intermediate: int,
    seed: int = 0,
    **extra: Any,
) -> pathlib.Path:
    """A Llama with half as many KV heads as query heads (at least one), saved to ``path``."""
    cfg = llama_config(
        vocab=vocab,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=max(1, heads // 2),
        intermediate=intermediate,
        **extra,
    )
    return save_random_llama(path, cfg, seed)


def tiny_llama(path: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """The smallest model the stack benchmarks run (2 layers, hidden 64, vocab 128, GQA 4:2), with
    sharp distributions: the fault scenarios compare tokens across runs."""
    cfg = llama_config(
        vocab=128,
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=128,
        max_positions=512,
        initializer_range=0.2,
    )
    return save_random_llama(path, cfg, seed)
