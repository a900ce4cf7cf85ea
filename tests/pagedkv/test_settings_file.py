"""Each role's `--config FILE` (pagedkv/settings_file.py, pagedkv/settings_cli.py): the command reads
its own section, a flag wins over the file and the file over the PAGEDKV_* variable, and a bad
section, key or value is refused (exit 2) naming the file, the section and the key."""

from __future__ import annotations

import pathlib

import pytest

from pagedkv import settings_cli
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.block_manager_svc.settings import load_settings as load_block_manager
from pagedkv.frontend.serve.settings import ServeSettings
from pagedkv.frontend.serve.settings import load_settings as load_serve
from pagedkv.settings_file import SECTIONS, SettingsFileError, load_section
from pagedkv.settings_roles import settings_class
from pagedkv.worker_svc.settings import WorkerSettings

FILE = """
[serve]
max-waiting = 9
api-key = "k-file"
allowed_origins = "https://a.example"

[block-manager]
num-gpu-blocks = 128
preemption-mode = "recompute"

[worker]
num-threads = 2
"""


@pytest.fixture
def config(tmp_path: pathlib.Path) -> str:
    path = tmp_path / "pagedkv.toml"
    path.write_text(FILE)
    return str(path)


def test_each_role_reads_its_own_section(config: str) -> None:
    serve = load_serve(["--config", config])
    assert (serve.max_waiting, serve.resolved_api_key(), serve.origins) == (
        9,
        "k-file",
        ["https://a.example"],
    )
    assert serve.max_num_seqs == ServeSettings().max_num_seqs  # not in the file: the default
    bm = load_block_manager(["--config", config])
    assert (bm.num_gpu_blocks, bm.preemption_mode) == (128, "recompute")
    assert "num_gpu_blocks" in bm.model_fields_set  # explicit: the geometry checks treat it so
    worker = settings_cli.load_settings(WorkerSettings, ["--config", config], "pagedkv worker", "")
    assert worker.num_threads == 2


def test_flag_over_file_over_environment_over_default(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_serve([]).max_waiting == 256
    monkeypatch.setenv("PAGEDKV_MAX_WAITING", "3")
    monkeypatch.setenv("PAGEDKV_RETRY_AFTER_S", "4")
    assert load_serve([]).max_waiting == 3
    both = load_serve(["--config", config])
    assert (both.max_waiting, both.retry_after_s) == (9, 4)  # the file's, and the variable it leaves
    assert load_serve(["--config", config, "--max-waiting", "1"]).max_waiting == 1


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("[serve]\nmax-waiting = -1\n", "[serve] max-waiting: must be at least 0"),
        ("[serve]\nmax-waitin = 1\n", "[serve] max-waitin: unknown setting (did you mean 'max-waiting'?)"),
        (
            '[serve]\nmetrics-vllm-names = "yes"\n',
            "[serve] metrics-vllm-names: input should be a valid boolean",
        ),
        ("[serv]\nport = 1\n", "[serv]: unknown section (did you mean 'serve'?)"),
    ],
)
def test_a_role_refuses_a_bad_file(
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    text: str,
    where: str,
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
        load_serve(["--config", str(path)])
    assert e.value.code == 2
    assert f"{path}: {where}" in capsys.readouterr().err


def test_a_missing_file_is_named(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SettingsFileError, match="missing.toml: cannot read it"):
        load_section(ServeSettings, str(tmp_path / "missing.toml"), "serve")


def test_every_section_has_a_settings_class() -> None:
    classes = {s: settings_class(s) for s in SECTIONS}
    assert classes["serve"] is ServeSettings and classes["block-manager"] is BlockManagerSettings
    assert classes["worker"] is WorkerSettings
