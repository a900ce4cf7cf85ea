"""Generate the Python gRPC code from protos/ (the single source of truth).

`python tools/gen_protos.py` rewrites pagedkv/v1/*_pb2*.py(i);
`python tools/gen_protos.py --check` regenerates into a temporary directory and
fails when the committed files define something else, so CI catches a stale checkout.

The check compares what the protos define, not which generator wrote it: the lines that only stamp
the generator's version (``GRPC_GENERATED_VERSION``, ``# Protobuf Python Version``, the runtime
version check's arguments) are left out of the comparison, so a newer grpcio-tools than the pinned
one (constraints.txt) does not make unchanged protos "stale". Everything else must match byte for
byte.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_PKG = pathlib.Path("pagedkv") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def _plugins() -> dict[str, str]:
    """mypy-protobuf's protoc plugins, found next to this interpreter (a venv's bin/ need not be
    on PATH, e.g. under `make`) or else on PATH."""
    found = {}
    for name in ("protoc-gen-mypy", "protoc-gen-mypy_grpc"):
        beside = pathlib.Path(sys.executable).parent / name
        path = str(beside) if beside.exists() else shutil.which(name)
        if path is None:
            raise SystemExit(f"{name} not found: install mypy-protobuf (pip install -e '.[dev]')")
        found[name] = path
    return found


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    protos = sorted(PROTO_DIR.glob("pagedkv/v1/*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_DIR}")
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        *[f"--plugin={name}={path}" for name, path in _plugins().items()],
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *[str(p.relative_to(PROTO_DIR)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for p in (out_root / OUT_PKG).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


# What names the generator's or the runtime's version and nothing the protos define.
_VERSION_STAMPS = (
    re.compile(rb"^GRPC_GENERATED_VERSION = .*$", re.M),
    re.compile(rb"^# Protobuf Python Version: .*$", re.M),
    re.compile(rb"ValidateProtobufRuntimeVersion\((.*?)\n\)", re.S),
)


def definition(path: pathlib.Path) -> bytes:
    """``path``'s contents with its version stamps blanked: what two generator releases that agree
    on the protos write alike."""
    text = path.read_bytes()
    for stamp in _VERSION_STAMPS:
        text = stamp.sub(b"<version>", text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_root = pathlib.Path(tmp)
        (tmp_root / OUT_PKG).mkdir(parents=True)
        fresh = generate(tmp_root)
        target = ROOT / OUT_PKG
        committed = sorted(p for p in target.iterdir() if p.name.endswith(GENERATED_SUFFIXES))
        if args.check:
            stale = [
                p.name
                for p in fresh
                if not (target / p.name).exists() or definition(p) != definition(target / p.name)
            ]
            extra = sorted({p.name for p in committed} - {p.name for p in fresh})
            if stale or extra:
                print(f"generated gRPC code is stale: {stale + extra}; run `make protos`", file=sys.stderr)
                return 1
            print(f"generated gRPC code is fresh ({len(fresh)} files)")
            return 0
        for p in committed:
            p.unlink()
        for p in fresh:
            shutil.copy2(p, target / p.name)
        print(f"wrote {len(fresh)} files to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
