"""``--weight-format`` (worker_svc/model/weight_format.py): what each value resolves to, what is
refused (naming the conflict), and a Hugging Face directory quantized at load (int8 rows, int4
groups) generating transformers' tokens on the weights it holds."""

from __future__ import annotations

import pathlib

import pytest
import torch

from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.worker_svc.model import gguf_quant, weight_format
from pagedkv.worker_svc.model.config import load_model_config
from pagedkv.worker_svc.model.weights import load_checkpoint, load_model
from pagedkv.worker_svc.model_runner import ModelRunner
from tests.worker_svc.conftest import build_hf_model
from tests.worker_svc.families import oracle_on, rounded_inputs, write_gguf
from tests.worker_svc.generation import Scheduler, runner_step

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
F32, BF16 = torch.float32, torch.bfloat16
PROMPT = [5, 17, 99, 3, 64, 12, 7, 88, 41, 2]


def test_each_value_resolves_or_is_refused_naming_the_conflict(tmp_path: pathlib.Path) -> None:
    hf = build_hf_model(tmp_path / "hf", seed=1)
    gguf_path = tmp_path / "m.gguf"
    write_gguf(hf, gguf_path, "Q8_0")
    d, g = str(hf.path), str(gguf_path)
    assert weight_format.resolve("auto", g, CPU, F32) == "file"
    assert weight_format.resolve("auto", g, CPU, BF16) == "dense"
    assert weight_format.resolve("auto", g, CUDA, BF16) == "dense"
    assert weight_format.resolve("auto", d, CPU, F32) == "dense"
    assert weight_format.resolve("auto", None, CPU, F32) == "dense"
    assert weight_format.resolve("fp32", g, CPU, F32) == "dense"
    assert weight_format.resolve("bf16", g, CPU, BF16) == "dense"
    assert weight_format.resolve("int8", d, CPU, F32) == "int8"
    assert weight_format.resolve("int4", None, CPU, F32) == "int4"
    with pytest.raises(ValueError, match="--weight-format bf16 needs --dtype bfloat16"):
        weight_format.resolve("bf16", g, CPU, F32)
    with pytest.raises(ValueError, match="a GGUF file is held in its own quantization"):
        weight_format.resolve("int4", g, CPU, F32)
    with pytest.raises(ValueError, match="runs on CPU in float32.*cuda bfloat16"):
        weight_format.resolve("int8", d, CUDA, BF16)
    with pytest.raises(ValueError, match="one of auto, fp32, bf16, int8, int4"):
        weight_format.resolve("q4", d, CPU, F32)


@pytest.mark.parametrize("held", ["int8", "int4"])
def test_a_directory_quantized_at_load_generates_what_transformers_does_on_its_weights(
    held: str, tmp_path: pathlib.Path
) -> None:
    hf = build_hf_model(tmp_path / "hf", seed=2, hidden_size=64, intermediate_size=128)
    cfg = load_model_config(str(hf.path))
    w = load_checkpoint(str(hf.path), cfg, F32, CPU, held=held)
    kinds = {n: t.kind for n, t in w.items() if isinstance(t, gguf_quant.Unpacked)}
    assert kinds[gguf_quant.EMBEDDING] == "int8"
    assert kinds["model.layers.0.mlp.down_proj.weight"] == held  # 128 inputs: int4 groups of 32
    held_state = {n: t.dequantize() if isinstance(t, gguf_quant.Unpacked) else t for n, t in w.items()}
    dense = hf.model.state_dict()  # type: ignore[attr-defined]
    worst = max(float((held_state[n] - dense[n]).norm() / dense[n].norm()) for n in kinds)
    assert 0 < worst < (0.02 if held == "int8" else 0.2)
    model = load_model(str(hf.path), cfg, F32, CPU, held=held)
    oracle = oracle_on(hf, held_state, tmp_path / "hf", rounded_inputs(model))
    # untied: the embedding's int8 rows are only looked up
    assert model.linear_path == (f"native-{held}" if cpu_native.available() else held)
    shape = (cfg.num_layers, 2, 32, 4, cfg.num_kv_heads, cfg.head_dim)
    sched = Scheduler(runner_step(ModelRunner(model, torch.zeros(shape), torch.zeros(shape))), block_size=4)
    sched.add("a", PROMPT)
    sched.generate(["a"], 8)
    assert sched.seqs["a"].generated == oracle.greedy(PROMPT, 8)


@pytest.mark.parametrize("held", ["int8", "int4"])
def test_the_built_in_model_quantized_at_load_fits_the_spec_workers_check(held: str) -> None:
    """The cache host packs the built-in model's random weights; a worker checks them against
    ``fused_spec`` (names, shapes, dtypes) before mapping them."""
    from pagedkv.worker_svc.model.weights import fuse, fused_spec

    cfg = load_model_config(None)
    state = fuse(load_checkpoint(None, cfg, F32, CPU, seed=0, held=held), cfg)
    assert {n: (tuple(t.shape), t.dtype) for n, t in state.items()} == fused_spec(None, cfg, F32, held)
    assert any(t.dtype is (torch.uint8 if held == "int4" else torch.int8) for t in state.values())
