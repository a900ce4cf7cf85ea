"""What bench/gpu_check.sh's sections import, found by reading and importing, not by a hand list.

    python -s -m bench.gpu.imports [--gpu] [--section NAME ...]   # exit 1 naming every module that fails
    python -m bench.gpu.imports --distributions                  # the wheelhouse's list, from this venv

Why: the GPU image lacks the services' dependencies; they come from an offline wheelhouse
(tools/gpu_wheels.sh), and a module missing from it fails a section minutes into a borrowed run.
A hand-kept list went stale (google.rpc, grpc_status, safetensors were missing from it). So each
section names only what it runs (ENTRIES: its ``python -m`` targets, its test modules, the role
modules its subprocesses start); from those files the project's own imports are followed,
module-level and inside functions, and every outside module they import is collected with the
file that imports it. Imports in a ``try`` that catches ImportError and ``if TYPE_CHECKING`` blocks
are optional and left out. Then each collected module is imported, in this interpreter: run it in
the image's interpreter with the wheelhouse on PYTHONPATH (gpu_check.sh's preflight does), and a
missing wheel, a broken import or a new dependency fails here, naming the section and the file.

``--distributions`` maps the collected modules to the installed distributions that provide them
(this venv's versions), minus the image's own (IMAGE_PROVIDES): tools/gpu_wheels.sh downloads those.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.metadata import distribution, packages_distributions, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The project's top-level import names: the product is all under `pagedkv`.
PROJECT = ("pagedkv", "bench", "tests")
# Checkout folders that are pagedkv's subpackages through its symlinks (pagedkv/kernels -> ../kernels).
SUBPACKAGES = ("block_manager_svc", "worker_svc", "kernels", "frontend")
# What every section runs: modules started with `python -m`, test modules, role modules started as
# subprocesses (`pagedkv.cli` resolves the role to pagedkv.worker_svc.cli /
# pagedkv.block_manager_svc.server), and the pytest plugins the check loads. Paths are relative to
# the checkout.
ENTRIES: dict[str, tuple[str, ...]] = {
    "preflight": ("bench/gpu/preflight.py", "pytest", "xdist", "pytest_timeout"),
    "pytest": (
        "pytest",
        "xdist",
        "pytest_timeout",
        "tests/conftest.py",
        "tests/kernels/*.py",
        "tests/worker_svc/model/test_cuda_graphs.py",
    ),
    "ipc": ("pytest", "tests/conftest.py", "tests/worker_svc/cache/test_memory.py"),
    "bench": ("bench/kernel_bench.py",),
    "worker": ("bench/gpu/worker_check.py", "pagedkv/cli.py", "worker_svc/cli.py"),
    "graphs": ("bench/cuda_graph_bench.py",),
    "pd": (
        "bench/gpu/pd_check.py",
        "bench/pd_bench.py",
        "pagedkv/cli.py",
        "worker_svc/cli.py",
        "block_manager_svc/server.py",
        "frontend/launch/processes.py",
    ),
    "mps": ("bench/gpu/mps.py",),
}
# Outside modules that the project imports only for inputs no section gives, left out of the
# wheelhouse (each would pull in tens of MB): module -> why.
NOT_USED = {
    "transformers": "tokenizers only (a --tokenizer directory or a GGUF vocabulary): no section tokenizes",
    "gguf": "--model FILE.gguf only: every section writes its own safetensors checkpoint",
}
# Outside modules only the GPU image has (CUDA builds): imported only with --gpu.
GPU_ONLY = ("cupy",)
# Distributions the image brings itself (never downloaded into the wheelhouse: its own builds match
# its CUDA). grpcio and protobuf are in the image too, but older than pagedkv/v1 needs: downloaded.
IMAGE_PROVIDES = ("torch", "triton", "numpy", "cupy")
OPTIONAL_HANDLERS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


@dataclass(slots=True)
class Needed:
    """An outside module, the sections that need it and one file that imports it."""

    module: str
    sections: set[str] = field(default_factory=set)
    where: str = ""


def _module_file(name: str) -> Path | None:
    """The checkout's file for a project module name (a package's __init__.py), if it has one."""
    base = ROOT.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _in_package(path: Path) -> Path:
    """``path`` as reached through pagedkv/ (``worker_svc/cli.py`` is ``pagedkv/worker_svc/cli.py``):
    one path, and one module name, per file."""
    rel = path.relative_to(ROOT)
    return ROOT / "pagedkv" / rel if rel.parts[0] in SUBPACKAGES else path


def _module_name(path: Path) -> str:
    rel = _in_package(path).relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _optional(node: ast.Try) -> bool:
    for h in node.handlers:
        if h.type is None:
            return True
        names = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
        if any(isinstance(n, ast.Name) and n.id in OPTIONAL_HANDLERS for n in names):
            return True
    return False


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> Iterable[str]:
    """Every module the file imports unconditionally (at any depth), as absolute dotted names."""
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]

    def walk(node: ast.AST) -> Iterable[str]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Try) and _optional(child):
                for part in (child.orelse, child.finalbody):
                    for stmt in part:
                        yield from walk_stmt(stmt)
                continue
            if isinstance(child, ast.If) and _type_checking(child):
                for stmt in child.orelse:
                    yield from walk_stmt(stmt)
                continue
            yield from walk_stmt(child)

    def walk_stmt(node: ast.AST) -> Iterable[str]:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join([*parts, base] if base else parts)
            for a in node.names:
                yield f"{base}.{a.name}" if a.name != "*" else base
            yield base
        else:
            yield from walk(node)

    yield from walk(ast.parse(path.read_text(), str(path)))


def _expand(section: str, entry: str) -> list[Path | str]:
    """An entry's files (a path or glob in the checkout), or the outside module it names. A path
    that matches nothing is an error: a file moved without updating ENTRIES would drop its imports."""
    if "/" in entry or entry.endswith(".py"):
        found: list[Path | str] = [_in_package(p) for p in sorted(ROOT.glob(entry))]
        if not found:
            raise FileNotFoundError(f"the {section} section's entry {entry} matches no file")
        return found
    return [entry]


def collect(sections: Iterable[str] | None = None) -> dict[str, Needed]:
    """Outside module -> Needed, for the sections named (default: all)."""
    needed: dict[str, Needed] = {}
    stdlib = sys.stdlib_module_names
    for section in sections or ENTRIES:
        seen: set[Path] = set()
        todo: list[tuple[Path | str, str]] = [
            (e, f"{section} section") for x in ENTRIES[section] for e in _expand(section, x)
        ]
        while todo:
            item, by = todo.pop()
            if isinstance(item, str):
                needed.setdefault(item, Needed(item, where=by)).sections.add(section)
                continue
            if item in seen:
                continue
            seen.add(item)
            rel = item.relative_to(ROOT).as_posix()
            for name in _imports(item):
                top = name.split(".")[0]
                if top in stdlib or top == "__future__" or not top:
                    continue
                if top in PROJECT:
                    # the module itself and its parent packages run on import
                    parts = name.split(".")
                    for i in range(1, len(parts) + 1):
                        f = _module_file(".".join(parts[:i]))
                        if f is not None:
                            todo.append((f, rel))
                    continue
                if top not in NOT_USED:
                    needed.setdefault(name, Needed(name, where=rel)).sections.add(section)
    return needed


def _importable_name(name: str) -> str:
    """``name`` if it is a module, else its parent (``from grpc import aio`` vs a class name)."""
    try:
        if importlib.util.find_spec(name) is not None:
            return name
    except (ImportError, ValueError, AttributeError):
        pass
    parent = name.rpartition(".")[0]
    if not parent:
        return name
    try:
        if importlib.util.find_spec(parent) is None:
            return name
    except (ImportError, ValueError, AttributeError):
        return name
    return parent


def modules(sections: Iterable[str] | None = None) -> set[str]:
    """The distinct modules ``check`` imports (``from a import b``: ``a.b`` when a module, else ``a``)."""
    return {_importable_name(m) for m in collect(sections)}


def check(sections: Iterable[str] | None, gpu: bool) -> list[str]:
    """Import every collected module; one line per missing (or broken) module, naming the sections
    that need it (all of theirs that reach it) and one file that imports it."""
    failed: dict[str, tuple[str, set[str], str]] = {}  # missing module -> (error, sections, where)
    done: set[str] = set()
    for name, need in sorted(collect(sections).items()):
        if name.split(".")[0] in GPU_ONLY and not gpu:
            continue
        mod = _importable_name(name)
        if mod in done:
            continue
        done.add(mod)
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 - report every failure, not the first
            # the module really missing (google.rpc for google.rpc.status_pb2), else the package
            key = e.name if isinstance(e, ModuleNotFoundError) and e.name else mod.split(".")[0]
            error, secs, where = failed.setdefault(key, (f"{type(e).__name__}: {e}", set(), need.where))
            secs.update(need.sections)
    return [
        f"MISSING {key} (needed by {', '.join(sorted(secs))}; imported in {where}): {error}"
        for key, (error, secs, where) in sorted(failed.items())
    ]


def _providers(name: str, candidates: list[str]) -> list[str]:
    """Of the distributions installing top-level ``name.split('.')[0]``, those holding ``name`` itself
    (``google`` is shared: google.protobuf is protobuf's, google.rpc googleapis-common-protos')."""
    want = name.split(".")
    hits = []
    for dist in candidates:
        for f in distribution(dist).files or []:
            parts = Path(str(f)).with_suffix("").parts
            if tuple(parts[: len(want)]) == tuple(want) or tuple(want[: len(parts)]) == tuple(parts):
                hits.append(dist)
                break
    return hits or candidates


def distributions(sections: Iterable[str] | None = None) -> dict[str, str]:
    """Distribution -> this venv's version, for every outside module, minus the image's own."""
    by_top = packages_distributions()
    out: dict[str, str] = {}
    for name in collect(sections):
        mod = _importable_name(name)
        for dist in _providers(mod, by_top.get(mod.split(".")[0], [])):
            if not any(dist.lower().startswith(p) for p in IMAGE_PROVIDES):
                out[dist] = version(dist)
    return dict(sorted(out.items(), key=lambda kv: kv[0].lower()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="also the GPU image's own CUDA modules (cupy)")
    ap.add_argument("--section", action="append", choices=sorted(ENTRIES), help="default: every section")
    ap.add_argument("--distributions", action="store_true", help="print dist==version lines and exit")
    args = ap.parse_args(argv)
    if args.distributions:
        for dist, ver in distributions(args.section).items():
            print(f"{dist}=={ver}")
        return 0
    failures = check(args.section, args.gpu)
    for line in failures:
        print(line)
    for name in ("google.protobuf", "grpc"):
        mod = sys.modules.get(name)
        if mod is not None:
            print(f"{name} {getattr(mod, '__version__', '?')} from {getattr(mod, '__file__', '?')}")
    n = len(modules(args.section))
    if failures:
        print(f"{len(failures)} of {n} imports failed")
        return 1
    print(f"all {n} imports ok (python {sys.version.split()[0]} at {sys.executable})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
