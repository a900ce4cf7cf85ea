"""An 8-bit KV cache end to end: `pagedkv up` / the in-process stack take --kv-cache-dtype and
--kv-cache-memory, the block manager sizes the pool from the model's bytes per block, the cache host
allocates int8 rows with their scales, and greedy generation runs on them."""

from __future__ import annotations

import pytest
import torch

from pagedkv import kv_capacity
from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.frontend.engine import GenerationRequest
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from tests.frontend.engine.test_engine import prompts
from tests.worker_svc.conftest import HFModel, build_hf_model


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("kv8-llama"), seed=5)


def test_up_sizes_the_pool_from_the_budget_and_the_models_bytes_per_block() -> None:
    from pagedkv.block_manager_svc.settings import load_settings
    from pagedkv.frontend.launch.processes import build_parser, options_from_args, plan
    from pagedkv.worker_svc.model.config import DEFAULT_MODEL_CONFIG as M

    argv = ["--kv-cache-dtype", "int8", "--kv-cache-memory", "0.01", "--device", "cpu", "--dtype", "float32"]
    bm = plan(options_from_args(build_parser().parse_args(argv)))[0]
    s = load_settings(bm.args[bm.args.index("block-manager") + 1 :])
    per_block = M.num_layers * 2 * 16 * M.num_kv_heads * (M.head_dim + 4)  # int8 rows + fp32 scales
    assert (s.kv_cache_dtype, s.kv_bytes_per_block) == ("int8", per_block)
    assert s.num_gpu_blocks == int(0.01 * kv_capacity.GIB) // per_block
    bm = plan(options_from_args(build_parser().parse_args([])))[0]  # default: counted in blocks, model dtype
    s = load_settings(bm.args[bm.args.index("block-manager") + 1 :])
    assert (s.kv_cache_dtype, s.kv_cache_memory) == ("auto", 0.0)


Run = tuple[list[list[int]], list[list[float]], torch.dtype, int]


def _generate(hf: HFModel, kv: str, ps: list[list[int]], backend: str = "cpu") -> Run:
    # 64.5 blocks of this dtype (2 layers, 2 KV heads, head_dim 16, 4-token blocks, fp32 model): 64 fit
    budget = 64.5 * kv_capacity.block_bytes(2, 2, 16, 4, kv, 4) / kv_capacity.GIB
    with LocalStack(
        StackConfig(
            model=str(hf.path),
            device="cpu",
            dtype="float32",
            block_size=4,
            kv_cache_dtype=kv,
            kv_cache_memory=budget,
            kernel_backend=backend,
        )
    ) as st:
        outs = st.engine().generate([GenerationRequest(f"r{i}", p, max_tokens=12) for i, p in enumerate(ps)])
        with BlockManagerClient(st.block_manager_target) as bm:
            stats = bm.get_stats()
            cfg = bm.get_config()
        assert stats.num_used_blocks == 0 and stats.num_sequences == 0
        assert (cfg.kv_cache_dtype, cfg.num_gpu_blocks) == (kv, 64)
        tokens = [o.completions[0].token_ids for o in outs]
        return tokens, [o.completions[0].logprobs for o in outs], st.cache.gpu.dtype, st.cache.gpu.shape[-1]


def test_greedy_generation_on_an_int8_cache(hf: HFModel) -> None:
    """The native int8 kernels give the reference's tokens and log-probabilities through the whole
    stack; against the fp32 cache the same tokens on all but near-ties (a sequence may part at one and
    then go its own way), and up to where they part log-probabilities within 0.15 (this tiny random
    model's logits are large: its weights are drawn 10x wider than a trained model's)."""
    ps = prompts(8, 6)
    wide, wide_lp, wide_dtype, wide_row = _generate(hf, "auto", ps)
    narrow, narrow_lp, narrow_dtype, narrow_row = _generate(hf, "int8", ps)
    ref, ref_lp, _, _ = _generate(hf, "int8", ps, backend="reference")
    assert (wide_dtype, wide_row, narrow_dtype, narrow_row) == (torch.float32, 16, torch.int8, 20)
    assert narrow == ref
    assert (
        max(abs(x - y) for a, b in zip(narrow_lp, ref_lp, strict=True) for x, y in zip(a, b, strict=True))
        < 5e-3
    )
    assert all(len(t) == 12 for t in narrow)
    assert sum(a == b for a, b in zip(wide, narrow, strict=True)) >= 5, (wide, narrow)
    for a, b, la, lb in zip(wide, narrow, wide_lp, narrow_lp, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        assert same >= 2, (a, b)  # the first tokens are far from ties
        assert max(abs(x - y) for x, y in zip(la[:same], lb[:same], strict=True)) < 0.15


def test_serve_refuses_a_pool_of_another_kv_dtype(hf: HFModel) -> None:
    from pagedkv.frontend.serve.server import OpenAIServer
    from pagedkv.frontend.serve.settings import ServeSettings

    with LocalStack(
        StackConfig(
            model=str(hf.path),
            device="cpu",
            dtype="float32",
            block_size=4,
            num_gpu_blocks=32,
            kv_cache_dtype="int8",
        )
    ) as st:
        common = {"port": 0, "block_manager": st.block_manager_target, "workers": ",".join(st.worker_targets)}
        with pytest.raises(
            ValueError, match="settings \\(--kv-cache-dtype\\) have auto, the block manager at .* has int8"
        ):
            OpenAIServer(ServeSettings(kv_cache_dtype="auto", **common))  # type: ignore[arg-type]
        OpenAIServer(ServeSettings(kv_cache_dtype="int8", **common)).stop()  # type: ignore[arg-type]
