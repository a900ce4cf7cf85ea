"""Weights: read a Hugging Face safetensors checkpoint or a GGUF file, or make the default model's
random ones.

The checkpoint is read tensor by tensor with ``safetensors.safe_open`` (memory-mapped), cast to the
target dtype and moved to the device one at a time, so peak host memory stays near one tensor.
Sharded checkpoints are found through ``model.safetensors.index.json``. A GGUF file
(``gguf_file.py``) is read the same way: each tensor dequantized, renamed to its Hugging Face name,
cast and moved before the next is read. A large checkpoint takes minutes to read: the load logs
its progress (``weights_loading loaded=N total=M``) every ``PROGRESS_EVERY_S`` and when done.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Iterator

import structlog
import torch

from pagedkv.kernels import quant_linear
from pagedkv.worker_svc.model import gguf_file, gguf_quant, model_source
from pagedkv.worker_svc.model.config import ModelConfig
from pagedkv.worker_svc.model.gguf_quant import KBlocks, Unpacked
from pagedkv.worker_svc.model.registry import Model, architecture, build_model

# How the weights are held (weight_format.py resolves the flag): dense in the serving dtype, a GGUF
# file's own quantization ("file"), or every matrix of a checkpoint quantized at load.
HELD_FORMS = ("dense", "file", "int8", "int4")
Held = torch.Tensor | Unpacked | KBlocks

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PROGRESS_EVERY_S = 2.0

log = structlog.get_logger("pagedkv.weights")


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``cfg``'s architecture provides -> its shape (registry.py)."""
    return architecture(cfg.architecture).expected_shapes(cfg)


def expected_names(cfg: ModelConfig) -> list[str]:
    """The tensor names (Hugging Face spelling) a checkpoint of ``cfg``'s architecture must provide."""
    return list(expected_shapes(cfg))


def _checkpoint_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in model directory {model_dir}")
    return files


def _iter_checkpoint(
    model: pathlib.Path, cfg: ModelConfig, held: str = "dense"
) -> Iterator[tuple[str, Held]]:
    src = model_source.resolve(model)
    if src.kind == "gguf":
        if held == "file":
            yield from gguf_file.iter_held(src.path, cfg.num_heads, cfg.num_kv_heads)
        else:
            yield from gguf_file.iter_tensors(src.path, cfg.num_heads, cfg.num_kv_heads)
        return
    from safetensors import safe_open

    model_dir = src.path
    for path in _checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _is_matrix(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and name.endswith(".weight")


def load_time_form(name: str, shape: tuple[int, ...], held: str) -> str:
    """The form a checkpoint tensor takes when ``held`` is ``int8`` / ``int4``: vectors stay dense;
    the embedding (its rows are looked up) and matrices whose inputs are not a multiple of 32 take
    int8 rows."""
    if held not in ("int8", "int4") or not _is_matrix(name, shape):
        return "dense"
    if held == "int4" and name != gguf_quant.EMBEDDING and shape[1] % quant_linear.GROUP == 0:
        return "int4"
    return "int8"


def quantize_at_load(name: str, w: torch.Tensor, held: str) -> Held:
    """A checkpoint tensor in its ``load_time_form``."""
    form = load_time_form(name, tuple(w.shape), held)
    if form == "int4":
        return gguf_quant.quantize_int4_groups(w)
    return gguf_quant.to_int8(w) if form == "int8" else w


def load_weights(
    model_dir: str | pathlib.Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    held: str = "dense",
) -> dict[str, Held]:
    """Read every expected tensor; fail naming the first missing or mis-shaped one. Quantized
    matrices (``held`` other than dense) stay integers on the CPU; everything else is cast and moved."""
    if held not in HELD_FORMS:
        raise ValueError(f"unknown weight form {held!r}; one of {', '.join(HELD_FORMS)}")
    wanted = set(expected_names(cfg))
    shapes = expected_shapes(cfg)
    out: dict[str, Held] = {}
    start = last = time.monotonic()
    for name, t in _iter_checkpoint(pathlib.Path(model_dir), cfg, held):
        if name not in wanted:
            continue  # e.g. rotary_emb.inv_freq in old checkpoints, or a tied lm_head
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"weight {name} has shape {tuple(t.shape)}, expected {shapes[name]}")
        if isinstance(t, torch.Tensor):
            t = quantize_at_load(name, t.to(torch.float32), held) if held in ("int8", "int4") else t
        out[name] = t.to(device=device, dtype=dtype) if isinstance(t, torch.Tensor) else t
        if time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            log.info("weights_loading", loaded=len(out), total=len(wanted), model=str(model_dir))
    log.info(
        "weights_loaded",
        loaded=len(out),
        total=len(wanted),
        model=str(model_dir),
        seconds=round(time.monotonic() - start, 2),
    )
    missing = sorted(wanted - out.keys())
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} weights, e.g. {missing[:3]}")
    return out


