"""GPU-path details that can be checked without a GPU (each found by a real gpu_check run).

- ``shared_weights.pack`` waits for its copies explicitly before the region is served;
- a worker's steps run inside its device's scope (CUDA's current device is per thread, and steps
  run on gRPC pool threads);
- the ctypes CUDA runtime fallback picks the runtime torch already loaded, then torch's major.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from pagedkv.worker_svc import devices, model_runner
from pagedkv.worker_svc.cache import cuda_ipc_backend, cudart_fallback, shared_weights
from pagedkv.worker_svc.model.sampling import SamplingParams
from pagedkv.worker_svc.model_runner import SequenceRequest
from tests.worker_svc.conftest import HFModel
from tests.worker_svc.test_model_runner import PROMPT, make_runner


@dataclass
class _FakeExport:
    """cuda_ipc_backend.export's result, on CPU memory."""

    tensor: torch.Tensor
    handle: bytes = b"h" * 64
    offset: int = 0
    size: int = 0
    device_index: int = 0
    closed: list[bool] = field(default_factory=list)

    def close(self) -> None:
        self.closed.append(True)


def test_pack_synchronizes_the_device_after_its_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=gen), "b": torch.randn(7, generator=gen)}
    tensors["tied"] = tensors["a"]
    exports: list[_FakeExport] = []

    def export(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> _FakeExport:
        exp = _FakeExport(torch.full(shape, 255, dtype=torch.uint8), size=shape[0])
        exports.append(exp)
        return exp

    synced: list[tuple[torch.device, bool]] = []

    def synchronize(device: torch.device | None = None) -> None:
        views = shared_weights._views(exports[0].tensor, shared_weights._layout(tensors)[0])  # noqa: SLF001
        synced.append((device, all(torch.equal(views[n], t) for n, t in tensors.items())))

    monkeypatch.setattr(cuda_ipc_backend, "export", export)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    packed = shared_weights.pack(tensors, torch.device("cuda", 1), "src")
    assert synced == [(torch.device("cuda", 1), True)], "no explicit sync after the copies"
    assert packed.descriptor.region.backend == "cuda_ipc"


def test_device_scope_sets_the_cuda_device_and_is_a_no_op_on_cpu() -> None:
    scope = devices.device_scope(torch.device("cuda", 1))
    assert isinstance(scope, torch.cuda.device) and scope.idx == 1
    assert isinstance(devices.device_scope(torch.device("cpu")), contextlib.nullcontext)


def test_steps_run_inside_the_workers_device_scope_on_any_thread(
    hf_llama: HFModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner(hf_llama.path)
    inside: list[torch.device] = []
    forward_inside: list[bool] = []

    @contextlib.contextmanager
    def scope(device: torch.device) -> Iterator[None]:
        inside.append(device)
        try:
            yield
        finally:
            inside.pop()

    real_forward = runner.model.forward

    def forward(*args: object, **kw: object) -> torch.Tensor:
        forward_inside.append(inside == [runner.device])
        return real_forward(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(model_runner, "device_scope", scope)
    monkeypatch.setattr(runner.model, "forward", forward)
    seq = SequenceRequest(
        seq_id=1, token_ids=PROMPT, block_ids=[0, 1, 2], num_cached_tokens=0, sampling=SamplingParams()
    )
    t = threading.Thread(target=runner.step, args=([seq],))  # like a gRPC pool thread
    t.start()
    t.join()
    assert forward_inside == [True], "the forward ran outside the worker's device scope"


TORCH_CUDART = "/opt/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13"
MAPS = (
    "7f00-7f10 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    f"7f20-7f30 r-xp 00000000 08:01 456 {TORCH_CUDART}\n"
    f"7f30-7f40 r--p 00010000 08:01 456 {TORCH_CUDART}\n"
    "7f50-7f60 rw-p 00000000 00:00 0 \n"
)


def test_cudart_prefers_the_runtime_torch_loaded_then_torchs_major() -> None:
    assert cudart_fallback.candidates(MAPS, "13.0") == [
        TORCH_CUDART,
        "libcudart.so.13",
        "libcudart.so.12",
        "libcudart.so",
    ]
    assert cudart_fallback.candidates("", "12.8") == ["libcudart.so.12", "libcudart.so.13", "libcudart.so"]
    assert cudart_fallback.candidates("", None) == ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
