"""Tiny random models of each supported family, saved the Hugging Face way and as GGUF files.

The Hugging Face model (transformers, fp32) is the oracle; the GGUF file is written here with the
``gguf`` package's writer the way llama.cpp's converter writes one: GGUF tensor names, Q and K rows
permuted for llama.cpp's RoPE (``llama`` architecture only), Llama 3 rope scaling as a
``rope_freqs.weight`` tensor, no ``output.weight`` when the head is tied. This mapping is written
out independently of worker_svc/model/gguf_file.py on purpose: a wrong name or permutation there
fails the oracle tests instead of cancelling out.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tests.kernels import kquant_cases
from tests.worker_svc.conftest import VOCAB, HFModel

FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    rope_theta=10000.0,
)
# Per family: what its real models look like, shrunk; GQA groups 3 (SmolLM2), 2, 4.
_FAMILY: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": dict(
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "Qwen2ForCausalLM": dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False
    ),
    # head_dim 32 != hidden 64 / 4 heads: Qwen3 takes head_dim from the config.
    "Qwen3ForCausalLM": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True
    ),
    "MistralForCausalLM": dict(
        num_attention_heads=8, num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False
    ),
}


def hf_config(arch: str, **overrides: Any) -> Any:
    import transformers

    kwargs = {**_COMMON, **_FAMILY[arch], **overrides}
    return getattr(transformers, arch.replace("ForCausalLM", "Config"))(**kwargs)


def build(arch: str, path: pathlib.Path, seed: int = 0, **overrides: Any) -> HFModel:
    """A random ``arch`` model saved to ``path`` (config.json + model.safetensors) and kept as the oracle.

    Qwen2's biases and Qwen3's q/k norm weights are drawn at random too (transformers starts them
    at 0 and 1), so that a loader or forward pass that drops them fails."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, arch)(hf_config(arch, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    return HFModel(path=path, model=model)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from rotate-half halves to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in top:
        return top[name]
    _, _, rest = name.partition("model.layers.")
    layer, _, key = rest.partition(".")
    module, _, kind = key.rpartition(".")
    return f"blk.{layer}.{_LAYER[module]}.{kind}"


# K-quant super-blocks (256 weights): where the fp16 scale(s) sit in a block and the value they get,
# so that the dequantized weights are of a model's size (|w| up to about 0.4).
K_QUANT_SCALES = {"Q4_K": ((0, 2), 0.0005), "Q5_K": ((0, 2), 0.00025), "Q6_K": ((-2,), 0.0001)}


def random_k_blocks(shape: tuple[int, ...], qtype: str, seed: int) -> np.ndarray:
    """Random blocks of a K-quant type with sane fp16 scales; everything else (6-bit sub-scales,
    quants) is valid as any bytes. Weights as the file holds them: read back with dequantize."""
    import gguf

    q = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[q]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    data = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    offsets, value = K_QUANT_SCALES[qtype]
    scale = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    for off in offsets:
        start = off % size
        data[:, :, start : start + 2] = scale
    return data.reshape(rows, -1)


