"""LlamaModel's account of its own weights: which tensors it computes with, in what order, how many bytes.

``weight_bytes`` is what ``worker_ready`` and ``/metrics`` report; ``weight_tensors()`` is what
``bench/decode_floor.py`` reads as a decode step's plain weight read, so its order is the step's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedkv.kernels.quant_linear import QuantizedMatrix
from pagedkv.worker_svc.model.config import DEFAULT_MODEL_CONFIG, load_model_config
from pagedkv.worker_svc.model.llama import LlamaModel, build
from pagedkv.worker_svc.model.weights import load_model, random_weights
from tests.worker_svc.conftest import HFModel

CPU = torch.device("cpu")


def _matrix_tensors(lin) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    m = lin.quantized if lin.quantized is not None else lin.weight
    return [m.qweight, m.qscale] if isinstance(m, QuantizedMatrix) else [m]


def _step_order(model: LlamaModel) -> list[torch.Tensor]:
    """The tensors a decode step reads, in its order, written out from the forward pass."""
    order: list[torch.Tensor] = []
    for layer in model.layers:
        order.append(layer.input_norm)
        order += _matrix_tensors(layer.qkv)
        order += _matrix_tensors(layer.o)
        order.append(layer.post_norm)
        order += _matrix_tensors(layer.gate_up)
        order += _matrix_tensors(layer.down)
    return [*order, model.norm, *_matrix_tensors(model.lm_head)]


def _check(model: LlamaModel, tied: bool) -> None:
    tensors = model.weight_tensors()
    ptrs = [t.data_ptr() for t in tensors]
    assert len(set(ptrs)) == len(ptrs), "a tensor listed twice"
    assert model.weight_bytes == sum(t.numel() * t.element_size() for t in tensors)
    embed = model.embed.qweight if isinstance(model.embed, QuantizedMatrix) else model.embed
    want = _step_order(model)
    if tied:  # the head is the embedding: listed once, where the step reads all of it (last)
        assert _matrix_tensors(model.lm_head)[0].data_ptr() == embed.data_ptr()
    else:  # the embedding first, where the step looks up its row
        quantized = isinstance(model.embed, QuantizedMatrix)
        want = ([embed, model.embed.qscale] if quantized else [embed]) + want
    assert ptrs == [t.data_ptr() for t in want]


@pytest.mark.parametrize("tied", [True, False])
def test_weight_tensors_are_each_weight_once_in_a_decode_steps_order(tied: bool) -> None:
    cfg = dataclasses.replace(DEFAULT_MODEL_CONFIG, tie_word_embeddings=tied)
    model = build(cfg, random_weights(cfg, torch.float32, CPU))
    _check(model, tied)


@pytest.mark.parametrize("held", ["int8", "int4"])
def test_quantized_weight_tensors_list_integers_and_scales_side_by_side(hf_llama: HFModel, held: str) -> None:
    cfg = load_model_config(str(hf_llama.path))
    model = load_model(str(hf_llama.path), cfg, torch.float32, CPU, held=held)
    assert isinstance(model, LlamaModel)
    assert model.layers[0].qkv.quantized is not None
    _check(model, cfg.tie_word_embeddings)
