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
import io
import pathlib
import re
import subprocess
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("block_manager_svc", "worker_svc", "kernels", "frontend", "pagedkv", "bench")
# Checkout folders imported as pagedkv's subpackages (pagedkv/kernels -> ../kernels, ...).
SUBPACKAGES = ("block_manager_svc", "worker_svc", "kernels", "frontend")


def module_name(path: pathlib.Path) -> str:
    """The name a file is imported by: ``kernels/cpu/attention.py`` is ``pagedkv.kernels.cpu.attention``."""
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


# --- One installed name ---------------------------------------------------------------------------
# The product installs one top-level name, `pagedkv`; the folders above are its subpackages. A file
# that still imported `kernels` (or named `frontend.engine` in an import_module, `-m` or patch
# target) would, inside the checkout, load a second copy of the module under another name (two
# registries, two sets of globals), and outside it fail or, for `kernels`, get Hugging Face's
# package. Every tracked text file is read: code, tests, benchmarks, tools, docs, configs.
_OLD = "|".join(SUBPACKAGES)
# `from kernels import x`, `import kernels` (not `from pagedkv import kernels`), and a dotted name
# whose first two parts are an old name and one of its modules (`kernels.aot`, `frontend.engine`).
OLD_IMPORT = re.compile(r"(?<![\w./-])(?:from|import)\s+(?:" + _OLD + r")\b(?!\.\w)")
OLD_DOTTED = re.compile(r"(?<![\w./-])(" + _OLD + r")\.([A-Za-z_]\w*)")
FROM_PART = re.compile(r"\bfrom\s+[\w.]+\s+$")


def _is_module(pkg: str, child: str) -> bool:
    base = ROOT / pkg / child
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() or child.startswith("_cpu_")


def old_name_uses(text: str) -> list[str]:
    """Each import of an old top-level name, and each dotted module name under one, in ``text``."""
    found = [
        m.group(0)
        for m in OLD_IMPORT.finditer(text)
        if not (m.group(0).startswith("import") and FROM_PART.search(text, 0, m.start()))
    ]
    found += [m.group(0) for m in OLD_DOTTED.finditer(text) if _is_module(m.group(1), m.group(2))]
    return found


def _tracked_text_files() -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = []
    for name in out.stdout.split():
        path = ROOT / name
        if name.startswith("pagedkv/v1/") or path.is_symlink() or not path.is_file():
            continue
        try:
            path.read_text()
        except UnicodeDecodeError:
            continue  # binary (the state files of tests/block_manager_svc/data)
        files.append(path)
    return files


def old_names_in_python(source: str) -> list[tuple[int, str]]:
    """(line, use) for each import statement of an old top-level name and each old module name in a
    string or comment (an import_module or ``-m`` target, a patch target, a docstring); code that
    reads an attribute of a module bound as ``kernels`` (``kernels.reference.f()``) is not one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, f"import {n}") for n in names if n.split(".")[0] in SUBPACKAGES]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            found += [(tok.start[0], use) for use in old_name_uses(tok.string)]
    return found


# Files that name an old top-level name on purpose, each with its reason.
OLD_NAMES_ALLOWED = {
    "tests/test_import_graph.py": "this scan's own examples",
    "tests/test_installed_name.py": "imports Hugging Face's `kernels` beside pagedkv.kernels",
}


def test_nothing_names_a_module_by_its_old_top_level_name() -> None:
    files = [p for p in _tracked_text_files() if str(p.relative_to(ROOT)) not in OLD_NAMES_ALLOWED]
    assert len(files) >= 400
    offenders = []
    for p in files:
        text = p.read_text()
        if p.suffix == ".py":
            uses = old_names_in_python(text)
        else:
            uses = [(i, use) for i, line in enumerate(text.splitlines(), 1) for use in old_name_uses(line)]
        offenders += [f"{p.relative_to(ROOT)}:{i}: {use}" for i, use in uses]
    assert offenders == []


def test_the_old_name_scan_bites() -> None:
    """Imports, module paths in strings and commands are found; file paths, the folders' names as
    words and attributes of a bound name are not."""
    assert old_name_uses("import kernels") == ["import kernels"]
    assert old_name_uses("from frontend.engine import Engine") == ["frontend.engine"]
    assert old_name_uses("from worker_svc import cli") == ["from worker_svc"]
    assert old_name_uses('import_module("kernels.triton_backend")') == ["kernels.triton_backend"]
    assert old_name_uses("python -m kernels.aot --jobs 2") == ["kernels.aot"]
    assert old_name_uses('"block_manager_svc.server:main"') == ["block_manager_svc.server"]
    assert old_name_uses('find_spec(f"kernels._cpu_{variant}")') == ["kernels._cpu_"]
    for fine in (
        "from pagedkv import kernels",
        "from pagedkv.frontend.engine import Engine",
        "python -m pagedkv.kernels.aot",
        "see kernels/cpu/attention.py and docs/kernels.md",
        "kernels.use_backend('cpu')",  # an attribute of the module bound as `kernels`
        'frontend.args[frontend.args.index("--block-manager") + 1]',
        "the frontend.",
    ):
        assert old_name_uses(fine) == [], fine
    source = (
        "import kernels.cpu\n"
        "from pagedkv import kernels\n"
        "kernels.reference.f()  # was kernels.reference\n"
        'patch("worker_svc.model_runner.sample")\n'
    )
    assert old_names_in_python(source) == [
        (1, "import kernels.cpu"),
        (3, "kernels.reference"),
        (4, "worker_svc.model_runner"),
    ]
