"""Gemma 3 (``Gemma3ForCausalLM``, GGUF ``gemma3``): llama.py's decoder with what the family changes.

- Attention: sliding-window layers (a query at position p sees keys p-W+1..p; ``layer_types`` or
  every ``sliding_window_pattern``-th layer global, 6 by default) beside full-attention ones, each
  kind with its own rotary base (``rope_local_base_freq`` 10,000 local, ``rope_theta`` 1,000,000
  global, the config's rope scaling on the global layers only); RMSNorm over each head's q and k
  before the rotary embedding; scores scaled by ``query_pre_attn_scalar ** -0.5``.
- Every RMSNorm multiplies by ``1 + weight`` (checkpoints store the offset from one; a GGUF file
  stores ``1 + weight``, which gguf_file.py turns back into the offset, as transformers does).
- Four norms a layer: before and after attention, before and after the MLP (the residual adds the
  post-norms' outputs).
- GeGLU MLP: ``gelu_tanh(gate) * up``.
- Embeddings scaled by sqrt(hidden) (rounded to the weights' dtype, as transformers does); the
  output layer is the (tied) embedding.

On CPU in fp32 the per-call path runs the fused native kernels (RMSNorm, the per-head q/k norm with
the rotary embedding and the K/V write, GELU-tanh-and-multiply: worker_svc/model/layer_ops.py), and
a decode step whose layers all run native kernels goes through the native decode chain in one call
(kernels/cpu/decode_layers.py: the same kernels on the same arguments in the same order, so the same
bits), each layer with its window, rotary table and KV-cache group.

Refused, naming the field: another activation, attention or final logit soft-capping,
bidirectional attention.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from pagedkv.kernels.cpu.decode_layers import LayerWeights
from pagedkv.kernels.quant_linear import QuantizedMatrix
from pagedkv.worker_svc.model import layer_ops, llama
from pagedkv.worker_svc.model.batch import AttentionBatch
from pagedkv.worker_svc.model.config import ModelConfig, rope_from_params
from pagedkv.worker_svc.model.kv_layout import KVLayout
from pagedkv.worker_svc.model.layer_ops import LayerOps
from pagedkv.worker_svc.model.rope import apply_rotary, cos_sin, inverse_frequencies

FUSED = llama.FUSED
ACTIVATION = "gelu_pytorch_tanh"
DEFAULT_PATTERN = 6  # transformers' default: every 6th layer global
DEFAULT_WINDOW = 4096  # transformers' default sliding_window
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
TORCH_OPS = LayerOps(kernels=None)  # q/k norms: per head, on views of the fused projection


def check_hf_config(cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or ACTIVATION
    if act != ACTIVATION:
        raise ValueError(f"unsupported hidden_activation {act!r}; Gemma 3 uses {ACTIVATION}")
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention"):
        if cfg.get(key):
            raise ValueError(f"{key}={cfg[key]!r} is not supported")
    if cfg.get("sliding_window", DEFAULT_WINDOW) is None and "sliding_attention" in layer_types(cfg):
        raise ValueError("sliding_window is null but layer_types has sliding_attention layers")


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """Each layer's ``sliding_attention`` / ``full_attention``: ``layer_types`` when given, else
    every ``sliding_window_pattern``-th layer full (transformers' rule for older configs)."""
    if cfg.get("layer_types"):
        return [str(t) for t in cfg["layer_types"]]
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or DEFAULT_PATTERN)
    n = int(cfg["num_hidden_layers"])
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]


