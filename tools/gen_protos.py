"""Generate the Python gRPC code from protos/ (the single source of truth).

`python tools/gen_protos.py` rewrites pagedkv/v1/*_pb2*.py(i);
`python tools/gen_protos.py --check` regenerates into a temporary directory and
fails when the committed files differ, so CI catches a stale checkout.
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
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
                if not (target / p.name).exists() or not filecmp.cmp(p, target / p.name, shallow=False)
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
