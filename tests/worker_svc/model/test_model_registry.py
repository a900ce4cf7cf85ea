"""The model registry: config.json's architecture name picks the module that loads and runs it."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from pagedkv.worker_svc.model import llama, registry
from pagedkv.worker_svc.model.config import DEFAULT_MODEL_CONFIG, ModelConfig
from pagedkv.worker_svc.model.weights import expected_names, fuse, fused_shapes, load_model, random_weights

RAW = {
    "vocab_size": 10,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
}


def test_llama_is_registered_and_is_the_default() -> None:
    cfg = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **RAW})
    assert cfg.architecture == "LlamaForCausalLM" == DEFAULT_MODEL_CONFIG.architecture
    assert ModelConfig.from_hf_dict(RAW).architecture == registry.DEFAULT_ARCHITECTURE
    assert registry.architecture("LlamaForCausalLM") is llama
    model = load_model(None, DEFAULT_MODEL_CONFIG, torch.float32, torch.device("cpu"))
    assert isinstance(model, llama.LlamaModel)


def test_a_second_architecture_is_one_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registering a module is all it takes: config parsing, checkpoint layout, fusing and model
    building all go through it."""
    seen: list[str] = []
    mod = types.ModuleType("fake_arch")

    def check_hf_config(cfg: dict[str, Any]) -> None:
        seen.append("check")
        if cfg.get("hidden_act") != "gelu":
            raise ValueError("FakeForCausalLM uses gelu")

    def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {
            "embed.weight": (cfg.vocab_size, cfg.hidden_size),
            "w.0.a.weight": (2, cfg.hidden_size),
            "w.0.b.weight": (3, cfg.hidden_size),
        }

    mod.check_hf_config = check_hf_config  # type: ignore[attr-defined]
    mod.expected_shapes = expected_shapes  # type: ignore[attr-defined]
    mod.FUSED = {}  # type: ignore[attr-defined]
    mod.build = lambda cfg, weights: ("fake model", cfg.architecture, sorted(weights))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_arch", mod)
    monkeypatch.setitem(registry.ARCHITECTURES, "FakeForCausalLM", "fake_arch")

    with pytest.raises(ValueError, match="uses gelu"):
        ModelConfig.from_hf_dict({"architectures": ["FakeForCausalLM"], **RAW})
    cfg = ModelConfig.from_hf_dict(
        {"architectures": ["SomethingElse", "FakeForCausalLM"], "hidden_act": "gelu", **RAW}
    )
    assert cfg.architecture == "FakeForCausalLM" and seen == ["check", "check"]
    assert expected_names(cfg) == ["embed.weight", "w.0.a.weight", "w.0.b.weight"]
    w = random_weights(cfg, torch.float32, torch.device("cpu"))
    assert {n: tuple(t.shape) for n, t in w.items()} == expected_shapes(cfg) == fused_shapes(cfg)
    assert set(fuse(w, cfg)) == set(w)
    assert load_model(None, cfg, torch.float32, torch.device("cpu")) == (
        "fake model",
        "FakeForCausalLM",
        ["embed.weight", "w.0.a.weight", "w.0.b.weight"],
    )


def test_unknown_architectures_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\].*LlamaForCausalLM"):
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"], **RAW})
    with pytest.raises(
        ValueError,
        match=(
            r"unknown architecture 'GPT2LMHeadModel'; registered: "
            r"\['Gemma3ForCausalLM', 'LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM', "
            r"'Qwen3ForCausalLM'\]"
        ),
    ):
        registry.architecture("GPT2LMHeadModel")
