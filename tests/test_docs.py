"""The documentation stands on its own in a clone and stays current with the code."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUTSIDE = "../" + "shared/"  # the workspace folder a clone does not have


def tracked(*patterns: str) -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / p for p in out.stdout.split()]


def test_nothing_links_outside_the_project() -> None:
    offenders = [
        str(p.relative_to(ROOT))
        for p in tracked("*.md", "*.py", "*.toml", "*.yml", "Makefile")
        if p.exists() and OUTSIDE in p.read_text(errors="replace")
    ]
    assert offenders == []
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()


def test_architecture_table_names_modules_that_exist() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`" in line]
    paths = [p for line in rows for p in re.findall(r"`([a-z_]+/[a-z_/]*(?:\.py)?)`", line)]
    assert len(paths) >= 20
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert missing == []
    for decision in (
        "allocation",
        "prefix caching",
        "eviction",
        "preemption",
        "swap or recompute",
        "tenancy",
        "persistence",
        "events",
    ):
        assert f"| {decision} |" in text


def test_block_manager_settings_table_lists_every_setting() -> None:
    from pagedkv.block_manager_svc.settings import BlockManagerSettings

    text = (ROOT / "docs" / "block_manager.md").read_text()
    for name in BlockManagerSettings.model_fields:
        assert f"PAGEDKV_{name.upper()}" in text, (
            f"docs/block_manager.md does not document PAGEDKV_{name.upper()}"
        )


def test_worker_grpcurl_walkthrough_allocates_before_it_steps() -> None:
    text = (ROOT / "docs" / "worker.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S) if "Worker/Step" in b)
    assert (
        block.index("BlockManager/Allocate") < block.index("Worker/Step") < block.index("BlockManager/Free")
    )
    assert not re.search(r'"block_ids":\s*\[\d', block)  # block ids come from Allocate, never made up


# A module named in the table's last column is followed by the functions and classes the row
# means in it: `path.py` (`name`, `Class.method`, ...). Free text in the parentheses is allowed;
# only backticked identifiers are names.
_MODULE_WITH_NAMES = re.compile(r"`([a-z_][a-z_/]*\.py)`(?:\s*\(([^)]*)\))?")


def _defined_names(path: pathlib.Path) -> set[str]:
    """Top-level functions, classes and assignments of a module, and `Class.member` for each
    method or class attribute (by AST: nothing is imported)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{item.name}")
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(f"{node.name}.{item.target.id}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def architecture_table_names(text: str) -> list[tuple[str, str, list[str]]]:
    """(decision, module, names) for every module of every row of the table."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("decision", "---") or "`" not in cells[2]:
            continue
        for module, inside in _MODULE_WITH_NAMES.findall(cells[2]):
            out.append((cells[0], module, re.findall(r"`([A-Za-z_][\w.]*)`", inside or "")))
    return out


def missing_names(text: str) -> list[str]:
    """What the table names that the code does not define, and modules named with no name."""
    problems = []
    for decision, module, names in architecture_table_names(text):
        if not names:
            problems.append(f"{decision}: {module} names no function or class")
            continue
        defined = _defined_names(ROOT / module)
        problems += [f"{decision}: {module} does not define {n}" for n in names if n not in defined]
    return problems


def test_architecture_table_names_functions_its_modules_define() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = architecture_table_names(text)
    assert len({d for d, _, _ in rows}) >= 25 and len(rows) >= 50
    assert missing_names(text) == []
    # The check bites: a renamed function, or a module listed with no name, is reported.
    renamed = text.replace("(`BlockManager.allocate`", "(`BlockManager.allocate_renamed`", 1)
    assert missing_names(renamed) == [
        "allocation: block_manager_svc/core/manager.py does not define BlockManager.allocate_renamed"
    ]


# --- Every path and every call the prose names exists --------------------------------------------
# Prose goes stale silently: a module moves, a function is renamed, and a doc or a comment still
# sends the reader to it. The docs (README.md, docs/, bench/ghz/README.md) and the comments and
# docstrings of every Python file are scanned for a repository path ending in ``.py`` and for a call
# written as code (`name()`, `Class.method(args)`); each path must exist and each called name must be
# defined somewhere in the tree (Python, or the C kernels' sources).
TOP_DIRS = ("block_manager_svc", "worker_svc", "kernels", "frontend", "pagedkv", "bench", "tests", "tools")
PATH_IN_PROSE = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP_DIRS) + r")/(?:[\w.-]+/)*[\w-]+\.py)\b")
CALL_IN_PROSE = re.compile(r"`{1,2}((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)\([^`()]*\)`{1,2}")
# Calls of other projects' code that the prose names: by the module they are called on, or by name.
OTHER_PROJECTS = frozenset(
    {"torch", "transformers", "vllm", "triton", "tl", "grpc", "np", "numpy", "cupy", "openai"}
)
OTHER_PROJECTS_CALLS = {
    "allocate_slots": "vLLM's KVCacheManager (bench/core_bench.py drives it)",
    "GPUTarget": "Triton's compile target",
    "log2": "Triton's tl.log2",
    "cat": "torch.cat",
    "copy_": "torch.Tensor.copy_",
}


def _prose_files() -> tuple[list[pathlib.Path], list[pathlib.Path]]:
    files = [p for p in tracked("*.md", "*.py") if p.exists() and "pagedkv/v1/" not in p.as_posix()]
    return [p for p in files if p.suffix == ".md"], [p for p in files if p.suffix == ".py"]


def _prose_of_python(path: pathlib.Path) -> list[tuple[int, str]]:
    """The comments and docstrings (triple-quoted strings) of a Python file, with their lines."""
    import io
    import tokenize

    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.COMMENT or (
            tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU").startswith(('"""', "'''"))
        ):
            out.append((tok.start[0], tok.string))
    return out


