"""A GGUF file as a model: its config, its tensors under Hugging Face names, and its tokenizer.

Why read GGUF ourselves rather than convert: most small models people run locally are GGUF files
(llama.cpp's format). ``--model FILE.gguf`` serves one with no conversion step: the config comes
from the file's metadata (``{arch}.block_count``, ``{arch}.attention.head_count``, ...), turned into
a Hugging Face ``config.json`` dict so the architecture module checks it the way it checks a
directory's; the tensors are memory-mapped and read one at a time: either dequantized with the
``gguf`` package (``gguf.quants.dequantize``) to the serving dtype (``iter_tensors``), or held in
the file's own quantization as integers for the CPU's quantized matmuls (``iter_held``,
``gguf_quant.py``).

The differences from a Hugging Face checkpoint are undone here:
- tensor names (``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight``; ``gemma3``
  names its four norms a layer its own way);
- llama.cpp's converter permutes the rows of Q and K (weights and biases) of the ``llama``
  architecture within each head, from rotate-half to interleaved pairs (its RoPE layout); the
  inverse permutation gives back the Hugging Face rows. ``qwen2``/``qwen3``/``gemma3`` files keep
  HF rows;
- ``gemma3`` files store each RMSNorm weight as ``1 + w`` (what llama.cpp multiplies by); the
  checkpoint's ``w`` is that minus one, as transformers' GGUF loader computes it.

What a ``gemma3`` file leaves to the reader, llama.cpp's fixed values: every 6th layer global, the
others with the ``attention.sliding_window``; rotary base 10,000 on those sliding layers
(``rope.freq_base`` is the global layers'); the attention scale from ``head_dim``.

Llama 3's rope scaling is stored as a ``rope_freqs.weight`` tensor (a divisor per frequency), read
with the config (``RopeConfig.freq_factors``).
"""

from __future__ import annotations

import pathlib
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import torch

from pagedkv.arith import ceil_div
from pagedkv.worker_svc.model import gguf_quant

_log = structlog.get_logger("pagedkv.worker")

GGUF_MAGIC = b"GGUF"

# GGUF general.architecture -> the Hugging Face architecture (registry.py) that runs it. llama.cpp
# converts Mistral checkpoints to "llama" too.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Architectures whose Q/K rows llama.cpp's converter permuted (undone in permute_back).
PERMUTED_QK = {"llama"}
# Architectures whose norm weights the file holds as 1 + w (undone in _checkpoint_form).
NORM_PLUS_ONE = {"gemma3"}