def config_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields Gemma 3 adds: per-layer windows, the two rotary embeddings (5.x
    ``rope_parameters`` by layer type, or 4.x ``rope_theta`` / ``rope_local_base_freq`` /
    ``rope_scaling``) and the attention scale."""
    types = layer_types(cfg)
    if len(types) != int(cfg["num_hidden_layers"]):
        raise ValueError(f"layer_types has {len(types)} entries for {cfg['num_hidden_layers']} layers")
    params = dict(cfg.get("rope_parameters") or {})
    if "full_attention" in params or "sliding_attention" in params:
        by_type = {t: dict(params.get(t) or {}) for t in DEFAULT_THETA}
    else:
        by_type = {
            "full_attention": {**params, **dict(cfg.get("rope_scaling") or {})},
            "sliding_attention": {"rope_theta": cfg.get("rope_local_base_freq")},
        }
        by_type["full_attention"].setdefault("rope_theta", cfg.get("rope_theta"))
    max_len = int(cfg.get("max_position_embeddings", 8192))
    ropes = {}
    for t, p in by_type.items():
        if p.get("rope_theta") is None:
            p["rope_theta"] = DEFAULT_THETA[t]
        ropes[t] = rope_from_params(p, max_len)
    window = int(cfg.get("sliding_window", DEFAULT_WINDOW) or 0)  # null: refused by check_hf_config
    return {
        "layer_windows": tuple(window if t == "sliding_attention" else None for t in types),
        "rope": ropes["full_attention"],
        "rope_local": ropes["sliding_attention"],
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
    }


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = llama.checkpoint_shapes(
        cfg, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True
    )
    for i in range(cfg.num_layers):
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            shapes[f"model.layers.{i}.{norm}.weight"] = (cfg.hidden_size,)
    return shapes


def _norm_weight(w: torch.Tensor) -> torch.Tensor:
    """What Gemma's RMSNorm multiplies by: ``1 + weight``, in fp32 (transformers adds in fp32)."""
    return 1.0 + w.to(torch.float32)


