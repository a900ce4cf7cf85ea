"""``--weight-format``: how a role holds the model's weights, decided in one place.

- ``auto`` (default): a GGUF file in its own quantization (integers, ``gguf_quant.py``) when the
  model runs on CPU in float32, the quantized matmuls' dtype; anything else dense in ``--dtype``.
- ``fp32`` / ``bf16``: dense (a GGUF dequantized at load) in that dtype, which must be the model's
  (``--dtype``: the model computes in its weights' dtype, and ``auto`` resolves to float32 on CPU
  and bfloat16 on CUDA).
- ``int8`` / ``int4``: a Hugging Face directory (or the built-in model) quantized at load, weight
  only: int8 with a scale per row, int4 with a scale and offset per 32 inputs (the embedding int8);
  CPU, float32.

The resolved form (``weights.HELD_FORMS``) is part of the weights' name (``weights_source``), so a
worker refuses a cache host sharing the same model in another form.
"""

from __future__ import annotations

from typing import get_args

import torch

from pagedkv.weight_formats import WeightFormat
from pagedkv.worker_svc.cache.layout import dtype_name
from pagedkv.worker_svc.model import model_source

WEIGHT_FORMATS: tuple[str, ...] = get_args(WeightFormat)
_DENSE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve(weight_format: str, model: str | None, device: torch.device, dtype: torch.dtype) -> str:
    """The held form (``dense``, ``file``, ``int8``, ``int4``) for this model, device and model
    dtype; a ValueError naming the conflict when the combination cannot run."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"--weight-format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    is_gguf = model is not None and model_source.resolve(model).kind == "gguf"
    if weight_format == "auto":
        return "file" if is_gguf and device.type == "cpu" and dtype is torch.float32 else "dense"
    if weight_format in _DENSE:
        if dtype is not _DENSE[weight_format]:
            need, have = dtype_name(_DENSE[weight_format]), dtype_name(dtype)
            raise ValueError(
                f"--weight-format {weight_format} needs --dtype {need} "
                f"(the model computes in its weights' dtype; this role's is {have})"
            )
        return "dense"
    if is_gguf:
        raise ValueError(
            f"--weight-format {weight_format} quantizes a Hugging Face directory at load; a GGUF file is "
            "held in its own quantization (auto) or dequantized (fp32, bf16)"
        )
    if device.type != "cpu" or dtype is not torch.float32:
        raise ValueError(
            f"--weight-format {weight_format} runs on CPU in float32 (PyTorch's weight-packed matmuls), "
            f"this role has {device.type} {dtype_name(dtype)}"
        )
    return weight_format