def write_gguf(
    hf: HFModel, path: pathlib.Path, qtype: str = "F32", qtype_of: Callable[[str], str] | None = None
) -> dict[str, torch.Tensor]:
    """Write ``hf``'s weights to a GGUF file, 2-D weights as ``qtype`` (F32, F16, a type the gguf
    package can quantize, e.g. Q8_0, or a K-quant, whose blocks are random: random_k_blocks), or
    as ``qtype_of(HF name)`` when given (a mixture, like llama-quantize's Q4_K_M; Q4_K / Q6_K
    then hold the weights rounded by tests/kernels/kquant_cases.py), 1-D ones as F32 (as llama.cpp
    does).

    Returns the state dict as the file holds it (quantized then dequantized, in HF layout), for an
    oracle on exactly those weights."""
    import gguf

    model: Any = hf.model
    cfg = model.config
    arch_name = cfg.architectures[0] if cfg.architectures else type(model).__name__
    arch = GGUF_ARCH[arch_name]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(path.stem)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if rope.get("rope_type") == "llama3":  # llama.cpp stores the scaling as per-frequency divisors
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        base = 1.0 / (
            rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        w.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    held: dict[str, torch.Tensor] = {}
    default_qtype = qtype
    state = model.state_dict()
    for name, t in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = t.detach().float().numpy()
        if arch == "llama" and ".self_attn.q_proj." in name:
            arr = _permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            arr = _permute(arr, cfg.num_key_value_heads)
        qtype = qtype_of(name) if qtype_of is not None and arr.ndim == 2 else default_qtype
        if arr.ndim == 1 or qtype == "F32":
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(arr, dtype=np.float32))
            stored = arr
        elif qtype == "F16":
            w.add_tensor(_gguf_name(name), arr.astype(np.float16))
            stored = arr.astype(np.float16).astype(np.float32)
        else:
            q = gguf.GGMLQuantizationType[qtype]
            if qtype_of is not None and qtype in kquant_cases.QUANTIZE:  # the weights, rounded
                data = kquant_cases.quantize(arr, qtype)
            elif qtype in K_QUANT_SCALES:  # gguf cannot quantize these: random valid blocks instead
                data = random_k_blocks(arr.shape, qtype, seed=len(held))
            else:
                data = gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), q)
            w.add_tensor(_gguf_name(name), data, raw_dtype=q)
            stored = gguf.quants.dequantize(data, q).reshape(arr.shape)
        held[name] = torch.from_numpy(np.ascontiguousarray(stored))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # Back to HF row order (the inverse of _permute) for the oracle on the stored weights.
    for name in list(held):
        if arch == "llama" and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            n = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            t = held[name]
            held[name] = t.reshape(n, t.shape[0] // n // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
    return held


HF_PARTS = {  # a pagedkv decoder layer's matrices -> the Hugging Face linear modules they hold
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def rounded_inputs(model: Any) -> dict[str, Any]:
    """Hugging Face linear module name -> how the native integer kernel running it in ``model`` (a
    pagedkv model) rounds its input (``cpu_quant_linear.INPUT_ROUNDING``: int4 to 16 bits per 32
    inputs, K-quant blocks to 8 bits per 256); modules whose matrix multiplies x as it is are left
    out."""
    from pagedkv.kernels.cpu.quant_linear import INPUT_ROUNDING

    def block(lin: Any) -> Any:
        path = str(lin.path)
        return INPUT_ROUNDING.get(path.removeprefix("native-")) if path.startswith("native-") else None

    out: dict[str, Any] = {}
    for i, layer in enumerate(model.layers):
        for attr, names in HF_PARTS.items():
            b = block(getattr(layer, attr))
            if b is not None:
                out.update({f"model.layers.{i}.{n}": b for n in names})
    b = block(model.lm_head)
    if b is not None:
        out["lm_head"] = b
    return out


def oracle_on(
    hf: HFModel, state: dict[str, torch.Tensor], path: pathlib.Path, rounded: dict[str, Any] | None = None
) -> HFModel:
    """A copy of ``hf``'s model holding ``state`` (e.g. a GGUF file's dequantized weights).

    ``rounded`` (``rounded_inputs`` of the model under test): the linear modules whose native
    kernel multiplies rounded inputs round theirs the same way (kquant_cases' rule) before their
    fp32 product, so the oracle computes what the kernels are documented to compute."""
    import copy

    model: Any = copy.deepcopy(hf.model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    modules = dict(model.named_modules())
    for name, rule in (rounded or {}).items():

        def round_input(
            _module: torch.nn.Module, args: tuple[torch.Tensor, ...], rule: Any = rule
        ) -> tuple[torch.Tensor]:
            return (kquant_cases.round_inputs_as_the_kernel_does(args[0], rule.block, rule.top),)

        modules[name].register_forward_pre_hook(round_input)
    return HFModel(path=path, model=model)


def _small_llama(dir: pathlib.Path, seed: int, **overrides: Any) -> HFModel:
    """A random Llama with 256-wide layers: whole int4 groups and panels, whole K-quant super-blocks."""
    return build(
        "LlamaForCausalLM",
        dir / "hf",
        seed=seed,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        **overrides,
    )


def small_q4_1_llama(dir: pathlib.Path, seed: int, name: str = "m.Q4_1.gguf") -> tuple[HFModel, pathlib.Path]:
    """A random Llama with 256-wide layers (whole int4 groups and panels) written as a Q4_1 GGUF:
    the smallest file the integer paths take as they take a real one."""
    hf = _small_llama(dir, seed)
    path = dir / name
    write_gguf(hf, path, "Q4_1")
    return hf, path


def q4_k_m_type(name: str) -> str:
    """The type llama-quantize's Q4_K_M gives a matrix, simplified: the output layer, the value
    rows and the MLP's down projection Q6_K, every other matrix (the embedding too) Q4_K."""
    return "Q6_K" if name == "lm_head.weight" or ".v_proj." in name or ".down_proj." in name else "Q4_K"


def small_q4_k_m_llama(
    dir: pathlib.Path, seed: int, name: str = "m.Q4_K_M.gguf"
) -> tuple[HFModel, pathlib.Path]:
    """A random Llama with 256-wide layers (whole K-quant super-blocks) written as a Q4_K_M-like
    GGUF (q4_k_m_type): fused QKV of Q4_K and Q6_K parts, a Q6_K output layer."""
    hf = _small_llama(dir, seed, tie_word_embeddings=False)
    path = dir / name
    write_gguf(hf, path, qtype_of=q4_k_m_type)
    return hf, path
