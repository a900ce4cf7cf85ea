"""The documentation stands on its own in a clone and stays current with the code."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess

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
