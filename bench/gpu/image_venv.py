"""An interpreter holding what the GPU image holds and nothing else: the rehearsal's interpreter.

    python -m bench.gpu.image_venv DIR      # DIR/bin/python: pip, torch, triton, numpy + their own deps

Why: a rehearsal run by the project's own venv imports everything the project installs, so a
module the image lacks (structlog, google.rpc, safetensors, ...) never fails there and the first
GPU run finds it. The GPU image has python, pip, torch, triton, numpy (and cupy, grpcio, protobuf,
pytest, which the wheelhouse brings anyway: leaving them out is stricter, not looser). This makes a
venv of the running interpreter's base and links in exactly the distributions named (default
pip, torch, triton, numpy) and their non-optional requirements, taken from this interpreter's
site-packages: seconds, no download. The project itself is not installed: the check puts the
checkout on PYTHONPATH, as on the GPU machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import Distribution, PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

IMAGE = ("pip", "torch", "triton", "numpy")


def closure(names: tuple[str, ...] | list[str]) -> dict[str, Distribution]:
    """The distributions named and everything they require (no extras), installed here."""
    found: dict[str, Distribution] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue  # a requirement for another platform or python, not installed here
        found[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def entries(dist: Distribution) -> set[Path]:
    """The site-packages entries a distribution installed (packages, modules, its dist-info). Inside
    a namespace package (a directory without __init__.py, e.g. google/) only this distribution's
    own subpackages: google/protobuf is protobuf's, google/rpc is googleapis-common-protos'."""
    root = Path(str(dist.locate_file("")))
    out: set[Path] = set()
    for f in dist.files or []:
        parts = Path(str(f)).parts
        if parts[0] == ".." or parts[0] == "__pycache__" or parts[0].endswith(".pth"):
            continue
        depth = 1
        special = parts[0].endswith((".dist-info", ".libs", ".data"))
        while not special and len(parts) > depth + 1:
            here = root.joinpath(*parts[:depth])
            if not here.is_dir() or (here / "__init__.py").exists():
                break
            depth += 1
        out.add(Path(*parts[:depth]))
    return out


def build(target: Path, names: tuple[str, ...] | list[str] = IMAGE) -> Path:
    """Create the venv at ``target`` and return its python."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--clear", "--without-pip", str(target)], check=True)
    site = next((target / "lib").glob("python3*/site-packages"))
    linked = target / "image-packages"
    linked.mkdir()
    dists = closure(names)
    for dist in dists.values():
        src_root = Path(str(dist.locate_file("")))
        for entry in entries(dist):
            src, dst = src_root / entry, linked / entry
            if src.exists() and not dst.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.symlink_to(src)
    (site / "image.pth").write_text(f"{linked}\n")
    (target / "image-distributions.txt").write_text(
        "".join(f"{n}=={d.version}\n" for n, d in sorted(dists.items()))
    )
    return target / "bin" / "python"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path)
    ap.add_argument("--dist", action="append", help=f"a distribution to link (default: {', '.join(IMAGE)})")
    args = ap.parse_args(argv)
    py = build(args.target, tuple(args.dist or IMAGE))
    print(py)
    print((args.target / "image-distributions.txt").read_text(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
