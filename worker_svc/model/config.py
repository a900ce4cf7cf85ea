"""The model hyper-parameters the worker needs, read from a Hugging Face ``config.json`` or a GGUF file.

Why our own dataclass rather than ``transformers.LlamaConfig``: the worker must not import
transformers (heavy, and only a test dependency), and the cache host needs only the geometry
(layers, KV heads, head size) to size the cache before any weight is loaded.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

from pagedkv.worker_svc.model import registry


@dataclass(slots=True, frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``rope_type`` is "default", "linear" (every inverse frequency
    divided by ``factor``) or "llama3" (Llama 3.1+ scaling)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # A GGUF file's rope_freqs.weight (llama.cpp's form of Llama 3 scaling): each inverse
    # frequency is divided by its factor. Empty: none.
    freq_factors: tuple[float, ...] = ()


@dataclass(slots=True, frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    name: str = "default"
    # config.json "architectures": which module runs it (registry.py)
    architecture: str = registry.DEFAULT_ARCHITECTURE
    # Per layer: the sliding attention window (a query at position p sees keys p-W+1..p) or None
    # for full attention; empty: every layer full. Only architectures that run windows set it.
    layer_windows: tuple[int | None, ...] = ()
    # The rotary embedding of the sliding-window layers where it differs from ``rope`` (Gemma 3:
    # base 10,000 local, 1,000,000 global); None: every layer uses ``rope``.
    rope_local: RopeConfig | None = None
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "hf") -> ModelConfig:
        """Build from a parsed ``config.json`` (transformers 4.x ``rope_scaling`` or 5.x
        ``rope_parameters``)."""
        arch = registry.pick(list(cfg.get("architectures") or []))
        module = registry.architecture(arch)
        module.check_hf_config(cfg)
        # An architecture's own fields (registry.py: the optional ``config_fields``).
        config_fields = getattr(module, "config_fields", None)
        extra: dict[str, Any] = config_fields(cfg) if config_fields is not None else {}
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        fields: dict[str, Any] = dict(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            name=name,
            architecture=arch,
        )
        return cls(**{**fields, **extra})

    @classmethod
    def from_dir(cls, model_dir: str | pathlib.Path) -> ModelConfig:
        path = pathlib.Path(model_dir)
        config_path = path / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        return cls.from_hf_dict(json.loads(config_path.read_text()), name=path.name or str(path))

    @classmethod
    def from_gguf(cls, gguf_path: str | pathlib.Path) -> ModelConfig:
        """From a GGUF file's metadata (gguf_file.py), checked like a config.json."""
        from dataclasses import replace

        from pagedkv.worker_svc.model import gguf_file

        path = pathlib.Path(gguf_path)
        raw, freq_factors = gguf_file.hf_config(path)
        cfg = cls.from_hf_dict(raw, name=path.name)
        if freq_factors:
            if len(freq_factors) != cfg.head_dim // 2:
                raise ValueError(
                    f"GGUF rope_freqs.weight has {len(freq_factors)} factors, expected {cfg.head_dim // 2}"
                )
            cfg = replace(cfg, rope=replace(cfg.rope, freq_factors=freq_factors))
        return cfg

    @classmethod
    def from_path(cls, model: str | pathlib.Path) -> ModelConfig:
        """``--model``: a Hugging Face directory or a GGUF file (model_source.py decides which)."""
        from pagedkv.worker_svc.model import model_source

        src = model_source.resolve(model)
        return cls.from_gguf(src.path) if src.kind == "gguf" else cls.from_dir(src.path)


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    params.update(scaling)  # 4.x keeps theta at top level and scaling in rope_scaling
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return rope_from_params(params, int(cfg.get("max_position_embeddings", 8192)))


def rope_from_params(params: dict[str, Any], max_position_embeddings: int = 8192) -> RopeConfig:
    """One rotary embedding's parameters (``rope_theta``, ``rope_type`` and its scaling fields, the
    way a config.json's ``rope_parameters`` spells them); other scaling types are refused."""
    theta = float(params.get("rope_theta", 10000.0))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]))
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3")
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", max_position_embeddings)
        ),
    )


# The built-in model used when no --model is given: tiny, so that every role runs offline and the
# tests are fast. Its weights come from a fixed seed (see weights.random_weights).
DEFAULT_MODEL_CONFIG = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope=RopeConfig(theta=10000.0),
    name="pagedkv-tiny-default",
)


def load_model_config(model: str | None) -> ModelConfig:
    """The config of ``--model DIR|FILE.gguf``, or the built-in default when none is given."""
    return DEFAULT_MODEL_CONFIG if not model else ModelConfig.from_path(model)