def random_weights(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0, std: float = 0.2
) -> dict[str, torch.Tensor]:
    """Deterministic random weights (CPU generator, then cast/move): the offline default model.

    Why std 0.2 rather than HF's 0.02: a sharper next-token distribution keeps greedy decoding far
    from ties, so runs on different kernels or devices produce the same tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    shapes = expected_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    for name in expected_names(cfg):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith(".bias"):
            t = 0.02 * torch.randn(shape, generator=gen)
        else:
            t = std * torch.randn(shape, generator=gen)
        out[name] = t.to(device=device, dtype=dtype)
    return out


def weights_source(model_dir: str | None, cfg: ModelConfig, seed: int, held: str = "dense") -> str:
    """Names the weights a role would load, and the form it holds them in: equal strings mean the
    same tensors (shared_weights.py)."""
    name = f"model:{cfg.name}" if model_dir else f"random:seed={seed}"
    return name if held == "dense" else f"{name};held={held}"


def _fused_layout(names: list[str], cfg: ModelConfig) -> tuple[list[str], dict[str, list[str]]]:
    """Which checkpoint names stay as they are, and each fused name with the parts it is made of."""
    fused_parts = architecture(cfg.architecture).FUSED
    have = set(names)
    fused: dict[str, list[str]] = {}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        for proj, parts in fused_parts.items():
            for kind in ("weight", "bias"):
                srcs = [f"{p}{part}.{kind}" for part in parts]
                if all(x in have for x in srcs):
                    fused[f"{p}{proj}.{kind}"] = srcs
    absorbed = {x for srcs in fused.values() for x in srcs}
    keep = [n for n in names if n not in absorbed and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    return keep, fused


def fuse(weights: dict[str, Held], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> the tensors the model computes with (QKV and gate/up fused, named
    ``...self_attn.qkv_proj.*`` / ``...mlp.gate_up_proj.*``; a tied head is not repeated), each
    quantized matrix ``X.weight`` packed as ``X.qweight`` + ``X.qscale`` (``kernels/quant_linear.py``).

    What the cache host shares: ``build_model(cfg, fuse(w, cfg))`` copies nothing, so workers build
    their model straight on views of the shared region."""
    keep, fused = _fused_layout(list(weights), cfg)
    held: dict[str, Held] = {n: weights[n] for n in keep}
    for name, srcs in fused.items():
        held[name] = gguf_quant.concat([weights[x] for x in srcs])
    out: dict[str, torch.Tensor] = {}
    for name, t in held.items():
        if isinstance(t, (Unpacked, KBlocks)):
            m = t.pack()
            base = name.removesuffix("weight")
            out[base + "qweight"], out[base + "qscale"] = m.qweight, m.qscale
        else:
            out[name] = t
    return out


