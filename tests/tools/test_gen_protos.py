"""tools/gen_protos.py --check: stale means the protos define something else, not that another
grpcio-tools release wrote the stubs."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATED = ROOT / "pagedkv" / "v1"


def _gen_protos():  # noqa: ANN202 - a module loaded from a path
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "tools" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gen():  # noqa: ANN201
    return _gen_protos()


def _copy(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    return pathlib.Path(shutil.copy(GENERATED / name, tmp_path / name))


def test_a_newer_generators_version_stamps_are_not_a_change(gen, tmp_path: pathlib.Path) -> None:
    grpc_file = _copy(tmp_path, "worker_pb2_grpc.py")
    text = grpc_file.read_text()
    assert "GRPC_GENERATED_VERSION = '" in text
    stamp = "GRPC_GENERATED_VERSION = "
    grpc_file.write_text(text.replace(f"{stamp}'1.85.1'", f"{stamp}'1.99.7'"))
    assert grpc_file.read_text() != (GENERATED / grpc_file.name).read_text()
    assert gen.definition(grpc_file) == gen.definition(GENERATED / grpc_file.name)

    pb2 = _copy(tmp_path, "worker_pb2.py")
    text = pb2.read_text()
    newer = text.replace("# Protobuf Python Version: 7.35.1", "# Protobuf Python Version: 7.40.0")
    newer = newer.replace("    7,\n    35,\n    1,\n", "    7,\n    40,\n    0,\n")
    assert newer != text
    pb2.write_text(newer)
    assert gen.definition(pb2) == gen.definition(GENERATED / pb2.name)


def test_a_changed_definition_is_stale(gen, tmp_path: pathlib.Path) -> None:
    pb2 = _copy(tmp_path, "worker_pb2.py")
    text = pb2.read_text()
    pb2.write_text(text.replace("_serialized_start=", "_serialized_start=1", 1))
    assert gen.definition(pb2) != gen.definition(GENERATED / pb2.name)
    stub = _copy(tmp_path, "worker_pb2.pyi")
    stub.write_text(stub.read_text().replace("decode_steps", "decode_step", 1))
    assert gen.definition(stub) != gen.definition(GENERATED / stub.name)


def test_the_generators_are_pinned() -> None:
    pins = {
        line.split("==")[0].strip(): line.split("==")[1].strip()
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.lstrip().startswith("#")
    }
    assert {"grpcio-tools", "mypy-protobuf", "ruff", "mypy"} <= pins.keys()
    makefile = (ROOT / "Makefile").read_text()
    assert "-c constraints.txt" in makefile
    # The committed stubs are the pinned generator's: its version stamp is the pin.
    stubs = (GENERATED / "worker_pb2_grpc.py").read_text()
    assert f"GRPC_GENERATED_VERSION = '{pins['grpcio-tools']}'" in stubs
