"""The environment-variable registry (pagedkv/envs.py) is the only way the code reads the
environment, every variable the code names is declared, and docs/usage.md's table is the registry."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv import envs
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.frontend.serve.settings import ServeSettings
from pagedkv.worker_svc.settings import CacheHostSettings, WorkerSettings
from tests.pagedkv.source_scan import code_lines

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("block_manager_svc", "worker_svc", "kernels", "frontend", "pagedkv")
# Reading the environment any other way than through pagedkv.envs (passing the whole environment on
# to a child process, ``{**os.environ, ...}`` or ``dict(os.environ)``, is not reading a variable).
DIRECT_READ = re.compile(r"os\.environ(?!\s*[,)}])|\bgetenv\(|\benviron\.get\(|\benviron\[")
# A variable named in code: the project's, and the third-party ones pagedkv reads or sets.
NAMED = re.compile(
    r"\b(PAGEDKV_[A-Z0-9_]*[A-Z0-9]|TRITON_[A-Z_]+|HF_HUB_[A-Z_]+|KMP_[A-Z_]+|OMP_[A-Z_]+|LD_PRELOAD)\b"
)
SETTINGS = (BlockManagerSettings, CacheHostSettings, WorkerSettings, ServeSettings)


def _sources() -> list[Path]:
    out = [ROOT / "setup.py"]
    for pkg in PACKAGES:
        out += [p for p in sorted((ROOT / pkg).rglob("*.py")) if "v1" not in p.relative_to(ROOT).parts]
    return out


def test_code_reads_the_environment_only_through_the_registry() -> None:
    allowed = {"pagedkv/envs.py", "setup.py"}  # setup.py runs before the package is importable
    bad = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in _sources()
        if p.relative_to(ROOT).as_posix() not in allowed
        for n, line in code_lines(p)
        if DIRECT_READ.search(line)
    ]
    assert not bad, "read these through pagedkv.envs:\n" + "\n".join(bad)


def test_every_variable_the_code_names_is_declared() -> None:
    settings = {f"PAGEDKV_{name.upper()}" for cls in SETTINGS for name in cls.model_fields}
    named = {
        (m.group(1), f"{p.relative_to(ROOT)}:{n}")
        for p in _sources()
        if p.name != "envs.py" or p.parent.name != "pagedkv"  # the declarations themselves
        for n, line in code_lines(p)
        for m in NAMED.finditer(line)
    }
    undeclared = sorted(
        f"{where}: {name}" for name, where in named if name not in envs.REGISTRY | dict.fromkeys(settings)
    )
    assert not undeclared, "declare these in pagedkv/envs.py:\n" + "\n".join(undeclared)
    # The registry declares nothing the code no longer uses (settings-backed names excepted).
    used = {name for name, _ in named}
    assert set(envs.REGISTRY) <= used, set(envs.REGISTRY) - used


def test_the_scans_see_a_direct_read_and_an_undeclared_name() -> None:
    """The two scans above can fail."""
    assert DIRECT_READ.search('x = os.environ.get("PAGEDKV_FOO", "")')
    assert DIRECT_READ.search('if "X" in os.environ:')
    assert DIRECT_READ.search('os.getenv("X")')
    assert not DIRECT_READ.search("env = {**os.environ, **extra}")
    assert not DIRECT_READ.search("env = dict(os.environ)")
    assert [m.group(1) for m in NAMED.finditer('envs.get_str("PAGEDKV_FOO")')] == ["PAGEDKV_FOO"]


def test_the_documented_table_is_the_registry() -> None:
    doc = (ROOT / "docs" / "usage.md").read_text()
    table = envs.markdown()
    assert table in doc, "regenerate docs/usage.md's table: python -m pagedkv.envs --markdown"
    out = subprocess.run(
        [sys.executable, "-m", "pagedkv.envs", "--markdown"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == table


def test_values_parse_as_declared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDKV_KERNEL_BACKEND", raising=False)
    assert envs.get_str("PAGEDKV_KERNEL_BACKEND") == "auto"  # the declared default
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", " Triton ")
    assert envs.get_str("PAGEDKV_KERNEL_BACKEND") == "Triton"
    for value, expected in [
        ("1", True),
        ("TRUE", True),
        ("on", True),
        ("0", False),
        ("", False),
        ("no", False),
    ]:
        monkeypatch.setenv("PAGEDKV_ALLOW_INSECURE", value)
        assert envs.get_bool("PAGEDKV_ALLOW_INSECURE") is expected
    assert envs.get_str("LD_PRELOAD", {"LD_PRELOAD": "/x.so"}) == "/x.so"  # a given mapping, not os.environ
    with pytest.raises(KeyError, match="PAGEDKV_NOPE is not declared"):
        envs.get_str("PAGEDKV_NOPE")
    with pytest.raises(TypeError):
        envs.get_bool("PAGEDKV_TOKEN")


def test_set_default_keeps_an_explicit_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    envs.set_default("HF_HUB_OFFLINE", "1")
    assert envs.get_str("HF_HUB_OFFLINE") == "0"
    monkeypatch.delenv("HF_HUB_OFFLINE")
    envs.set_default("HF_HUB_OFFLINE", "1")
    assert envs.is_set("HF_HUB_OFFLINE") and envs.get_bool("HF_HUB_OFFLINE")


def test_listing_never_prints_a_value(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PAGEDKV_TOKEN", "s3cret-token")
    assert envs.main([]) == 0
    out = capsys.readouterr().out
    assert "PAGEDKV_TOKEN: set" in out and "s3cret" not in out
