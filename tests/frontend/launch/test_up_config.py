"""`pagedkv up --config FILE`: the file's values reach each role's settings as its own loader reads
its command line, in the order flag > file > PAGEDKV_* variable > default; a bad file is refused
naming the file, the section and the key; `pagedkv up --help` fits on one screen. No process starts
(the roles' command lines are what plan() writes)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from pydantic_settings import BaseSettings

from pagedkv import settings_cli
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.frontend.launch.processes import Service, build_parser, plan, up_config
from pagedkv.frontend.launch.security import StackSecurity
from pagedkv.frontend.launch.up_settings import SERVE_FLAGS, SET_BY_UP, UpSettings
from pagedkv.frontend.serve.settings import ServeSettings
from pagedkv.worker_svc.settings import CacheHostSettings, WorkerSettings

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "deploy" / "pagedkv.example.toml"
ROLE: dict[str, type[BaseSettings]] = {
    "block-manager": BlockManagerSettings,
    "cache-host": CacheHostSettings,
    "worker": WorkerSettings,
    "frontend": ServeSettings,
}


def role_settings(svc: Service) -> object:
    """``svc``'s settings as the role itself reads its command line (not its environment)."""
    cls = ROLE[svc.name.split("-")[0] if svc.name.startswith("worker") else svc.name]
    command = svc.args[3]  # python -m pagedkv.cli <command> ...
    return settings_cli.load_settings(cls, svc.args[4:], f"pagedkv {command}", "")


def write(tmp_path: pathlib.Path, text: str) -> str:
    path = tmp_path / "pagedkv.toml"
    path.write_text(text)
    return str(path)


FULL = """
[up]
num-workers = 1
num-gpu-blocks = 64
num-cpu-blocks = 8
device = "cpu"
fsync = "batch"
max-num-seqs = 5

[serve]
model-name = "smol"
max-waiting = 7
metrics-vllm-names = true

[block-manager]
preemption-mode = "swap"
enable_prefix_caching = false
lease-ttl-s = 12.5

[cache-host]
connect-timeout-s = 5

[worker]
cache-host-failures = 3
cuda-graphs = false
"""


def test_the_files_values_reach_every_roles_settings(tmp_path: pathlib.Path) -> None:
    opts = up_config(["--config", write(tmp_path, FULL)])
    services = {s.name: s for s in plan(opts, state_dir=str(tmp_path / "state"))}
    bm = role_settings(services["block-manager"])
    assert isinstance(bm, BlockManagerSettings)
    assert (bm.num_gpu_blocks, bm.num_cpu_blocks, bm.fsync) == (64, 8, "batch")
    assert (bm.preemption_mode, bm.enable_prefix_caching, bm.lease_ttl_s) == ("swap", False, 12.5)
    host = role_settings(services["cache-host"])
    assert isinstance(host, CacheHostSettings)
    assert (host.connect_timeout_s, host.device) == (5.0, "cpu")
    worker = role_settings(services["worker-0"])
    assert isinstance(worker, WorkerSettings)
    assert (worker.cache_host_failures, worker.cuda_graphs, worker.device) == (3, False, "cpu")
    serve = role_settings(services["frontend"])
    assert isinstance(serve, ServeSettings)
    assert (serve.model_name, serve.max_waiting, serve.max_num_seqs) == ("smol", 7, 5)
    assert serve.metrics_vllm_names is True
    # Nothing asked in the file: each role keeps its own default.
    assert worker.cache_host_check_interval_s == WorkerSettings().cache_host_check_interval_s
    assert bm.watermark_fraction == BlockManagerSettings().watermark_fraction