def _file_types(model_dir: str | None, cfg: ModelConfig) -> dict[str, str]:
    """Checkpoint name -> GGUF tensor type of a GGUF file's tensors (empty for anything else)."""
    src = model_source.resolve(pathlib.Path(model_dir)) if model_dir else None
    if src is None or src.kind != "gguf":
        return {}
    shapes = expected_shapes(cfg)
    header = gguf_file.read_header(src.path)
    arch = str(header.metadata.get("general.architecture", ""))
    names = ((gguf_file.hf_name(t.name, arch), t.type_name) for t in header.tensors.values())
    return {name: type_name for name, type_name in names if name is not None and name in shapes}


def held_forms(model_dir: str | None, cfg: ModelConfig, held: str) -> dict[str, str]:
    """Checkpoint name -> ``dense`` / ``kquant`` / ``int4`` / ``int8``: the form
    ``load_weights(..., held)`` gives each tensor, known without reading the tensors (a GGUF's
    header says its types)."""
    shapes = expected_shapes(cfg)
    if held == "dense":
        return {n: "dense" for n in shapes}
    if held == "file":
        forms = {n: "dense" for n in shapes}
        for name, type_name in _file_types(model_dir, cfg).items():
            forms[name] = gguf_quant.form_of(type_name, name, shapes[name])
        return forms
    return {n: load_time_form(n, shape, held) for n, shape in shapes.items()}


def fused_spec(
    model_dir: str | None, cfg: ModelConfig, dtype: torch.dtype, held: str = "dense"
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor ``fuse`` yields for this model and weight form: what
    a worker checks the cache host's shared weights against before mapping them."""
    shapes = expected_shapes(cfg)
    forms = held_forms(model_dir, cfg, held)
    types = _file_types(model_dir, cfg) if "kquant" in forms.values() else {}
    keep, fused = _fused_layout(expected_names(cfg), cfg)
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    items = [(n, shapes[n], forms[n], [n]) for n in keep]
    for name, srcs in fused.items():
        shape = (sum(shapes[x][0] for x in srcs), *shapes[srcs[0]][1:])
        items.append((name, shape, gguf_quant.fused_form([forms[x] for x in srcs]), srcs))
    for name, shape, form, srcs in items:
        base = name.removesuffix("weight")
        if form == "kquant":  # one row segment per part (gguf_quant.concat)
            segments = [(types[x], shapes[x][0]) for x in srcs]
            kq_bytes, kq_segments = quant_linear.kquant_shapes(segments, shape[1])
            out[base + "qweight"] = (kq_bytes, torch.uint8)
            out[base + "qscale"] = (kq_segments, torch.int32)
        elif form == "int4":
            qweight, qscale = quant_linear.int4_shapes(shape[0], shape[1])
            out[base + "qweight"] = (qweight, torch.uint8)
            out[base + "qscale"] = (qscale, torch.float32)
        elif form == "int8":
            out[base + "qweight"] = (shape, torch.int8)
            out[base + "qscale"] = ((shape[0],), torch.float32)
        else:
            out[name] = (shape, dtype)
    return out


def fused_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor ``fuse`` yields for this config with dense weights."""
    return {n: shape for n, (shape, _) in fused_spec(None, cfg, torch.float32).items()}


def load_model(
    model_dir: str | None,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    held: str = "dense",
) -> Model:
    """The model of ``--model DIR|FILE.gguf``, or the built-in default with seeded random weights."""
    return build_model(cfg, fuse(load_checkpoint(model_dir, cfg, dtype, device, seed, held), cfg))


def load_checkpoint(
    model_dir: str | None,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    held: str = "dense",
) -> dict[str, Held]:
    """The checkpoint tensors of ``--model DIR|FILE.gguf``, or the built-in default's seeded random
    ones (quantized at load too when ``held`` is int8 / int4)."""
    if model_dir:
        return load_weights(model_dir, cfg, dtype, device, held)
    w = random_weights(cfg, dtype, device, seed=seed)
    if held in ("int8", "int4"):
        return {n: quantize_at_load(n, t.to(torch.float32), held) for n, t in w.items()}
    return dict(w)