# The tensor types dequantized at load (gguf.GGMLQuantizationType names); anything else is refused.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where an architecture's layer names differ from the table above.
_ARCH_LAYER_NAMES = {
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
ROPE_FREQS = "rope_freqs.weight"


def is_gguf(path: str | pathlib.Path) -> bool:
    """Whether ``path`` is a file starting with the GGUF magic."""
    p = pathlib.Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of architecture ``arch``; None for tensors with no
    HF counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    if m is None or m.group(2) not in names:
        return None
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def _checkpoint_form(arch: str, name: str, x: torch.Tensor) -> torch.Tensor:
    """A dense tensor as the Hugging Face checkpoint holds it: a Gemma norm's ``w`` from ``1 + w``."""
    return x - 1.0 if arch in NORM_PLUS_ONE and name.endswith("norm.weight") else x


@dataclass(slots=True, frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGML order: ne[0] (the contiguous dimension) first
    type_name: str  # gguf.GGMLQuantizationType name, or "type N" for a type gguf does not know
    qtype: int
    offset: int  # absolute byte offset of the data in the file


@dataclass(slots=True)
class Header:
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]


# GGUF value types (spec): struct format of the scalars; 8 = string, 9 = array.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
# The tokenizer's vocabulary and merges: skipped here (the tokenizer reads them, load_tokenizer).
_SKIPPED = {
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
}


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as e:  # only GGUF models need it
        raise ValueError(
            "--model is a GGUF file: install the gguf package (pip install 'pagedkv[worker]')"
        ) from e
    return gguf


def read_header(path: str | pathlib.Path) -> Header:
    """The metadata and tensor directory of a GGUF file (versions 2 and 3, little-endian).

    Why not ``gguf.GGUFReader``: it builds a numpy view per vocabulary string, which for a real
    vocabulary (tens of thousands of tokens and merges) takes seconds in every role that reads the
    config (docs/worker.md); this skips those arrays and reads only the rest."""
    import mmap

    GGMLQuantizationType = _gguf().GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def take(fmt: str) -> Any:
            nonlocal pos
            (v,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return v

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            pos += n
            return bytes(buf[pos - n : pos]).decode("utf-8", errors="replace")

        def value(vtype: int, keep: bool = True) -> Any:
            nonlocal pos
            if vtype in _SCALARS:
                return take(_SCALARS[vtype])
            if vtype == 8:
                return string()
            if vtype == 9:
                itype, count = take("<I"), take("<Q")
                if not keep and itype == 8:
                    for _ in range(count):
                        n = take("<Q")  # (not `pos += take(...)`: that adds to pos as it was before)
                        pos += n
                    return None
                if not keep and itype in _SCALARS:
                    pos += count * struct.calcsize(_SCALARS[itype])
                    return None
                return [value(itype, keep) for _ in range(count)]
            raise ValueError(f"GGUF file {path}: unknown metadata value type {vtype} at byte {pos}")

        if bytes(buf[:4]) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        pos = 4
        version = take("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF file {path} has version {version}; supported: 2, 3 (little-endian)")
        n_tensors, n_kv = take("<Q"), take("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            vtype = take("<I")
            v = value(vtype, keep=key not in _SKIPPED)
            if key not in _SKIPPED:
                meta[key] = v
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = tuple(take("<Q") for _ in range(take("<I")))
            qtype, offset = take("<I"), take("<Q")
            try:
                type_name = GGMLQuantizationType(qtype).name
            except ValueError:
                type_name = f"type {qtype}"
            infos.append((name, dims, type_name, qtype, offset))
        align = int(meta.get("general.alignment", 32))
        data_start = ceil_div(pos, align) * align
    tensors = {n: TensorInfo(n, d, tn, q, data_start + o) for n, d, tn, q, o in infos}
    return Header(meta, tensors)


def check_types(header: Header) -> None:
    """Refuse a file holding a tensor type outside SUPPORTED_TYPES, naming the type and the tensor."""
    for t in header.tensors.values():
        if t.type_name not in SUPPORTED_TYPES:
            raise ValueError(
                f"GGUF tensor {t.name} has type {t.type_name}, which pagedkv cannot dequantize; "
                f"supported: {', '.join(SUPPORTED_TYPES)}"
            )


def hf_config(path: str | pathlib.Path) -> tuple[dict[str, Any], tuple[float, ...]]:
    """The file's metadata as a Hugging Face ``config.json`` dict, and Llama 3's rope frequency
    divisors (``rope_freqs.weight``; empty when absent)."""
    header = read_header(path)
    check_types(header)
    meta = header.metadata
    arch = str(meta.get("general.architecture", ""))
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"GGUF general.architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    tensors = header.tensors
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF file {path} has no token_embd.weight")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    def need(name: str) -> int:
        if f"{arch}.{name}" not in meta:
            raise ValueError(f"GGUF file {path} lacks the metadata key {arch}.{name}")
        return int(meta[f"{arch}.{name}"])

    num_heads = need("attention.head_count")
    num_kv = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv, list):
        raise ValueError(f"GGUF {arch}.attention.head_count_kv varies per layer, which pagedkv cannot run")
    hidden = need("embedding_length")
    head_dim = int(key("attention.key_length", hidden // num_heads))
    rope_dims = key("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ValueError(
            f"GGUF {arch}.rope.dimension_count is {rope_dims}, not head_dim {head_dim} "
            "(partial rotary is not supported)"
        )
    vocab = int(tensors["token_embd.weight"].shape[1])  # GGML order: [hidden, vocab]
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        # Qwen2 always has q/k/v biases (its module knows); Llama and Qwen3 say so in attention_bias.
        "attention_bias": "blk.0.attn_q.bias" in tensors and arch != "qwen2",
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "hidden_act": "silu",
    }
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):  # refused by the config parser, which names the type
        cfg["rope_scaling"] = {"rope_type": str(scaling), "factor": float(key("rope.scaling.factor", 1.0))}
    for gguf_key, hf_key in (("attention.sliding_window", "sliding_window"), ("expert_count", "num_experts")):
        if key(gguf_key) is not None:
            cfg[hf_key] = int(key(gguf_key))
    if arch == "gemma3":
        cfg.update(_gemma3_config(key, cfg))
    if "eos_token_id" not in cfg and meta.get("tokenizer.ggml.eos_token_id") is not None:
        cfg["eos_token_id"] = int(meta["tokenizer.ggml.eos_token_id"])
    freq_factors: tuple[float, ...] = ()
    if ROPE_FREQS in tensors:
        freq_factors = tuple(float(x) for x in _dequantize(path, tensors[ROPE_FREQS]).reshape(-1))
    return cfg, freq_factors


def _gemma3_config(key: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """What a ``gemma3`` file's metadata means in a Gemma 3 config.json, with llama.cpp's fixed
    values where the file has no key (module docstring). llama.cpp scales the 27B model's scores
    (62 layers) by hidden / heads rather than head_dim."""
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_local_base_freq": float(key("rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"]
        if cfg["num_hidden_layers"] == 62
        else cfg["head_dim"],
    }
    out["hidden_act"] = out["hidden_activation"]
    pattern = key("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer: true where the layer slides
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        out["sliding_window_pattern"] = int(pattern or 6)
    return out


def _raw(path: str | pathlib.Path, tensor: TensorInfo) -> np.ndarray:
    """The tensor's bytes, memory-mapped, as uint8 ``[rows, row_bytes]`` (rows in numpy order)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if tensor.type_name not in SUPPORTED_TYPES:
        raise ValueError(
            f"GGUF tensor {tensor.name} has type {tensor.type_name}; supported: {', '.join(SUPPORTED_TYPES)}"
        )
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.qtype)]
    shape = tuple(reversed(tensor.shape))  # numpy order
    row_bytes = shape[-1] // block * type_size
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    return np.memmap(path, dtype=np.uint8, mode="r", offset=tensor.offset, shape=(rows, row_bytes))


def tensor_bytes(tensor: TensorInfo) -> int:
    """The bytes the tensor's data takes in the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.qtype)]
    return int(np.prod(tensor.shape, dtype=np.int64)) // block * type_size


def _dequantize(path: str | pathlib.Path, tensor: TensorInfo) -> np.ndarray:
    """fp32 numpy array in numpy (row-major, HF) order: ``[out, in]`` for a matrix."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = _raw(path, tensor)
    shape = tuple(reversed(tensor.shape))
    out = dequantize(raw, GGMLQuantizationType(tensor.qtype))
    if out.dtype != np.float32 or not out.flags.writeable:  # F32 comes back as a view of the mapped file
        out = np.array(out, dtype=np.float32)
    return out.reshape(shape)


def permute_back(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (per head: interleaved pairs -> rotate-half halves)."""
    rows = t.shape[0]
    return t.reshape(num_heads, rows // num_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def iter_tensors(
    path: str | pathlib.Path, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, fp32 tensor) of every tensor with an HF counterpart, one at a time."""
    header = read_header(path)
    check_types(header)
    arch = str(header.metadata.get("general.architecture", ""))
    for t in header.tensors.values():
        name = hf_name(t.name, arch)
        if name is None:
            continue
        x = _checkpoint_form(arch, name, torch.from_numpy(_dequantize(path, t)))
        if arch in PERMUTED_QK and ".self_attn.q_proj." in name:
            x = permute_back(x, num_heads)
        elif arch in PERMUTED_QK and ".self_attn.k_proj." in name:
            x = permute_back(x, num_kv_heads)
        yield name, x


def _row_order(rows: int, num_heads: int) -> torch.Tensor:
    """The row index ``permute_back`` applies, for permuting quantized rows (and their scales)."""
    return permute_back(torch.arange(rows), num_heads)


def iter_held(
    path: str | pathlib.Path, num_heads: int, num_kv_heads: int
) -> Iterator[tuple[str, torch.Tensor | gguf_quant.Held]]:
    """(Hugging Face name, tensor) of every tensor with an HF counterpart, each in the form the file's
    own quantization is held in (``gguf_quant.form_of``): fp32 tensors for dense ones, the file's
    blocks (``gguf_quant.KBlocks``) or integers (``gguf_quant.Unpacked``) for quantized matrices.
    A matrix converted to int8 rows logs its error against the file's weights (``gguf_weight_converted``)."""
    header = read_header(path)
    check_types(header)
    arch = str(header.metadata.get("general.architecture", ""))
    for t in header.tensors.values():
        name = hf_name(t.name, arch)
        if name is None:
            continue
        shape = tuple(reversed(t.shape))
        form = gguf_quant.form_of(t.type_name, name, shape)
        x: torch.Tensor | gguf_quant.Held
        if form == "kquant":
            x = gguf_quant.KBlocks.from_raw(_raw(path, t), t.type_name, (shape[0], shape[1]))
        elif form == "int4":
            x = gguf_quant.int4_parts(_raw(path, t), t.type_name, (shape[0], shape[1]))
        else:
            dense = _checkpoint_form(arch, name, torch.from_numpy(_dequantize(path, t)))
            x = dense
            if form == "int8":
                x = gguf_quant.to_int8(dense)
                err = gguf_quant.conversion_error(name, x, dense)
                _log.info(
                    "gguf_weight_converted",
                    tensor=t.name,
                    type=t.type_name,
                    form=err.form,
                    max_abs_error=round(err.max_abs, 6),
                    rel_rms_error=round(err.rel_rms, 6),
                )
        heads = num_heads if ".self_attn.q_proj." in name else num_kv_heads
        if arch in PERMUTED_QK and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            if isinstance(x, torch.Tensor):
                x = permute_back(x, heads)
            else:
                x = x.take_rows(_row_order(x.shape[0], heads))
        yield name, x


def load_tokenizer(path: str | pathlib.Path) -> Any:
    """The file's tokenizer (transformers builds it from the GGUF metadata, offline)."""
    from pagedkv import envs

    envs.set_default("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    p = pathlib.Path(path).resolve()
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name, local_files_only=True)
