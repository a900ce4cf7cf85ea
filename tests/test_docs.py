"""The documentation stands on its own in a clone and stays current with the code."""

from __future__ import annotations

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