def _names_defined_in_the_tree(py_files: list[pathlib.Path]) -> set[str]:
    """Functions, classes and parameters (a callable parameter such as ``on_restart()``) of every
    Python file, the C kernels' functions, Python's builtins."""
    import builtins

    names = set(dir(builtins))
    for path in py_files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    for c in (ROOT / "kernels" / "cpu" / "csrc").glob("*.[ch]"):
        names.update(re.findall(r"^\w[\w\s*]*?\b(\w+)\(", c.read_text(), flags=re.M))
    return names


def stale_references(texts: list[tuple[str, str]], defined: set[str]) -> list[str]:
    """``where: what`` for each path that does not exist and each call of an undefined name."""
    problems = []
    for where, text in texts:
        problems += [f"{where}: {p}" for p in PATH_IN_PROSE.findall(text) if not (ROOT / p).exists()]
        for call in CALL_IN_PROSE.findall(text):
            parts = call.split(".")
            if parts[0] in OTHER_PROJECTS or (len(parts) > 1 and parts[0] in sys.stdlib_module_names):
                continue
            if parts[-1] not in defined and parts[-1] not in OTHER_PROJECTS_CALLS:
                problems.append(f"{where}: {call}()")
    return problems


def test_every_path_and_call_the_docs_and_comments_name_exists() -> None:
    md, py = _prose_files()
    texts = [
        (f"{p.relative_to(ROOT)}:{i}", line)
        for p in md
        for i, line in enumerate(p.read_text().splitlines(), 1)
    ]
    texts += [(f"{p.relative_to(ROOT)}:{i}", s) for p in py for i, s in _prose_of_python(p)]
    assert len(md) >= 15 and len(py) >= 200
    defined = _names_defined_in_the_tree(py)
    assert stale_references(texts, defined) == []
    # The check bites: a moved module, a renamed function (also in a comment), a C function.
    assert stale_references(
        [
            ("a", "see frontend/serve.py"),
            ("b", "# ``Engine.step_renamed()``"),
            ("c", "`pagedkv_cpu_level()`"),
        ],
        defined,
    ) == ["a: frontend/serve.py", "b: Engine.step_renamed()"]
