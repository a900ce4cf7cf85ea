"""The Llama decoder's forward pass on a paged KV cache.

One call processes a flat batch of tokens from many sequences at once: the prefill sequences'
tokens first, then the decode sequences' (one token each), as laid out by ``model_runner``. Dense
layers run on all tokens together; per layer the new K/V are written into the shared cache with
``kernels.write_kv_cache`` and attention reads the cache through block tables with
``kernels.paged_prefill_attention`` (causal, queries are the last tokens of each sequence) and
``kernels.paged_decode_attention`` (one query per sequence).

Why a plain class holding tensors instead of ``nn.Module``: there is no training, no state dict
round trip and no hooks; fused weight matrices (QKV, gate+up) are built once at load, and packed
for oneDNN there on CPU (``linear.py``).

On the CPU kernel backend (``kernels/cpu.py``) the attention plans (length buckets, block ids,
masks) depend only on the step's block tables and lengths, so they are built once per forward and
every layer calls the backend directly with them; the step was validated by the model runner, so
the per-call argument checks of the public kernel wrappers are not repeated in each layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from kernels import cpu as cpu_kernels
from worker_svc.model.config import ModelConfig
from worker_svc.model.linear import Linear
from worker_svc.model.rope import apply_rotary, cos_sin, inverse_frequencies


@dataclass(slots=True)
class AttentionBatch:
    """Where the tokens of one forward pass go in the cache and what they attend to.

    Tokens ``[0, num_prefill_tokens)`` belong to prefill sequences (query_start_loc delimits them),
    the rest to decode sequences (one each). All index tensors live on the model's device.
    """

    positions: torch.Tensor  # int64 [num_tokens]: absolute position of each token
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset
    logits_indices: torch.Tensor  # int64 [num_seqs]: flat index of each sequence's last token
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor | None  # int32 [num_prefill_seqs, max_blocks]
    prefill_query_start_loc: torch.Tensor | None  # int32 [num_prefill_seqs + 1]
    prefill_seq_lens: torch.Tensor | None  # int32 [num_prefill_seqs]
    decode_block_tables: torch.Tensor | None  # int32 [num_decode_seqs, max_blocks]
    decode_seq_lens: torch.Tensor | None  # int32 [num_decode_seqs]
    # Longest prefill query run, known on the host: passed to every layer's prefill kernel so it
    # never reads query_start_loc back from the device (one sync per layer otherwise).
    prefill_max_query_len: int = 0


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear  # [(H + 2 * Hkv) * D, hidden]
    o: Linear
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear


@dataclass(slots=True)
class _CpuPlans:
    decode: cpu_kernels.DecodePlan | None
    prefill: cpu_kernels.PrefillPlan | None


# The fused projections the model computes with, by the checkpoint names they are made of. A
# weights dict may carry them already fused (weights.fuse: what the cache host shares with workers).
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: statistics in fp32, scale in the input dtype (as Hugging Face does)."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class LlamaModel:
    """Weights plus ``forward(token_ids, batch, kv_cache) -> logits of each sequence's last token``."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = cfg
        w = weights
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = Linear.build(self.embed if cfg.tie_word_embeddings else w["lm_head.weight"])
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self.inv_freq = inverse_frequencies(cfg.rope, cfg.head_dim).to(self.device)
        self.scale = cfg.head_dim**-0.5
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."

            def bias(name: str, p: str = p) -> torch.Tensor | None:
                return w.get(p + name)

            w_qkv = fused_tensor(w, p + "self_attn.qkv_proj.weight")
            w_gate_up = fused_tensor(w, p + "mlp.gate_up_proj.weight")
            assert w_qkv is not None and w_gate_up is not None
            self.layers.append(
                _Layer(
                    input_norm=w[p + "input_layernorm.weight"],
                    post_norm=w[p + "post_attention_layernorm.weight"],
                    qkv=Linear.build(w_qkv, fused_tensor(w, p + "self_attn.qkv_proj.bias")),
                    o=Linear.build(w[p + "self_attn.o_proj.weight"], bias("self_attn.o_proj.bias")),
                    gate_up=Linear.build(w_gate_up, fused_tensor(w, p + "mlp.gate_up_proj.bias")),
                    down=Linear.build(w[p + "mlp.down_proj.weight"], bias("mlp.down_proj.bias")),
                )
            )

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, batch: AttentionBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run all layers; return fp32 logits ``[num_seqs, vocab]`` at ``batch.logits_indices``.

        ``kv_cache`` is the shared all-layers cache ``[num_layers, 2, num_blocks, block_size,
        num_kv_heads, head_dim]``; layer ``l`` uses the views ``kv_cache[l, 0]`` / ``kv_cache[l, 1]``.
        """
        cfg = self.cfg
        n_tok = token_ids.shape[0]
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = h * d, hkv * d
        n_pre = batch.num_prefill_tokens
        cos, sin = cos_sin(batch.positions, self.inv_freq, self.dtype)
        plans = self._cpu_plans(batch, kv_cache) if kernels.backend_for(kv_cache) == "cpu" else None
        x = F.embedding(token_ids, self.embed)
        for li, layer in enumerate(self.layers):
            key_cache, value_cache = kv_cache[li, 0], kv_cache[li, 1]
            hs = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(hs)
            q = qkv[:, :q_size].reshape(n_tok, h, d)
            k = qkv[:, q_size : q_size + kv_size].reshape(n_tok, hkv, d)
            v = qkv[:, q_size + kv_size :].reshape(n_tok, hkv, d)
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
            if plans is not None:
                cpu_kernels.write_kv_cache(k, v, key_cache, value_cache, batch.slot_mapping)
                attn = self._cpu_attention(q, key_cache, value_cache, batch, n_pre, plans)
            else:
                kernels.write_kv_cache(k, v.contiguous(), key_cache, value_cache, batch.slot_mapping)
                attn = self._attention(q, key_cache, value_cache, batch, n_pre)
            x = x + layer.o(attn.reshape(n_tok, q_size))
            hs = rms_norm(x, layer.post_norm, cfg.rms_norm_eps)
            gate_up = layer.gate_up(hs)
            gate, up = gate_up.chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        last = x.index_select(0, batch.logits_indices)
        last = rms_norm(last, self.norm, cfg.rms_norm_eps)
        return self.lm_head(last).to(torch.float32)

    def _cpu_plans(self, batch: AttentionBatch, kv_cache: torch.Tensor) -> _CpuPlans:
        block_size = kv_cache.shape[3]
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        decode = prefill = None
        if batch.decode_block_tables is not None and batch.decode_seq_lens is not None:
            decode = cpu_kernels.plan_decode(batch.decode_block_tables, batch.decode_seq_lens, block_size)
        if batch.prefill_block_tables is not None and batch.prefill_query_start_loc is not None:
            assert batch.prefill_seq_lens is not None
            prefill = cpu_kernels.plan_prefill(
                batch.prefill_block_tables, batch.prefill_query_start_loc, batch.prefill_seq_lens, block_size, group
            )
        return _CpuPlans(decode, prefill)

    def _cpu_attention(
        self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: AttentionBatch,
        n_pre: int, plans: _CpuPlans,
    ) -> torch.Tensor:
        """Attention on the CPU backend with this step's plans; writes one output tensor in place."""
        out = torch.empty_like(q)
        if plans.prefill is not None:
            cpu_kernels.paged_prefill_attention(
                q[:n_pre], key_cache, value_cache, batch.prefill_block_tables,  # type: ignore[arg-type]
                batch.prefill_query_start_loc, batch.prefill_seq_lens, self.scale,  # type: ignore[arg-type]
                out=out[:n_pre], plan=plans.prefill,
            )
        if plans.decode is not None:
            cpu_kernels.paged_decode_attention(
                q[n_pre:], key_cache, value_cache, batch.decode_block_tables,  # type: ignore[arg-type]
                batch.decode_seq_lens, self.scale, out=out[n_pre:], plan=plans.decode,  # type: ignore[arg-type]
            )
        return out

    def _attention(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        batch: AttentionBatch,
        n_pre: int,
    ) -> torch.Tensor:
        n_tok = q.shape[0]
        parts: list[torch.Tensor] = []
        if n_pre:
            assert batch.prefill_block_tables is not None
            parts.append(
                kernels.paged_prefill_attention(
                    q[:n_pre].contiguous(),
                    key_cache,
                    value_cache,
                    batch.prefill_block_tables,
                    batch.prefill_query_start_loc,
                    batch.prefill_seq_lens,
                    self.scale,
                    max_query_len=batch.prefill_max_query_len or None,
                )
            )
        if n_tok > n_pre:
            assert batch.decode_block_tables is not None
            parts.append(
                kernels.paged_decode_attention(
                    q[n_pre:].contiguous(),
                    key_cache,
                    value_cache,
                    batch.decode_block_tables,
                    batch.decode_seq_lens,
                    self.scale,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)
