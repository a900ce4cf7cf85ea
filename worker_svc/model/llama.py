"""The Llama architecture (``LlamaForCausalLM``): its checkpoint layout and its forward pass on a
paged KV cache.

Registered in ``registry.py``; what an architecture module provides is listed there
(``check_hf_config``, ``expected_shapes``, ``FUSED``, ``build``).

One call processes a flat batch of tokens from many sequences at once: the prefill sequences'
tokens first, then the decode sequences' (one token each), as laid out by ``model_runner``. Dense
layers run on all tokens together, their elementwise parts (RMSNorm with the residual add, RoPE
with the KV write, SiLU-and-multiply) through ``layer_ops.py`` (fused native kernels on CPU fp32);
per layer the new K/V are written into the shared cache and attention reads the cache through
block tables with ``pagedkv.kernels.paged_prefill_attention`` (causal, queries are the last tokens of each
sequence) and ``pagedkv.kernels.paged_decode_attention`` (one query per sequence).

Why a plain class holding tensors instead of ``nn.Module``: there is no training, no state dict
round trip and no hooks; fused weight matrices (QKV, gate+up) are built once at load, and packed
for oneDNN there on CPU (``linear.py``).

The step's attention metadata is validated, its kernel backend chosen and the backend's plans
(e.g. the CPU backend's length buckets and masks) built once per forward
(``AttentionBatch.kernels_step``, ``kernels/step.py``); every layer then calls the backend directly.

A decode step whose layers all run native CPU kernels goes through them in one native call instead
(``kernels/cpu/decode_layers.py``: the same kernels, arguments and order, so the same results to the
bit, without a Python call per kernel); every other step, and the per-call reference, is the loop
below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagedkv.kernels.cpu.decode_layers import DecodeChain, LayerWeights
from pagedkv.kernels.quant_linear import QuantizedMatrix
from pagedkv.worker_svc.model import layer_ops
from pagedkv.worker_svc.model.batch import AttentionBatch
from pagedkv.worker_svc.model.config import ModelConfig
from pagedkv.worker_svc.model.linear import Linear
from pagedkv.worker_svc.model.rope import cos_sin, inverse_frequencies


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear  # [(H + 2 * Hkv) * D, hidden]
    o: Linear
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear
    # Qwen3: RMSNorm over each head's q and k before the rotary embedding ([head_dim]); else None.
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


# The fused projections the model computes with, by the checkpoint names they are made of. A
# weights dict may carry them already fused (weights.fuse: what the cache host shares with workers).
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def check_hf_config(cfg: dict[str, Any]) -> None:
    """Refuse a config.json this module cannot run, naming the value."""
    refuse_unsupported(cfg, "Llama")


def refuse_unsupported(cfg: dict[str, Any], family: str) -> None:
    """What no module built on this decoder runs, refused naming the config field: another
    activation, mixture-of-experts layers, a sliding attention window that is in effect (one at
    least as long as the context never drops a token, so it is accepted). Unsupported rope scaling
    types are refused by the config parser (config.py), which all architectures share."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r}; {family} uses silu")
    for moe in ("num_experts", "num_local_experts", "n_routed_experts"):
        if cfg.get(moe):
            raise ValueError(f"{moe}={cfg[moe]}: mixture-of-experts models are not supported")
    if "sliding_attention" in (cfg.get("layer_types") or []):
        raise ValueError(
            "layer_types has sliding_attention layers: sliding-window attention is not supported"
        )
    if cfg.get("use_sliding_window"):  # Qwen2/Qwen3: sliding_window only counts when this is set
        raise ValueError("use_sliding_window=true: sliding-window attention is not supported")
    window, max_len = cfg.get("sliding_window"), int(cfg.get("max_position_embeddings", 4096))
    if "use_sliding_window" not in cfg and window is not None and int(window) < max_len:
        raise ValueError(
            f"sliding_window={window} (< max_position_embeddings {max_len}): sliding-window "
            "attention is not supported"
        )


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor (Hugging Face names) a Llama checkpoint provides -> its shape, in checkpoint
    order (the order the built-in model's seeded random weights are drawn in)."""
    return checkpoint_shapes(cfg, qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=False)


def checkpoint_shapes(
    cfg: ModelConfig, *, qkv_bias: bool, o_bias: bool, qk_norm: bool
) -> dict[str, tuple[int, ...]]:
    """The decoder's tensors with the variations the Llama-like families differ by: biases on
    q/k/v (Qwen2) or on all four attention projections (Llama's attention_bias), and per-head q/k
    RMSNorm weights (Qwen3)."""
    h, d, i, vocab = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    attn = {
        "q_proj": (q, h, qkv_bias),
        "k_proj": (kv, h, qkv_bias),
        "v_proj": (kv, h, qkv_bias),
        "o_proj": (h, q, o_bias),
    }
    mlp = {
        "gate_proj": (i, h, cfg.mlp_bias),
        "up_proj": (i, h, cfg.mlp_bias),
        "down_proj": (h, i, cfg.mlp_bias),
    }
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for group, projs in (("self_attn", attn), ("mlp", mlp)):
            for proj, (rows, cols, bias) in projs.items():
                shapes[f"{p}{group}.{proj}.weight"] = (rows, cols)
                if bias:
                    shapes[f"{p}{group}.{proj}.bias"] = (rows,)
        if qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
    return shapes


def fused_tensor(w: dict[str, torch.Tensor], name: str) -> torch.Tensor | None:
    """``w[name]`` when given fused, else the concatenation of its parts (None when a part, e.g. a
    bias, is absent). ``name`` is like ``model.layers.0.self_attn.qkv_proj.weight``."""
    if name in w:
        return w[name]
    prefix, _, rest = name.rpartition(".layers.")
    layer, _, key = rest.partition(".")
    proj, _, kind = key.rpartition(".")
    parts = [w.get(f"{prefix}.layers.{layer}.{part}.{kind}") for part in FUSED[proj]]
    if any(t is None for t in parts):
        return None
    return torch.cat(parts).contiguous()  # type: ignore[arg-type]


def matrix(w: dict[str, torch.Tensor], name: str, out_features: int) -> torch.Tensor | QuantizedMatrix | None:
    """The weight matrix ``name`` (``...qkv_proj.weight``): integers when the dict holds it quantized
    (``X.qweight`` + ``X.qscale``, weights.fuse), else the dense tensor (fused when given in parts)."""
    base = name.removesuffix("weight")
    if base + "qweight" in w:
        return QuantizedMatrix(w[base + "qweight"], w[base + "qscale"], out_features)
    return fused_tensor(w, name) if ".layers." in name else w.get(name)


class LlamaModel:
    """Weights plus ``forward(token_ids, batch, kv_cache) -> logits of each sequence's last token``.

    The decoder the Llama-like families share (qwen2.py, qwen3.py, mistral.py build it): which
    optional tensors the weights hold (biases, q/k norms) is all that differs between them."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        w = weights
        h, hkv, d, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        embed = matrix(w, "model.embed_tokens.weight", cfg.vocab_size)
        assert embed is not None
        self.embed = embed
        self.norm = w["model.norm.weight"]
        head = embed if cfg.tie_word_embeddings else matrix(w, "lm_head.weight", cfg.vocab_size)
        assert head is not None
        self.lm_head = Linear.build(head)
        # Quantized weights compute in fp32 (the integer matmuls' activations); dense ones in their dtype.
        self.dtype = self.norm.dtype if isinstance(embed, QuantizedMatrix) else embed.dtype
        self.device = self.norm.device
        self.inv_freq = inverse_frequencies(cfg.rope, cfg.head_dim).to(self.device)
        self.scale = cfg.head_dim**-0.5
        # Decode steps through one native call where the layers allow it (``decode_chain``); off,
        # every step runs the per-call loop (benchmarks compare the two).
        self.chain_decode = True
        # The projections the chain was built from: held, so that identity means the same objects.
        self._chain_for: list[Any] = []
        self._chain: DecodeChain | None = None
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."

            def bias(name: str, p: str = p) -> torch.Tensor | None:
                return w.get(p + name)

            w_qkv = matrix(w, p + "self_attn.qkv_proj.weight", (h + 2 * hkv) * d)
            w_gate_up = matrix(w, p + "mlp.gate_up_proj.weight", 2 * inter)
            w_o = matrix(w, p + "self_attn.o_proj.weight", cfg.hidden_size)
            w_down = matrix(w, p + "mlp.down_proj.weight", cfg.hidden_size)
            assert w_qkv is not None and w_gate_up is not None and w_o is not None and w_down is not None
            self.layers.append(
                _Layer(
                    input_norm=w[p + "input_layernorm.weight"],
                    post_norm=w[p + "post_attention_layernorm.weight"],
                    qkv=Linear.build(w_qkv, fused_tensor(w, p + "self_attn.qkv_proj.bias")),
                    o=Linear.build(w_o, bias("self_attn.o_proj.bias")),
                    gate_up=Linear.build(w_gate_up, fused_tensor(w, p + "mlp.gate_up_proj.bias")),
                    down=Linear.build(w_down, bias("mlp.down_proj.bias")),
                    q_norm=w.get(p + "self_attn.q_norm.weight"),
                    k_norm=w.get(p + "self_attn.k_norm.weight"),
                )
            )

    def decode_chain(self) -> DecodeChain | None:
        """The layers as one native decode call, built on first use and again whenever a layer's
        projections or norm weights (``_chain_key``) were replaced (benchmarks and tests swap them);
        None when some layer does not run native kernels, or ``chain_decode`` is off."""
        if not self.chain_decode:
            return None
        key = self._chain_key()
        old = self._chain_for
        if len(key) != len(old) or any(a is not b for a, b in zip(key, old, strict=True)):
            self._chain_for, self._chain = key, self._build_chain()
        return self._chain

    def _chain_key(self) -> list[Any]:
        """What the chain is built from, compared by identity: the layers' projections and norm
        weights (the chain points into them)."""
        return [
            part
            for layer in self.layers
            for part in (layer.qkv, layer.o, layer.gate_up, layer.down, layer.input_norm, layer.post_norm)
            + (layer.q_norm, layer.k_norm)
        ]

    def _chain_layer(self, li: int, weights: LayerWeights) -> LayerWeights:
        """Layer ``li`` as the chain runs it: ``weights`` holds Llama's layer (its two norms, q/k
        norms where the model has them, the four projections); a family that changes the layer
        returns it changed."""
        return weights

    def _build_chain(self) -> DecodeChain | None:
        cfg, layers = self.cfg, []
        for li, layer in enumerate(self.layers):
            parts = [lin.native_projection() for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(p is None for p in parts):
                return None
            qkv, o, gate_up, down = parts
            assert qkv is not None and o is not None and gate_up is not None and down is not None
            weights = LayerWeights(
                layer.input_norm, layer.post_norm, qkv, o, gate_up, down, layer.q_norm, layer.k_norm
            )
            layers.append(self._chain_layer(li, weights))
        return DecodeChain.build(
            layers,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.rms_norm_eps,
        )

    @property
    def linear_path(self) -> str:
        """Which linear layers run the matrices: one path, or the distinct paths joined by ``+``
        (a quantized file may mix int4 layers with an int8 output layer), the output layer's first."""
        paths = [self.lm_head.path]
        for layer in self.layers:
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                if lin.path not in paths:
                    paths.append(lin.path)
        return "+".join(paths)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The weights the model computes with, each tensor once (a tied head is the embedding), in
        the order a decode step reads them: the embedding (its one row a token; listed last when the
        output layer is the same matrix), each layer's norms and matrices, the last norm, the output
        layer. Private packed copies (the native fp32 panels, oneDNN's) are not listed.
        ``bench/decode_floor.py`` reads them in this order as a step's plain weight read."""
        seen: dict[int, torch.Tensor] = {}

        def add(t: torch.Tensor | None) -> None:
            if t is not None:
                seen.setdefault(t.data_ptr(), t)

        def add_matrix(m: torch.Tensor | QuantizedMatrix) -> None:
            if isinstance(m, QuantizedMatrix):
                add(m.qweight)
                add(m.qscale)
            else:
                add(m)

        def add_linear(lin: Linear) -> None:
            add_matrix(lin.quantized if lin.quantized is not None else lin.weight)
            add(lin.bias)

        if not self.cfg.tie_word_embeddings:  # a tied head is the embedding: read (all of it) last
            add_matrix(self.embed)
        for layer in self.layers:
            add(layer.input_norm)
            add_linear(layer.qkv)
            add(layer.q_norm)
            add(layer.k_norm)
            add_linear(layer.o)
            add(layer.post_norm)
            add_linear(layer.gate_up)
            add_linear(layer.down)
        add(self.norm)
        add_linear(self.lm_head)
        return list(seen.values())

    @property
    def weight_bytes(self) -> int:
        """Bytes of ``weight_tensors()``: the weights the model computes with, each tensor once."""
        return sum(t.numel() * t.element_size() for t in self.weight_tensors())

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, batch: AttentionBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run all layers; return fp32 logits ``[num_seqs, vocab]`` at ``batch.logits_indices``.

        ``kv_cache`` is the shared all-layers cache ``[num_layers, 2, num_blocks, block_size,
        num_kv_heads, head_dim]``; layer ``l`` uses the views ``kv_cache[l, 0]`` / ``kv_cache[l, 1]``.
        """
        cfg = self.cfg
        n_tok = token_ids.shape[0]
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        cos, sin = cos_sin(batch.positions, self.inv_freq, self.dtype)
        step = batch.kernels_step(kv_cache, h, self.scale)
        # The residual stream: each rms_norm(delta=) adds to it.
        if isinstance(self.embed, QuantizedMatrix):
            x = self.embed.rows(token_ids)
        else:
            x = F.embedding(token_ids, self.embed)
        ops = layer_ops.choose(x, step)
        delta: torch.Tensor | None = None
        chain = self.decode_chain() if ops.kernels is not None else None
        layers = self.layers
        if chain is not None and chain.takes([step], x, kv_cache):
            delta, layers = chain(x, [(cos, sin)], [step], kv_cache), []
        pre = batch.num_prefill_tokens  # the rows before it are a prefill's, the rest decode rows
        for li, layer in enumerate(layers):
            key_cache, value_cache = kv_cache[li, 0], kv_cache[li, 1]
            qkv = layer.qkv(ops.rms_norm(x, layer.input_norm, eps, delta), pre)
            # Qwen3: each q and k head RMS-normalised before the rotary embedding.
            q = ops.rope_store(
                qkv, cos, sin, h, hkv, d, key_cache, value_cache, step, layer.q_norm, layer.k_norm, eps
            )
            attn = step.attention(q, key_cache, value_cache)
            hs = ops.rms_norm(x, layer.post_norm, eps, layer.o(attn.reshape(n_tok, h * d), pre))
            delta = layer.down(ops.silu_mul(layer.gate_up(hs, pre)), pre)
        if delta is not None:
            x.add_(delta)
        if not batch.logits_indices.numel():  # a pass that only writes KV (a draft model's)
            return x.new_empty((0, cfg.vocab_size), dtype=torch.float32)
        last = x.index_select(0, batch.logits_indices)
        last = ops.rms_norm(last, self.norm, eps)
        return self.lm_head(last, 0).to(torch.float32)  # each sampled row as if alone


def build(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> LlamaModel:
    return LlamaModel(cfg, weights)
