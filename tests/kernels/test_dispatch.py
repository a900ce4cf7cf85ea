"""Backend selection (auto / reference / triton) and argument validation."""

from __future__ import annotations

import threading

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels import dispatch
from tests.kernels.cases import HAS_CUDA, make_paged


def test_auto_rule_for_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    cpu = torch.empty(1)
    expected = "triton" if dispatch.interpret_requested() and dispatch.triton_available() else "cpu"
    assert kernels.backend_for(cpu) == expected
    # The interpreter cannot do bf16 math: auto keeps bf16 CPU calls on the CPU backend.
    assert kernels.backend_for(cpu.bfloat16()) == "cpu"


def test_use_backend_overrides_env_and_nests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert kernels.requested_backend() == "reference"
    assert kernels.backend_for(torch.empty(1)) == "reference"
    with kernels.use_backend("auto"):
        assert kernels.requested_backend() == "auto"
        with kernels.use_backend("reference"):
            assert kernels.backend_for(torch.empty(1)) == "reference"
        assert kernels.requested_backend() == "auto"
    assert kernels.requested_backend() == "reference"


def test_override_is_per_thread() -> None:
    seen: list[str] = []
    with kernels.use_backend("reference"):
        t = threading.Thread(target=lambda: seen.append(kernels.requested_backend()))
        t.start()
        t.join()
    assert seen == [dispatch.requested_backend()]  # the other thread did not inherit the override


def test_bad_backend_names(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown kernel backend"):
        with kernels.use_backend("cuda"):  # type: ignore[arg-type]
            pass
    monkeypatch.setenv(dispatch.ENV_VAR, "fast")
    with pytest.raises(ValueError, match=dispatch.ENV_VAR):
        kernels.backend_for(torch.empty(1))


@pytest.mark.skipif(HAS_CUDA, reason="CPU-only rule")
def test_reference_override_runs_without_the_interpreter() -> None:
    case = make_paged([5, 20], 16, 1, 64, torch.float32, seed=1)
    q = torch.randn(2, 2, 64)
    with kernels.use_backend("reference"):
        out = kernels.paged_decode_attention(
            q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1
        )
    ref = kernels.reference.paged_decode_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1
    )
    assert torch.equal(out, ref)


def test_validation_messages() -> None:
    case = make_paged([5, 20], 16, 2, 64, torch.float32, seed=2)
    kc, vc, bt, sl = case.key_cache, case.value_cache, case.block_tables, case.seq_lens
    q = torch.randn(2, 4, 64, device=kc.device)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kernels.paged_decode_attention(torch.randn(2, 3, 64, device=kc.device), kc, vc, bt, sl, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        kernels.paged_decode_attention(torch.randn(2, 4, 32, device=kc.device), kc, vc, bt, sl, 0.1)
    with pytest.raises(ValueError, match="dtype"):
        kernels.paged_decode_attention(q.half(), kc, vc, bt, sl, 0.1)
    with pytest.raises(ValueError, match="block_tables has 2 rows"):
        kernels.paged_decode_attention(q, kc, vc, bt, sl[:1], 0.1)
    with pytest.raises(ValueError, match="value_cache shape"):
        kernels.paged_decode_attention(q, kc, vc[:, :8], bt, sl, 0.1)
    with pytest.raises(ValueError, match="seq_lens must have dtype"):
        kernels.paged_decode_attention(q, kc, vc, bt, sl.float(), 0.1)
    with pytest.raises(ValueError, match="out must match"):
        kernels.paged_decode_attention(q, kc, vc, bt, sl, 0.1, out=torch.empty(2, 4, 63))
    if kc.device.type == "cpu":
        with pytest.raises(ValueError, match="needs more than"):
            kernels.paged_decode_attention(q, kc, vc, bt, torch.tensor([5, 1000], dtype=torch.int32), 0.1)
        with pytest.raises(ValueError, match="slot_mapping values"):
            kernels.write_kv_cache(q[:, :2], q[:, :2], kc, vc, torch.tensor([0, 10**6]))
        with pytest.raises(ValueError, match="more queries than"):
            kernels.paged_prefill_attention(
                torch.randn(9, 4, 64),
                kc,
                vc,
                bt,
                torch.tensor([0, 6, 9], dtype=torch.int32),
                torch.tensor([5, 3], dtype=torch.int32),
                0.1,
            )
    with pytest.raises(ValueError, match="query_start_loc needs"):
        kernels.paged_prefill_attention(
            q, kc, vc, bt, torch.tensor([0, 2], dtype=torch.int32, device=kc.device), sl, 0.1
        )
    with pytest.raises(ValueError, match=r"pairs must have shape \[n, 2\]"):
        kernels.copy_blocks([kc], [vc], torch.tensor([1, 2]).view(1, 2, 1)[0])
    with pytest.raises(ValueError, match="block shape"):
        kernels.swap_blocks(kc.cpu(), torch.empty(4, 16, 2, 32), torch.tensor([[0, 1]]))
