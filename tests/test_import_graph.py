"""No import circles among the product's modules.

A circle makes the order of imports matter, hides which module is the lower layer, and is how a
"pure" module ends up depending on the conductor that uses it. Every import that runs counts, at
module level and inside functions. Imports under ``if TYPE_CHECKING:`` are checked apart: a circle
that only the type checker sees is still two modules that each need the other to be understood, so
none may be added (``TYPE_ONLY_CIRCLES`` lists those that remain, each one to remove).

The graph is built from the source with ``ast`` (nothing is imported): one node per module, an
edge for each import of another product module (``from pkg import mod`` is an edge to ``pkg.mod``).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("block_manager_svc", "worker_svc", "kernels", "frontend", "pagedkv", "bench")
# Checkout folders imported as pagedkv's subpackages (pagedkv/kernels -> ../kernels, ...).
SUBPACKAGES = ("block_manager_svc", "worker_svc", "kernels", "frontend")


def module_name(path: pathlib.Path) -> str:
    """The name a file is imported by: ``kernels/cpu.py`` is ``pagedkv.kernels.cpu``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] in SUBPACKAGES:
        parts = ("pagedkv", *parts)
    return ".".join(parts).removesuffix(".__init__")


def product_modules() -> dict[str, pathlib.Path]:
    return {
        module_name(p): p
        for pkg in PACKAGES
        if (ROOT / pkg / "__init__.py").exists()
        for p in (ROOT / pkg).rglob("*.py")
    }


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """The product module an import of ``name`` loads last: itself, or its nearest package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, type_checking: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree``; those under ``if TYPE_CHECKING:`` only when asked."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            for child in node.orelse:
                walk(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            walk(child)

    walk(tree)
    return found


def imports_of(
    module: str, path: pathlib.Path, modules: dict[str, pathlib.Path], type_checking: bool = True
) -> set[str]:
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), type_checking):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            r = _resolve(t, modules)
            if r is not None and r != module:
                found.add(r)
    return found


def import_graph(type_checking: bool) -> dict[str, set[str]]:
    modules = product_modules()
    return {m: imports_of(m, p, modules, type_checking) for m, p in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


# Circles through ``if TYPE_CHECKING:`` imports that remain: a function typed with the class of the
# module that calls it. None may be added; remove an entry with its circle.
TYPE_ONLY_CIRCLES = [
    ["pagedkv.block_manager_svc.core.invariants", "pagedkv.block_manager_svc.core.manager"],
    ["pagedkv.worker_svc.model.config", "pagedkv.worker_svc.model.registry"],
    ["pagedkv.worker_svc.reattach", "pagedkv.worker_svc.server"],
]


def test_the_product_has_no_import_circles() -> None:
    graph = import_graph(type_checking=False)
    assert {
        "pagedkv.frontend.engine",
        "pagedkv.frontend.launch.supervisor",
        "pagedkv.block_manager_svc.core",
    } <= set(graph)
    assert circles(graph) == []


def test_no_new_circle_through_type_checking_imports() -> None:
    found = circles(import_graph(type_checking=True))
    assert [c for c in found if c not in TYPE_ONLY_CIRCLES] == []
    assert [c for c in TYPE_ONLY_CIRCLES if c not in found] == [], "a circle is gone: remove its entry"


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_circles_finds_what_it_should(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert circles(graph) == expected


def test_type_checking_and_function_imports_are_edges(tmp_path: pathlib.Path) -> None:
    """The scan sees an import inside a function always, and one under ``if TYPE_CHECKING:`` when
    asked (the circle between the supervisor and the process stack was of that kind)."""
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pagedkv.frontend.launch.processes import Stack\n"
        "def f():\n    from pagedkv.frontend.engine import dispatch\n"
    )
    path = tmp_path / "m.py"
    path.write_text(src)
    modules = product_modules()
    assert imports_of("pagedkv.frontend.launch.m", path, modules) == {
        "pagedkv.frontend.launch.processes",
        "pagedkv.frontend.engine.dispatch",
    }
    assert imports_of("pagedkv.frontend.launch.m", path, modules, type_checking=False) == {
        "pagedkv.frontend.engine.dispatch"
    }
