"""Reading Hugging Face checkpoints: config variants, Llama 3 rope, sharded safetensors."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from pagedkv.worker_svc.model.config import DEFAULT_MODEL_CONFIG, ModelConfig, load_model_config
from pagedkv.worker_svc.model.rope import inverse_frequencies
from pagedkv.worker_svc.model.weights import load_weights, random_weights
from tests.worker_svc.conftest import HFModel, build_hf_model, make_hf_config


def test_config_from_transformers_5_rope_parameters(hf_llama: HFModel) -> None:
    cfg = ModelConfig.from_dir(hf_llama.path)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.rope.rope_type == "llama3" and cfg.rope.factor == 8.0
    assert cfg.rope.original_max_position_embeddings == 32


def test_config_from_transformers_4_style_rope_scaling() -> None:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.head_dim == 8 and cfg.num_kv_heads == 4  # derived defaults
    assert cfg.rope.theta == 500000.0 and cfg.rope.factor == 32.0


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "unsupported rope_type"),
        ({"num_key_value_heads": 3}, "multiple of"),
    ],
)
def test_config_rejects_what_the_runner_cannot_run(patch: dict, match: str) -> None:
    raw = {
        "vocab_size": 10,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        **patch,
    }
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(raw)


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ],
)
def test_inverse_frequencies_equal_transformers(rope_scaling: dict | None) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = make_hf_config(rope_scaling=rope_scaling, head_dim=32)
    ours = inverse_frequencies(ModelConfig.from_hf_dict(hf_cfg.to_dict()).rope, 32)
    assert torch.equal(ours, LlamaRotaryEmbedding(hf_cfg).inv_freq)


def test_sharded_checkpoint_loads_the_same_tensors(hf_llama: HFModel, tmp_path: pathlib.Path) -> None:
    hf_llama.model.save_pretrained(tmp_path, max_shard_size="40KB")  # type: ignore[attr-defined]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    cfg = ModelConfig.from_dir(tmp_path)
    sharded = load_weights(tmp_path, cfg, torch.float32, torch.device("cpu"))
    single = load_weights(hf_llama.path, cfg, torch.float32, torch.device("cpu"))
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)


def test_missing_weight_is_named(tmp_path: pathlib.Path) -> None:
    from safetensors.torch import load_file, save_file

    hf = build_hf_model(tmp_path / "m")
    tensors = load_file(str(hf.path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(hf.path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 weights.*layers.1.mlp.up_proj"):
        load_weights(hf.path, ModelConfig.from_dir(hf.path), torch.float32, torch.device("cpu"))


def test_default_model_is_deterministic_and_offline() -> None:
    assert load_model_config(None) is DEFAULT_MODEL_CONFIG
    a = random_weights(DEFAULT_MODEL_CONFIG, torch.float32, torch.device("cpu"), seed=0)
    b = random_weights(DEFAULT_MODEL_CONFIG, torch.float32, torch.device("cpu"), seed=0)
    c = random_weights(DEFAULT_MODEL_CONFIG, torch.float32, torch.device("cpu"), seed=1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_loading_logs_tensors_loaded_of_total(hf_llama: HFModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Progress while reading (every PROGRESS_EVERY_S; 0 here: after each tensor), then the total.
    The module's logger is replaced by a recorder: structlog's capture_logs misses a logger that an
    earlier test's configuration already cached."""
    from pagedkv.worker_svc.model import weights

    logs: list[dict[str, object]] = []

    class Recorder:
        def __getattr__(self, level: str) -> object:
            return lambda event, **kw: logs.append({"event": event, "level": level, **kw})

    monkeypatch.setattr(weights, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(weights, "log", Recorder())
    cfg = ModelConfig.from_dir(hf_llama.path)
    loaded = load_weights(hf_llama.path, cfg, torch.float32, torch.device("cpu"))
    progress = [e for e in logs if e["event"] == "weights_loading"]
    total = len(loaded)
    assert [e["loaded"] for e in progress] == list(range(1, total + 1))
    assert all(e["total"] == total for e in progress)
    done = [e for e in logs if e["event"] == "weights_loaded"]
    assert len(done) == 1 and done[0]["loaded"] == done[0]["total"] == total
