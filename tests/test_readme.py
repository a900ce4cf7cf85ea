"""The README's examples run as written (against a real server)."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

from block_manager_svc.server import start_server
from block_manager_svc.settings import BlockManagerSettings

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


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


def test_settings_table_lists_every_setting() -> None:
    text = README.read_text()
    for name in BlockManagerSettings.model_fields:
        assert f"PAGEDKV_{name.upper()}" in text, f"README does not document PAGEDKV_{name.upper()}"


def test_engine_python_example_runs(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")
    snippet = next(b for b in python_blocks() if "frontend.engine" in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "README.md", "exec"), {})  # noqa: S102 - our own documentation
    events = [line.split() for line in out.getvalue().splitlines()]
    assert len(events) == 16  # 2 samples x 8 tokens
    assert {e[1] for e in events} == {"0", "1"}
    assert sum(1 for e in events if e[3] == "length") == 2