def rms_norm(
    ops: LayerOps, x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> torch.Tensor:
    """Gemma's RMSNorm (``weight`` is ``1 + w`` in fp32; ``delta`` added to ``x`` first): fp32 runs
    llama.py's (the fused kernel on CPU), other dtypes scale in fp32 before rounding, as
    transformers' Gemma does."""
    if x.dtype is torch.float32:
        return ops.rms_norm(x, weight, eps, delta)
    if delta is not None:
        x.add_(delta)
    xf = x.to(torch.float32)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


class Gemma3Model(llama.LlamaModel):
    """llama.py's weights and projections; Gemma's norms, rotary embeddings, windows and forward."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__(cfg, weights)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        local = cfg.rope_local or cfg.rope
        self.inv_freq_local = inverse_frequencies(local, cfg.head_dim).to(self.device)
        self.windows = list(cfg.layer_windows or [None] * cfg.num_layers)
        # KV-cache groups (kv_layout.py): each layer's cache slot and block table; None: one table,
        # every layer in every block (the model runner sets it from the pool's groups).
        self.kv_layout: KVLayout | None = None
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32).to(self.dtype)
        self.norm = _norm_weight(self.norm)
        # Per layer: the norms before and after the MLP (llama's _Layer holds the other four).
        self.ffn_norms: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            assert layer.q_norm is not None and layer.k_norm is not None
            layer.input_norm, layer.post_norm = _norm_weight(layer.input_norm), _norm_weight(layer.post_norm)
            layer.q_norm, layer.k_norm = _norm_weight(layer.q_norm), _norm_weight(layer.k_norm)
            self.ffn_norms.append(
                (
                    _norm_weight(weights[p + "pre_feedforward_layernorm.weight"]),
                    _norm_weight(weights[p + "post_feedforward_layernorm.weight"]),
                )
            )

    def _chain_key(self) -> list[Any]:
        # Its MLP norms, and the layout: each layer's group and cache slot.
        return [*super()._chain_key(), *(t for pair in self.ffn_norms for t in pair), self.kv_layout]

    def _chain_layer(self, li: int, weights: LayerWeights) -> LayerWeights:
        """Gemma's layer: four norms, GELU-tanh, the local rotary table and the window on window
        layers, the layer's KV-cache group and slot."""
        window, layout = self.windows[li], self.kv_layout
        return dataclasses.replace(
            weights,
            ffn_norms=self.ffn_norms[li],
            activation="gelu_tanh",
            rope=1 if window is not None else 0,  # forward's ropes: global, local
            window=window,
            group=layout.layer_group[li] if layout is not None else 0,
            cache_slot=layout.layer_slot[li] if layout is not None else li,
        )

    def weight_tensors(self) -> list[torch.Tensor]:
        return [*super().weight_tensors(), *(t for pair in self.ffn_norms for t in pair)]

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, batch: AttentionBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        n_tok = token_ids.shape[0]
        h, hkv, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        rope_global = cos_sin(batch.positions, self.inv_freq, self.dtype)
        rope_local = cos_sin(batch.positions, self.inv_freq_local, self.dtype)
        layout = self.kv_layout
        steps = [batch.kernels_step(kv_cache, h, self.scale)]
        steps += [b.kernels_step(kv_cache, h, self.scale) for b in batch.groups]
        step = steps[0]
        if isinstance(self.embed, QuantizedMatrix):
            x = self.embed.rows(token_ids)
        else:
            x = F.embedding(token_ids, self.embed)
        x = x * self.embed_scale
        ops = layer_ops.choose(x, step)
        delta: torch.Tensor | None = None  # the last layer's MLP output, added by the next norm
        layers = list(zip(self.layers, self.ffn_norms, strict=True))
        chain = self.decode_chain() if ops.kernels is not None else None
        if chain is not None and chain.takes(steps, x, kv_cache):
            delta, layers = chain(x, [rope_global, rope_local], steps, kv_cache), []
        pre = batch.num_prefill_tokens  # prefill rows, then decode rows (linear.py's prefill_rows)
        for li, (layer, (pre_ffn, post_ffn)) in enumerate(layers):
            slot, layer_step = li, step
            if layout is not None:
                slot, layer_step = layout.layer_slot[li], steps[layout.layer_group[li]]
            key_cache, value_cache = kv_cache[slot, 0], kv_cache[slot, 1]
            window = self.windows[li]
            cos, sin = rope_local if window is not None else rope_global
            assert layer.q_norm is not None and layer.k_norm is not None
            qkv = layer.qkv(rms_norm(ops, x, layer.input_norm, eps, delta), pre)
            if x.dtype is torch.float32:  # the fused kernel on CPU (its torch path is this formula)
                q = ops.rope_store(
                    qkv,
                    cos,
                    sin,
                    h,
                    hkv,
                    d,
                    key_cache,
                    value_cache,
                    layer_step,
                    layer.q_norm,
                    layer.k_norm,
                    eps,
                )
            else:
                q, k, v = layer_ops.split_qkv(qkv, h, hkv, d)
                q = apply_rotary(rms_norm(TORCH_OPS, q, layer.q_norm, eps), cos, sin)
                k = apply_rotary(rms_norm(TORCH_OPS, k, layer.k_norm, eps), cos, sin)
                layer_step.write_kv_cache(k, v, key_cache, value_cache)
            attn = layer_step.attention(q, key_cache, value_cache, sliding_window=window)
            attn = rms_norm(ops, layer.o(attn.reshape(n_tok, h * d), pre), layer.post_norm, eps)
            gate_up = layer.gate_up(rms_norm(ops, x, pre_ffn, eps, attn), pre)
            delta = rms_norm(ops, layer.down(ops.gelu_tanh_mul(gate_up), pre), post_ffn, eps)
        if delta is not None:
            x.add_(delta)
        if not batch.logits_indices.numel():  # a pass that only writes KV (a draft model's)
            return x.new_empty((0, cfg.vocab_size), dtype=torch.float32)
        last = x.index_select(0, batch.logits_indices)
        return self.lm_head(rms_norm(ops, last, self.norm, eps), 0).to(torch.float32)


def build(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> Gemma3Model:
    return Gemma3Model(cfg, weights)
