"""docs/settings.md is what the settings classes say (tools/gen_settings_doc.py), and the check
notices when it is not."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from pagedkv.settings_cli import env_var, flag
from pagedkv.settings_doc import markdown
from pagedkv.settings_file import SECTIONS, has_flag
from pagedkv.settings_roles import settings_class

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "settings.md"


def _tool():  # noqa: ANN202 - a module loaded from a path
    spec = importlib.util.spec_from_file_location("gen_settings_doc", ROOT / "tools" / "gen_settings_doc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_is_fresh() -> None:
    assert DOC.read_text() == markdown(), "docs/settings.md is stale: run python tools/gen_settings_doc.py"


def test_the_reference_lists_every_setting_of_every_command() -> None:
    text = DOC.read_text()
    for section in SECTIONS:
        assert f"Settings file section: `[{section}]`" in text
        for name, field in settings_class(section).model_fields.items():
            assert f"`{env_var(name)}`" in text, name
            if has_flag(field):
                assert flag(name)[2:] in text, name


def test_the_check_fails_on_a_stale_reference(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tool = _tool()
    assert tool.main(["--check"]) == 0
    stale = tmp_path / "settings.md"
    stale.write_text(markdown().replace("tokens per KV block", "tokens per block, once"))
    monkeypatch.setattr(tool, "DOC", stale)
    assert tool.main(["--check"]) == 1
    assert tool.main([]) == 0 and tool.main(["--check"]) == 0  # written afresh