def test_a_flag_wins_over_the_file_which_wins_over_the_environment(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parse = build_parser().parse_args
    # Default, then each layer over the one below it: an own setting of up and a forwarded one.
    assert (parse([]).num_cpu_blocks, parse([]).serve_max_waiting) == (256, None)
    monkeypatch.setenv("PAGEDKV_NUM_CPU_BLOCKS", "11")
    monkeypatch.setenv("PAGEDKV_MAX_WAITING", "3")
    assert (parse([]).num_cpu_blocks, parse([]).serve_max_waiting) == (11, 3)
    path = write(tmp_path, "[up]\nnum-cpu-blocks = 22\n\n[serve]\nmax-waiting = 4\n")
    args = parse(["--config", path])
    assert (args.num_cpu_blocks, args.serve_max_waiting) == (22, 4)
    args = parse(["--config", path, "--num-cpu-blocks", "33", "--max-waiting", "5"])
    assert (args.num_cpu_blocks, args.serve_max_waiting) == (33, 5)
    # ... and what wins is what the role is started with.
    opts = up_config(["--config", path, "--max-waiting", "5", "--num-workers", "1"])
    serve = role_settings(plan(opts)[-1])
    assert isinstance(serve, ServeSettings) and serve.max_waiting == 5
    assert "--num-cpu-blocks" in plan(opts)[0].args
    bm_args = plan(opts)[0].args
    assert bm_args[bm_args.index("--num-cpu-blocks") + 1] == "22"


def test_a_bad_environment_variable_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PAGEDKV_NUM_WORKERS", "two")
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([])
    assert e.value.code == 2
    assert "PAGEDKV_NUM_WORKERS" in capsys.readouterr().err


BAD = [
    ("[sevre]\nmax-waiting = 1\n", "[sevre]", "did you mean 'serve'"),
    ("[up]\nnum-worker = 2\n", "[up] num-worker", "did you mean 'num-workers'"),
    ('[up]\nnum-workers = "two"\n', "[up] num-workers", "valid integer"),
    ("[up]\nnum-workers = 0\n", "[up] num-workers", "must be at least 1"),
    ('[up]\nkv-cache-dtype = "int4"\n', "[up] kv-cache-dtype", "must be one of"),
    ("[serve]\nmax-num-seqs = 0\n", "[serve] max-num-seqs", "must be at least 1"),
    ("[up]\nmax-num-seqs = 4\n[serve]\nmax-num-seqs = 5\n", "[serve] max-num-seqs", "also set in [up]"),
    ("[worker]\nport = 9000\n", "[worker] port", "pagedkv up sets this"),
    ("[block-manager]\nfsync = 'off'\n", "[block-manager] fsync", "set [up] fsync"),
    ('[serve]\napi-key = "k"\n', "[serve] api-key", "secret"),
    ('[worker]\ntoken = "t"\n', "[worker] token", "PAGEDKV_TOKEN"),
    ("[block-manager]\nbogus = 1\n", "[block-manager] bogus", "unknown setting"),
    ("num-workers = 2\n", "num-workers", "outside a section"),
    ("[up\n", "", "not TOML"),
]


@pytest.mark.parametrize(("text", "where", "why"), BAD)
def test_a_bad_file_is_refused_naming_file_section_and_key(
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    text: str,
    where: str,
    why: str,
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--config", path])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{path}: {where}" in err and why in err, err


def test_up_with_a_bad_file_starts_nothing(tmp_path: pathlib.Path) -> None:
    path = write(tmp_path, "[up]\nnum-workers = -1\n")
    r = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "up", "--config", path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert f"{path}: [up] num-workers: must be at least 1" in r.stderr
    assert "starting" not in r.stdout and "SERVING" not in r.stdout


def test_the_example_file_loads_for_up_and_for_each_role() -> None:
    opts = up_config(["--config", str(EXAMPLE)])
    assert opts.kv_cache_memory == 0.5 and ("--model-name", "tiny") == opts.serve_args[:2]
    assert opts.block_manager_overrides["preemption_mode"] == "auto"
    serve = settings_cli.load_settings(ServeSettings, ["--config", str(EXAMPLE)], "pagedkv serve", "")
    assert serve.model_name == "tiny" and serve.max_waiting == 128
    bm = settings_cli.load_settings(
        BlockManagerSettings, ["--config", str(EXAMPLE)], "pagedkv block-manager", ""
    )
    assert bm.eviction_policy == "lru-size"


def _fields_given(args: list[str]) -> set[str]:
    return {a[2:].removeprefix("no-").replace("-", "_") for a in args if a.startswith("--")}


@pytest.mark.parametrize("budget", [["--num-gpu-blocks", "64"], ["--kv-cache-memory", "0.01"]])
def test_set_by_up_names_every_setting_up_gives_a_role(budget: list[str]) -> None:
    """What plan() writes on a role's command line is marked as up's (so a file cannot set it in
    the role's section and be overridden), a secured stack included."""
    opts = up_config(["--num-workers", "1", "--model-name", "m", *budget])
    secure = StackSecurity(tls_dir="/certs", role_tokens_file="/certs/tokens.json")
    section = {"frontend": "serve", "worker-0": "worker"}
    for svc in plan(opts, secure, state_dir="/state"):
        role = section.get(svc.name, svc.name)
        given = _fields_given(svc.args[4:])
        forwarded = set(SERVE_FLAGS) if role == "serve" else set()
        assert given - forwarded <= SET_BY_UP[role], (role, given - forwarded - SET_BY_UP[role])


def test_help_fits_one_screen_and_help_all_lists_every_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    short = build_parser().format_help()
    lines = short.splitlines()
    assert len(lines) <= 50 and max(len(line) for line in lines) <= 100, short
    assert "docs/settings.md" in short and "--help-all" in short and "--config" in short
    for common in ("--model ", "--num-workers", "--kv-cache-memory", "--max-num-seqs", "--weight-format"):
        assert common in short
    assert "--max-restarts-per-minute" not in short  # in --help-all and docs/settings.md
    full = build_parser(show_all=True).format_help()
    for name in (*UpSettings.model_fields, *SERVE_FLAGS):
        assert settings_cli.flag(name) in full, name
    # A flag --help leaves out still works.
    assert build_parser().parse_args(["--max-restarts-per-minute", "2"]).max_restarts_per_minute == 2


def test_help_all_prints_every_flag() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "up", "--help-all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "100"},
    )
    assert r.returncode == 0 and "--max-restarts-per-minute" in r.stdout and "--fsync" in r.stdout


def test_a_draft_model_goes_to_every_role_that_loads_or_asks_for_it(tmp_path: pathlib.Path) -> None:
    """``--speculative-model``: the cache host (its KV cache), each worker (its weights), the
    frontend (which then speculates with it); the plan counts its KV in every block."""
    from pagedkv.worker_svc.geometry import model_block_bytes
    from tests.worker_svc.conftest import build_hf_model

    target = build_hf_model(tmp_path / "m").path
    draft = build_hf_model(tmp_path / "d", num_hidden_layers=1).path
    opts = up_config(["--model", str(target), "--speculative-model", str(draft), "--num-workers", "2"])
    given = {svc.name: svc.args for svc in plan(opts)}
    for name in ("cache-host", "worker-0", "worker-1", "frontend"):
        i = given[name].index("--speculative-model")
        assert given[name][i + 1] == str(draft), name
    assert "--speculative-model" not in given["block-manager"]
    with_draft = model_block_bytes(str(target), "float32", "cpu", 16, "auto", "", str(draft))
    assert with_draft == model_block_bytes(str(target), "float32", "cpu", 16, "auto") * 3 // 2  # 2 + 1 layers
    serve = ServeSettings(speculative_model=str(draft))
    spec = serve.speculative_config()
    assert spec is not None and spec.method == "draft_model"
    with pytest.raises(ValueError, match="choose one proposer"):
        ServeSettings(speculative="ngram", speculative_model=str(draft))
    with pytest.raises(ValueError, match="needs --speculative-model"):
        ServeSettings(speculative="draft_model")
    with pytest.raises(SystemExit, match="pagedkv up: --speculative-model /nonexistent: no such"):
        up_config(["--model", str(target), "--speculative-model", "/nonexistent"])
    with pytest.raises(SystemExit, match="pagedkv up: --model /nonexistent: no such"):
        up_config(["--model", "/nonexistent"])
