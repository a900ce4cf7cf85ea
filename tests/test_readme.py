"""The README: its examples run as written (against a real server), it stays short, and it says
where each document is."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

from pagedkv.block_manager_svc.server import start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_block_manager_python_example_runs_and_prints_what_it_claims() -> None:
    snippet = next(b for b in python_blocks() if "BlockManagerStub" in b)
    running = start_server(BlockManagerSettings(port=0, num_gpu_blocks=64))
    try:
        code = snippet.replace("127.0.0.1:50051", f"127.0.0.1:{running.port}")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {})  # noqa: S102 - our own documentation
    finally:
        running.stop(0)
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["0", "32"]  # no hit before Commit, the full blocks after it
    assert re.fullmatch(r"\[\(\d+, \d+\)\]", lines[2])
    assert lines[3] == "StatusCode.NOT_FOUND sequence 'nope' does not exist"


def test_readme_is_short_and_links_every_document() -> None:
    """A user's entry point (under 250 lines) that names every document in docs/, each link real."""
    text = README.read_text()
    assert len(text.splitlines()) < 250
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]+)?\)", text))
    assert all((ROOT / p).exists() for p in linked), linked
    assert {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} <= linked
    for command in ("make demo", "make test"):  # the two set-up commands, and the Makefile has them
        assert command in text and f"\n{command.split()[1]}:" in (ROOT / "Makefile").read_text()


def test_engine_python_example_runs(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")
    snippet = next(b for b in python_blocks() if "pagedkv.frontend.engine" in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "README.md", "exec"), {})  # noqa: S102 - our own documentation
    events = [line.split() for line in out.getvalue().splitlines()]
    assert len(events) == 16  # 2 samples x 8 tokens
    assert {e[1] for e in events} == {"0", "1"}
    assert sum(1 for e in events if e[3] == "length") == 2
