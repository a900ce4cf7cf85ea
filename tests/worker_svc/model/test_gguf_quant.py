"""A GGUF file's quantized matrices held as integers (worker_svc/model/gguf_quant.py) against the
gguf package's own dequantization: Q4_K / Q6_K as the file's own blocks (exactly), Q4_0 / Q4_1
exactly (up to fp32 rounding) as int4 groups, Q8_0 / Q5_* as int8 rows within half a step; a model
held that way generates what transformers does on the weights it holds, at about the file's size
(a Q4_K_M-like file at its size), and the cache host shares it."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.kernels.cpu.quant_linear import INPUT_ROUNDING
from pagedkv.kernels.quant_linear import QuantizedLinear
from pagedkv.worker_svc.cache import shared_weights
from pagedkv.worker_svc.model import gguf_file, gguf_quant
from pagedkv.worker_svc.model.config import load_model_config
from pagedkv.worker_svc.model.weights import fuse, fused_spec, load_checkpoint, load_model
from pagedkv.worker_svc.model_runner import ModelRunner
from tests.kernels import kquant_cases
from tests.worker_svc.families import (
    build,
    oracle_on,
    random_k_blocks,
    rounded_inputs,
    small_q4_1_llama,
    small_q4_k_m_llama,
    write_gguf,
)
from tests.worker_svc.generation import Scheduler, runner_step

gguf = pytest.importorskip("gguf")
CPU = torch.device("cpu")
PROMPT = [5, 17, 99, 3, 64, 12, 7, 88, 41, 2]


def _paths(*kinds: str) -> str:
    """The linear path a model of these matrix kinds reports: the native kernels where loaded."""
    return "+".join(f"native-{k}" if cpu_native.available() else k for k in kinds)


def _blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw blocks of ``qtype`` for a random ``[rows, cols]`` matrix (random valid K-quant blocks)."""
    if qtype in ("Q4_K", "Q5_K", "Q6_K"):
        return random_k_blocks((rows, cols), qtype, seed)
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.1
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])


def _file_weights(raw: np.ndarray, qtype: str, shape: tuple[int, int]) -> torch.Tensor:
    out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(shape))


@pytest.mark.parametrize("qtype", gguf_quant.INT4_TYPES)
@pytest.mark.parametrize("rows", [40, 7])
def test_int4_types_are_held_exactly(qtype: str, rows: int) -> None:
    cols = 512
    raw = _blocks(qtype, rows, cols, seed=rows)
    ref = _file_weights(raw, qtype, (rows, cols))
    parts = gguf_quant.int4_parts(raw, qtype, (rows, cols))
    assert parts.kind == "int4" and parts.q.max() <= 15
    scale_of_w = float(ref.abs().max())
    torch.testing.assert_close(parts.dequantize(), ref, rtol=0, atol=4e-7 * scale_of_w)
    m = parts.pack()
    torch.testing.assert_close(m.dequantize(), ref, rtol=0, atol=1e-6 * scale_of_w)
    x = torch.randn((3, cols), generator=torch.Generator().manual_seed(1))
    layer = QuantizedLinear.build(m)
    y = layer(x)
    if layer.path == "native-int4":  # the kernel multiplies x rounded to 16 bits per 32 inputs
        r = INPUT_ROUNDING["int4"]
        x = kquant_cases.round_inputs_as_the_kernel_does(x, r.block, r.top)
    torch.testing.assert_close(y.double(), x.double() @ ref.double().t(), rtol=1e-4, atol=1e-4 * scale_of_w)
    # A group scale read from the wrong block turns the comparison red.
    wrong = gguf_quant.Unpacked(parts.q, parts.scale.roll(1, dims=1), parts.offset)
    assert (wrong.dequantize() - ref).abs().max() > 100 * 4e-7 * scale_of_w


@pytest.mark.parametrize("qtype", gguf_quant.INT8_TYPES)
def test_other_types_are_requantized_to_int8_rows_within_half_a_step(qtype: str) -> None:
    rows, cols = 24, 256
    raw = _blocks(qtype, rows, cols, seed=3)
    ref = _file_weights(raw, qtype, (rows, cols))
    held = gguf_quant.to_int8(ref)
    step = ref.abs().amax(dim=1, keepdim=True) / 127
    assert ((held.dequantize() - ref).abs() <= step / 2 + 1e-7).all()
    err = gguf_quant.conversion_error("w", held, ref)
    assert err.form == "int8" and 0 < err.rel_rms < 0.02 and err.max_abs <= float(step.max()) / 2 + 1e-7


