"""GGUF files as models (worker_svc/model/gguf_file.py): quantized files against an oracle on the
dequantized weights, the metadata -> config mapping, and what is refused (naming it).

Files are written with the gguf package's writer the way llama.cpp writes them
(tests/worker_svc/families.py). The whole-stack runs of F32 files are in
tests/frontend/engine/test_model_families.py.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from pagedkv.worker_svc.model import gguf_file
from pagedkv.worker_svc.model.config import ModelConfig, load_model_config
from pagedkv.worker_svc.model.weights import load_checkpoint, load_model
from pagedkv.worker_svc.model_runner import ModelRunner
from tests.worker_svc.conftest import HFModel
from tests.worker_svc.families import FAMILIES, build, oracle_on, write_gguf
from tests.worker_svc.generation import Scheduler, runner_step

gguf = pytest.importorskip("gguf")
BLOCK = 4
PROMPT = [5, 17, 99, 3, 64, 12, 7, 88, 41, 2]


def _runner(path: pathlib.Path) -> ModelRunner:
    cfg = load_model_config(str(path))
    model = load_model(str(path), cfg, torch.float32, torch.device("cpu"))
    shape = (cfg.num_layers, 2, 32, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    return ModelRunner(model, torch.zeros(shape), torch.zeros((*shape[:2], 8, *shape[3:])))


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_quantized_file_generates_what_transformers_does_on_its_dequantized_weights(
    arch: str, qtype: str, tmp_path: pathlib.Path
) -> None:
    hf = build(arch, tmp_path / "hf", seed=7)
    path = tmp_path / f"m.{qtype}.gguf"
    held = write_gguf(hf, path, qtype)
    oracle = oracle_on(hf, held, tmp_path / "hf")
    # The file really holds other weights than the fp32 model (else this test proves nothing).
    assert any(not torch.equal(held[n], t) for n, t in hf.model.state_dict().items() if n in held)  # type: ignore[attr-defined]
    sched = Scheduler(runner_step(_runner(path)), block_size=BLOCK)
    sched.add("a", PROMPT)
    sched.generate(["a"], 12)
    assert sched.seqs["a"].generated == oracle.greedy(PROMPT, 12)


@pytest.mark.parametrize("qtype", ["BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_every_supported_type_loads_as_gguf_dequantizes_it(qtype: str, tmp_path: pathlib.Path) -> None:
    """A Llama (hidden 256: K-quant rows are 256-weight super-blocks) with every matrix of ``qtype``
    generates what transformers does on the weights the gguf package dequantizes from the file."""
    hf = build(
        "LlamaForCausalLM",
        tmp_path / "hf",
        seed=3,
        hidden_size=256,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    path = tmp_path / f"m.{qtype}.gguf"
    held = write_gguf(hf, path, qtype)
    assert all(torch.isfinite(t).all() and t.std() > 0.01 for t in held.values() if t.dim() == 2), qtype
    oracle = oracle_on(hf, held, tmp_path / "hf")
    logits = oracle.last_logits(PROMPT)
    assert torch.isfinite(logits).all() and logits.std() > 0.1  # a model, not a degenerate one
    sched = Scheduler(runner_step(_runner(path)), block_size=BLOCK)
    sched.add("a", PROMPT)
    sched.generate(["a"], 8)
    assert sched.seqs["a"].generated == oracle.greedy(PROMPT, 8)


def test_f32_file_holds_exactly_the_checkpoint_and_the_config(tmp_path: pathlib.Path) -> None:
    """Names, Q/K row order (un-permuted), tied head and Llama 3 rope: the GGUF loads as the HF dir."""
    hf = build("LlamaForCausalLM", tmp_path / "hf")
    path = tmp_path / "llama.gguf"
    write_gguf(hf, path, "F32")
    from_dir, from_file = ModelConfig.from_dir(hf.path), load_model_config(str(path))
    assert from_file.name == "llama.gguf" and from_file.architecture == "LlamaForCausalLM"
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "tie_word_embeddings",
        "max_position_embeddings",
    ):
        assert getattr(from_file, field) == getattr(from_dir, field), field
    assert from_file.rms_norm_eps == pytest.approx(from_dir.rms_norm_eps)
    from pagedkv.worker_svc.model.rope import inverse_frequencies

    torch.testing.assert_close(
        inverse_frequencies(from_file.rope, from_file.head_dim),
        inverse_frequencies(from_dir.rope, from_dir.head_dim),
        rtol=1e-6,
        atol=0,
    )
    a = load_checkpoint(str(hf.path), from_dir, torch.float32, torch.device("cpu"))
    b = load_checkpoint(str(path), from_file, torch.float32, torch.device("cpu"))
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_permute_back_inverts_llama_cpp_permutation() -> None:
    from tests.worker_svc.families import _permute

    w = np.random.default_rng(0).standard_normal((6 * 8, 5)).astype(np.float32)
    back = gguf_file.permute_back(torch.from_numpy(_permute(w, 6)), 6)
    assert torch.equal(back, torch.from_numpy(w))


def _tiny_file(path: pathlib.Path, arch: str = "llama", qtype: str = "F32", **meta: object) -> pathlib.Path:
    """A one-layer GGUF with the given metadata; the embedding stored as ``qtype`` (raw bytes for
    types gguf cannot quantize: only the type is looked at before anything is read)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(64)
    w.add_embedding_length(256)
    w.add_block_count(1)
    w.add_feed_forward_length(512)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    for key, value in meta.items():
        w.add_uint32(f"{arch}.{key}", int(value))  # type: ignore[call-overload]
    q = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[q]
    raw = np.zeros((8, 256 // block * size), dtype=np.uint8)
    w.add_tensor(
        "token_embd.weight",
        raw if qtype != "F32" else np.zeros((8, 256), np.float32),
        raw_dtype=q if qtype != "F32" else None,
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_tensor_types_are_refused_naming_the_type(tmp_path: pathlib.Path) -> None:
    for qtype in ("Q2_K", "IQ4_NL", "Q3_K"):
        with pytest.raises(
            ValueError, match=rf"token_embd.weight has type {qtype}.*supported: F32, F16, BF16, Q4_0"
        ):
            load_model_config(str(_tiny_file(tmp_path / f"{qtype}.gguf", qtype=qtype)))


def test_what_the_decoder_cannot_run_is_refused_naming_the_field(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="general.architecture 'gemma'"):
        load_model_config(str(_tiny_file(tmp_path / "g.gguf", arch="gemma")))
    with pytest.raises(ValueError, match=r"sliding_window=16 \(< max_position_embeddings 64\)"):
        load_model_config(str(_tiny_file(tmp_path / "sw.gguf", **{"attention.sliding_window": 16})))
    with pytest.raises(ValueError, match="num_experts=8"):
        load_model_config(str(_tiny_file(tmp_path / "moe.gguf", **{"expert_count": 8})))
    with pytest.raises(ValueError, match="rope.dimension_count is 32"):
        load_model_config(str(_tiny_file(tmp_path / "rot.gguf", **{"rope.dimension_count": 32})))
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="not GGUF"):
        load_model_config(str(not_gguf))
    with pytest.raises(FileNotFoundError, match="no such directory or GGUF file"):
        load_model_config(str(tmp_path / "missing.gguf"))


RAW = {
    "vocab_size": 10,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}


@pytest.mark.parametrize(
    ("arch", "extra", "field"),
    [
        ("MistralForCausalLM", {"sliding_window": 64}, "sliding_window=64"),
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window=true"),
        ("Qwen3ForCausalLM", {"layer_types": ["sliding_attention"]}, "layer_types has sliding_attention"),
        ("Qwen2ForCausalLM", {"num_experts": 4}, "num_experts=4"),
        ("MistralForCausalLM", {"num_local_experts": 8}, "num_local_experts=8"),
        ("Qwen3ForCausalLM", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ("Qwen2ForCausalLM", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_configs_the_families_cannot_run_are_refused(arch: str, extra: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_dict({"architectures": [arch], **RAW, **extra})


def test_windows_that_never_drop_a_token_are_accepted() -> None:
    for arch, extra in [
        ("MistralForCausalLM", {"sliding_window": None}),
        ("MistralForCausalLM", {"sliding_window": 128}),
        ("Qwen2ForCausalLM", {"use_sliding_window": False, "sliding_window": 16}),
    ]:
        assert ModelConfig.from_hf_dict({"architectures": [arch], **RAW, **extra}).architecture == arch


def test_each_family_loads_its_checkpoint_layout(tmp_path: pathlib.Path) -> None:
    """Qwen2's q/k/v biases (no o bias), Qwen3's q/k norms and head_dim, from the saved directories."""
    for arch in FAMILIES:
        hf: HFModel = build(arch, tmp_path / arch)
        cfg = ModelConfig.from_dir(hf.path)
        w = load_checkpoint(str(hf.path), cfg, torch.float32, torch.device("cpu"))
        names = set(w)
        assert ("model.layers.0.self_attn.q_proj.bias" in names) == (arch == "Qwen2ForCausalLM"), arch
        assert "model.layers.0.self_attn.o_proj.bias" not in names
        assert ("model.layers.1.self_attn.k_norm.weight" in names) == (arch == "Qwen3ForCausalLM"), arch
        if arch == "Qwen3ForCausalLM":
            assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_heads


def test_cache_host_shares_a_gguf_files_weights_with_worker_processes(tmp_path: pathlib.Path) -> None:
    """`pagedkv cache-host --model FILE.gguf --weight-format fp32` loads (dequantizes) once and
    exports the weights; a worker given the same file maps them instead of loading, and generates
    transformers' tokens on the dequantized weights; a worker given another file refuses to start
    (exit code 2). (The file's own quantization, the default: test_gguf_quant.py.)"""
    import grpc

    from pagedkv.v1 import worker_pb2_grpc
    from tests.worker_svc.generation import grpc_step
    from tests.worker_svc.test_processes import GPU_BLOCKS, Proc, start_cache_host, start_worker

    hf = build("Qwen2ForCausalLM", tmp_path / "hf", seed=11)
    path = tmp_path / "qwen2.Q8_0.gguf"
    oracle = oracle_on(hf, write_gguf(hf, path, "Q8_0"), tmp_path / "hf")
    other = tmp_path / "other.F32.gguf"
    write_gguf(hf, other, "F32")
    procs: list[Proc] = []
    try:
        host, ready = start_cache_host(path, 0, "pagedkv-gguf-test", "--weight-format", "fp32")
        procs.append(host)
        assert ready["weights_bytes"] > 0 and ready["weights_source"] == "model:qwen2.Q8_0.gguf"
        w = start_worker(path, ready["port"], "--weight-format", "fp32")
        bad = start_worker(other, ready["port"], "--weight-format", "fp32")
        procs += [w, bad]
        w_ready = w.wait_event("worker_ready")
        assert w_ready["shared_weights"] is True
        assert bad.p.wait(60) == 2 and "weights mismatch" in bad.wait_event("config_error")["error"]
        with grpc.insecure_channel(f"127.0.0.1:{w_ready['port']}") as ch:
            sched = Scheduler(
                grpc_step(worker_pb2_grpc.WorkerStub(ch)), num_gpu_blocks=GPU_BLOCKS, block_size=BLOCK
            )
            sched.add("s", PROMPT)
            sched.generate(["s"], 10)
        assert sched.seqs["s"].generated == oracle.greedy(PROMPT, 10)
        assert w.stop() == 0
        assert host.stop() == 0
    finally:
        for p in procs:
            if p.p.poll() is None:
                p.p.kill()
