"""Model architectures, by the name a checkpoint's ``config.json`` gives them, one module each.

Why a registry: the architecture decides the checkpoint's tensor names and shapes, which of them
are fused for compute, which ``config.json`` values are supported, and the forward pass. All of
that lives in the architecture's module (``llama.py`` for ``LlamaForCausalLM``; ``qwen2.py``,
``qwen3.py`` and ``mistral.py`` build llama.py's decoder with their own layouts, ``gemma3.py``
extends it with its own norms, windows and forward); the config
parser, the weight loader, the shared-weights path and the model runner only ask this registry, so
a second architecture is one new module and one line in ``ARCHITECTURES``.

An architecture module provides (``Architecture``): ``FUSED`` (fused tensor -> the checkpoint
tensors it is made of), ``check_hf_config(cfg)`` (refuse what the module cannot run, naming it),
``expected_shapes(cfg)`` (every checkpoint tensor name -> shape, in checkpoint order) and
``build(cfg, weights)`` (the model: ``Model.forward(token_ids, batch, kv_cache) -> logits``).
Optionally ``config_fields(cfg)``: the ``ModelConfig`` fields the architecture reads from the
config.json itself (gemma3.py: per-layer sliding windows, its two rotary embeddings, the attention
scale).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast

from pagedkv.registry import load as load_registered

if TYPE_CHECKING:
    import torch

    from pagedkv.worker_svc.model.batch import AttentionBatch
    from pagedkv.worker_svc.model.config import ModelConfig

# config.json "architectures" entry -> the module implementing it (imported on first use).
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "pagedkv.worker_svc.model.llama",
    "Qwen2ForCausalLM": "pagedkv.worker_svc.model.qwen2",
    "Qwen3ForCausalLM": "pagedkv.worker_svc.model.qwen3",
    "MistralForCausalLM": "pagedkv.worker_svc.model.mistral",
    "Gemma3ForCausalLM": "pagedkv.worker_svc.model.gemma3",
}
# The built-in offline model (no --model) and a config.json that names no architecture.
DEFAULT_ARCHITECTURE = "LlamaForCausalLM"


class Model(Protocol):
    """What the model runner needs of a model."""

    cfg: ModelConfig
    dtype: torch.dtype

    def forward(self, token_ids: torch.Tensor, batch: AttentionBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[num_seqs, vocab]`` of each sequence's last token (``batch.logits_indices``)."""
        ...

    @property
    def linear_path(self) -> str:
        """Which linear layer runs the model's matrices (``worker_svc/model/linear.py``: ``native``,
        ``onednn``, ``torch``, ``int4`` or ``int8``; distinct ones joined by ``+``), for the
        worker's start-up log."""
        ...

    @property
    def weight_bytes(self) -> int:
        """Resident bytes of the weights the model computes with (each tensor once)."""
        ...


class Architecture(Protocol):
    FUSED: dict[str, tuple[str, ...]]

    def check_hf_config(self, cfg: dict[str, Any]) -> None: ...

    def expected_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, ...]]: ...

    def build(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> Model: ...


def pick(names: list[str]) -> str:
    """The first of a config.json's ``architectures`` that is registered (the default when empty)."""
    if not names:
        return DEFAULT_ARCHITECTURE
    for name in names:
        if name in ARCHITECTURES:
            return name
    raise ValueError(f"unsupported architecture {names}; expected one of {tuple(ARCHITECTURES)}")


def architecture(name: str) -> Architecture:
    return cast(Architecture, load_registered(ARCHITECTURES, name, "architecture"))


def build_model(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> Model:
    """``cfg.architecture``'s model on ``weights`` (the fused compute tensors or the checkpoint's)."""
    return architecture(cfg.architecture).build(cfg, weights)