def test_mixed_parts_of_a_fused_matrix_become_int8_rows() -> None:
    a = gguf_quant.int4_parts(_blocks("Q4_0", 16, 64, 1), "Q4_0", (16, 64))
    b = torch.randn(8, 64)
    both = gguf_quant.concat([a, b])
    assert isinstance(both, gguf_quant.Unpacked) and both.kind == "int8" and both.shape == (24, 64)
    assert gguf_quant.fused_form(["int4", "dense"]) == "int8" == gguf_quant.fused_form(["int8", "int4"])
    same = gguf_quant.concat([a, a])
    assert isinstance(same, gguf_quant.Unpacked) and same.kind == "int4"
    torch.testing.assert_close(same.dequantize(), torch.cat([a.dequantize()] * 2), rtol=0, atol=0)


def _nbytes(spec: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    return sum(int(np.prod(shape)) * torch.empty((), dtype=dt).element_size() for shape, dt in spec.values())


def _runner(path: pathlib.Path, held: str) -> ModelRunner:
    cfg = load_model_config(str(path))
    model = load_model(str(path), cfg, torch.float32, CPU, held=held)
    shape = (cfg.num_layers, 2, 32, 4, cfg.num_kv_heads, cfg.head_dim)
    return ModelRunner(model, torch.zeros(shape), torch.zeros((*shape[:2], 8, *shape[3:])))


def _held_state(path: pathlib.Path) -> dict[str, torch.Tensor]:
    """What the model computes with, as fp32 in HF names (oracle weights)."""
    cfg = load_model_config(str(path))
    w = load_checkpoint(str(path), cfg, torch.float32, CPU, held="file")
    return {
        n: t.dequantize() if isinstance(t, (gguf_quant.Unpacked, gguf_quant.KBlocks)) else t
        for n, t in w.items()
    }


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q8_0"])
def test_a_quantized_file_held_as_integers_generates_what_transformers_does(
    qtype: str, tmp_path: pathlib.Path
) -> None:
    """A Llama (hidden 256, 40 KV rows: padded int4 rows) with every matrix of ``qtype``, held in
    the file's own quantization, generates transformers' greedy tokens on the weights it holds
    (for int4 and K-quant types: the file's weights), and holds them at about the file's size."""
    hf = build(
        "LlamaForCausalLM",
        tmp_path / "hf",
        seed=3,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
    )
    path = tmp_path / f"m.{qtype}.gguf"
    file_state = write_gguf(hf, path, qtype)
    held = _held_state(path)
    if qtype in gguf_quant.KQUANT_TYPES:  # the file's blocks: every weight exactly the file's
        for n, t in file_state.items():
            torch.testing.assert_close(held[n], t, rtol=0, atol=0, msg=n)
    elif qtype in gguf_quant.INT4_TYPES:
        for n, t in file_state.items():
            if n != gguf_quant.EMBEDDING:
                torch.testing.assert_close(held[n], t, rtol=0, atol=1e-6 * float(t.abs().max()), msg=n)
    runner = _runner(path, "file")
    oracle = oracle_on(hf, held, tmp_path / "hf", rounded_inputs(runner.model))
    kinds = (
        ("kquant",)
        if qtype in gguf_quant.KQUANT_TYPES
        else ("int8", "int4")
        if qtype in gguf_quant.INT4_TYPES
        else ("int8",)
    )
    assert runner.model.linear_path == _paths(*kinds)
    sched = Scheduler(runner_step(runner), block_size=4)
    sched.add("a", PROMPT)
    sched.generate(["a"], 8)
    assert sched.seqs["a"].generated == oracle.greedy(PROMPT, 8)
    # Resident: exactly the packed tensors (16 B of nibbles + 8 B of fp32 scale and offset per 32
    # weights for int4, 1 B a weight + a scale a row for int8), about the file's size, not 4-8x.
    spec = fused_spec(str(path), load_model_config(str(path)), torch.float32, "file")
    assert runner.model.weight_bytes == _nbytes(spec)
    header = gguf_file.read_header(path)
    file_bytes = sum(gguf_file.tensor_bytes(t) for t in header.tensors.values())
    dense_bytes = sum(4 * int(np.prod(t.shape)) for t in header.tensors.values())
    assert runner.model.weight_bytes < 0.45 * dense_bytes and runner.model.weight_bytes < 1.8 * file_bytes


def test_a_q4_k_m_file_is_held_at_its_size_and_generates_the_dequantized_files_tokens(
    tmp_path: pathlib.Path,
) -> None:
    """A Q4_K_M-like file (Q4_K matrices, Q6_K value rows, down projections and output layer; the
    fused QKV joins both types) is held as its own blocks: every weight exactly the gguf package's,
    at most 1.15x the file's tensor bytes (in fact the file's bytes plus 8 bytes a row segment),
    and it generates transformers' greedy tokens on the same file dequantized to fp32: pagedkv's
    dense path exactly so, the K-quant path with each linear layer's input rounded to 8 bits per
    256 as its kernel does."""
    hf, path = small_q4_k_m_llama(tmp_path, 5)
    cfg = load_model_config(str(path))
    header = gguf_file.read_header(path)
    types = {t.type_name for t in header.tensors.values()}
    assert {"Q4_K", "Q6_K"} <= types
    held = _held_state(path)
    dense = load_checkpoint(str(path), cfg, torch.float32, CPU, held="dense")
    for n, t in dense.items():
        torch.testing.assert_close(held[n], t, rtol=0, atol=0, msg=n)
    runner, dense_runner = _runner(path, "file"), _runner(path, "dense")
    assert runner.model.linear_path == _paths("kquant")
    qkv = runner.model.layers[0].qkv.quantized
    assert qkv is not None and qkv.qscale.tolist() == [[12, 256], [12, 128], [14, 128]]  # Q4_K, Q4_K, Q6_K
    file_bytes = sum(gguf_file.tensor_bytes(t) for t in header.tensors.values())
    model_bytes = sum(  # the file's tensors but rope_freqs.weight (the rotary table, not a weight)
        gguf_file.tensor_bytes(t) for t in header.tensors.values() if gguf_file.hf_name(t.name) is not None
    )
    segments = sum(
        int(t.numel())
        for n, t in fuse(load_checkpoint(str(path), cfg, torch.float32, CPU, held="file"), cfg).items()
        if n.endswith(".qscale")
    )
    assert runner.model.weight_bytes == model_bytes + 4 * segments <= 1.15 * file_bytes
    tokens = {}
    for name, r in (("kquant", runner), ("dense", dense_runner)):
        sched = Scheduler(runner_step(r), block_size=4)
        sched.add("a", PROMPT)
        sched.generate(["a"], 12)
        tokens[name] = sched.seqs["a"].generated
    assert tokens["dense"] == oracle_on(hf, held, tmp_path / "hf").greedy(PROMPT, 12)
    rounded = oracle_on(hf, held, tmp_path / "hf", rounded_inputs(runner.model))
    assert tokens["kquant"] == rounded.greedy(PROMPT, 12)


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K_M"])
def test_the_cache_host_shares_the_integers(kind: str, tmp_path: pathlib.Path) -> None:
    """The fused, packed tensors fit ``fused_spec`` (known from the header alone) and a model built
    on views of the shared region computes what a privately loaded one does, bit for bit."""
    from pagedkv.worker_svc.model.llama import LlamaModel

    make = small_q4_1_llama if kind == "Q4_1" else small_q4_k_m_llama
    hf, path = make(tmp_path, 2, f"m.{kind}.gguf")
    cfg = load_model_config(str(path))
    state = fuse(load_checkpoint(str(path), cfg, torch.float32, CPU, held="file"), cfg)
    spec = fused_spec(str(path), cfg, torch.float32, "file")
    assert {n: (tuple(t.shape), t.dtype) for n, t in state.items()} == spec
    assert state["model.layers.0.self_attn.qkv_proj.qweight"].dtype is torch.uint8
    host = shared_weights.pack(state, CPU, "model:m", shm_prefix="pagedkv-gq-test")
    try:
        mapped = shared_weights.bind(host.descriptor, CPU, spec)
        try:
            shared, private = (
                LlamaModel(cfg, mapped.tensors),
                load_model(str(path), cfg, torch.float32, CPU, held="file"),
            )
            qkv = shared.layers[0].qkv.quantized
            assert qkv is not None and qkv.qweight.untyped_storage().data_ptr() == (
                mapped.tensors["model.embed_tokens.qweight"].untyped_storage().data_ptr()
            )
            a = _runner_logits(shared, cfg)
            torch.testing.assert_close(a, _runner_logits(private, cfg), rtol=0, atol=0)
            with pytest.raises(ValueError, match="tensors differ"):
                shared_weights.bind(host.descriptor, CPU, fused_spec(str(path), cfg, torch.float32, "dense"))
        finally:
            mapped.close()
    finally:
        host.close()


def _runner_logits(model: object, cfg: object) -> torch.Tensor:
    from pagedkv.worker_svc.model_runner import SequenceRequest

    shape = (cfg.num_layers, 2, 8, 4, cfg.num_kv_heads, cfg.head_dim)  # type: ignore[attr-defined]
    runner = ModelRunner(model, torch.zeros(shape), torch.zeros(shape))  # type: ignore[arg-type]
    out = runner.step([SequenceRequest("s", PROMPT, [0, 1, 2], 0, return_logits=True)]).outputs[0]
    assert out.logits is not None
    return out.logits.clone()


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K_M"])
def test_processes_hold_a_gguf_in_its_own_quantization_by_default(kind: str, tmp_path: pathlib.Path) -> None:
    """`pagedkv cache-host --model FILE.gguf` (no flag) shares the file's integers; a worker maps
    them, says so in `worker_ready` (weight bytes, int4 / int8 / kquant paths) and generates
    transformers' tokens on the weights held; a worker asking for fp32 weights refuses that host
    (exit code 2)."""
    import grpc

    from pagedkv.v1 import worker_pb2_grpc
    from tests.worker_svc.generation import grpc_step
    from tests.worker_svc.test_processes import GPU_BLOCKS, Proc, start_cache_host, start_worker

    make = small_q4_1_llama if kind == "Q4_1" else small_q4_k_m_llama
    hf, path = make(tmp_path, 4, f"llama.{kind}.gguf")
    cfg = load_model_config(str(path))
    rounded = rounded_inputs(load_model(str(path), cfg, torch.float32, CPU, held="file"))
    oracle = oracle_on(hf, _held_state(path), tmp_path / "hf", rounded)
    spec = fused_spec(str(path), cfg, torch.float32, "file")
    spec_bytes = sum(
        int(np.prod(shape)) * torch.empty((), dtype=dt).element_size() for shape, dt in spec.values()
    )
    procs: list[Proc] = []
    try:
        host, ready = start_cache_host(path, 0, "pagedkv-gguf-quant-test")
        procs.append(host)
        assert ready["weights_source"] == f"model:llama.{kind}.gguf;held=file"
        assert (
            spec_bytes
            <= ready["weights_bytes"]
            < spec_bytes + 64 * len(fused_spec(str(path), cfg, torch.float32, "file"))
        )
        w = start_worker(path, ready["port"])
        dense = start_worker(path, ready["port"], "--weight-format", "fp32")
        procs += [w, dense]
        w_ready = w.wait_event("worker_ready")
        assert w_ready["shared_weights"] is True and w_ready["weight_format"] == "auto"
        assert w_ready["weight_bytes"] == spec_bytes and w_ready["linear_path"] == (
            _paths("int8", "int4") if kind == "Q4_1" else _paths("kquant")
        )
        assert dense.p.wait(60) == 2 and "held=file" in dense.wait_event("config_error")["error"]
        with grpc.insecure_channel(f"127.0.0.1:{w_ready['port']}") as ch:
            sched = Scheduler(
                grpc_step(worker_pb2_grpc.WorkerStub(ch)), num_gpu_blocks=GPU_BLOCKS, block_size=4
            )
            sched.add("s", PROMPT)
            sched.generate(["s"], 8)
        assert sched.seqs["s"].generated == oracle.greedy(PROMPT, 8)
        assert w.stop() == 0
        assert host.stop() == 0
    finally:
        for p in procs:
            if p.p.poll() is None:
                p.p.kill()
