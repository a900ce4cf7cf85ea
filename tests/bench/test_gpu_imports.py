"""bench.gpu.imports: what gpu_check.sh's sections import is found by reading and importing.

The hand-kept list it replaces lacked google.rpc, grpc_status and safetensors (errors.py, the
services, the checkpoints) and the wheelhouse lacked their distributions: the worker and pd
sections, and an interpreter holding only the image and that wheelhouse, failed on them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bench.gpu import image_venv, imports

ROOT = Path(__file__).resolve().parents[2]


def test_the_modules_the_old_list_missed_are_found_with_the_sections_that_need_them() -> None:
    needed = imports.collect()
    for mod, sections in (
        ("google.rpc.status_pb2", {"worker", "pd"}),
        ("grpc_status.rpc_status", {"worker", "pd"}),
        ("safetensors", {"worker", "pd", "graphs"}),
        # the kernel tests reach structlog through pagedkv.kernels.cpu.native
        ("structlog", {"pytest", "worker", "pd"}),
        ("xdist", {"pytest", "preflight"}),
    ):
        assert mod in needed, mod
        assert needed[mod].sections >= sections, (mod, needed[mod].sections)
    # `where` names a file that imports it (the first the walk meets)
    where = needed["google.rpc.status_pb2"].where
    assert "status_pb2" in (ROOT / where).read_text(), where
    # the image's own are found too (and checked), but are never downloaded
    assert "torch" in needed
    # inputs no section gives are left out; cupy (the image's own) is checked only with --gpu
    assert not [m for m in needed if m.split(".")[0] in ("transformers", "gguf")]
    assert "cupy" in imports.GPU_ONLY


def test_an_entry_that_matches_no_file_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(imports.ENTRIES, "pd", ("frontend/stack.py",))  # moved to frontend/launch/
    with pytest.raises(FileNotFoundError, match="the pd section's entry frontend/stack.py matches no file"):
        imports.collect(["pd"])


def test_the_wheelhouse_list_holds_every_outside_distribution_and_none_of_the_images() -> None:
    dists = {d.lower().replace("_", "-") for d in imports.distributions()}
    assert dists >= {
        "grpcio",
        "protobuf",
        "grpcio-status",
        "googleapis-common-protos",
        "safetensors",
        "structlog",
        "pydantic-settings",
        "pytest",
        "pytest-xdist",
        "pytest-timeout",
    }, dists
    assert not dists & {"torch", "triton", "numpy", "cupy-cuda13x", "cupy-cuda12x"}


@pytest.fixture(scope="module")
def bare_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return image_venv.build(
        tmp_path_factory.mktemp("image") / "venv", ["torch", "triton", "numpy", "grpcio", "protobuf"]
    )


def test_an_image_without_the_wheelhouse_names_every_missing_module(bare_image: Path) -> None:
    """The independent check: an interpreter with torch, triton, numpy, grpcio and protobuf only."""
    proc = subprocess.run(
        [str(bare_image), "-s", "-m", "bench.gpu.imports", "--section", "worker", "--section", "pd"],
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "HOME": "/tmp"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    missing = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("MISSING ")}
    assert missing >= {
        "google.rpc",
        "grpc_status",
        "safetensors",
        "structlog",
        "pydantic_settings",
    }, proc.stdout
    assert "MISSING torch" not in proc.stdout and "MISSING grpc " not in proc.stdout
