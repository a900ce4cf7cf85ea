"""docker-compose.yml / docker-compose.cpu.yml: schema-valid, and wired the way CUDA IPC needs.

No Docker engine runs here. The files are validated against the Compose Specification schema with
check-jsonschema (`--builtin-schema vendor.compose-spec`), and with Compose v1's `docker-compose
config -q` when that is installed (Debian's package; it also resolves `depends_on`). The CPU
override uses `!reset` (Compose >= 2.24), a YAML tag neither tool parses, so it is checked twice:
alone with the tag dropped, and merged onto the main file the way Compose merges.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the compose files")

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "docker-compose.yml"
CPU = ROOT / "docker-compose.cpu.yml"
RESET = object()


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!reset", lambda loader, node: RESET)


def load(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=_Loader)  # a SafeLoader subclass


def drop_resets(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: drop_resets(v) for k, v in doc.items() if v is not RESET}
    return doc


def merge(base: Any, override: Any) -> Any:
    """Compose's merge for what our override uses: mappings merge key by key, `!reset` removes."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            if v is RESET:
                out.pop(k, None)
            else:
                out[k] = merge(out[k], v) if k in out else drop_resets(v)
        return out
    return override


def check_jsonschema() -> str:
    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    if not Path(exe).exists():
        pytest.skip("check-jsonschema is not installed (pip install 'check-jsonschema>=0.29')")
    return exe


def validate(path: Path) -> None:
    proc = subprocess.run(
        [check_jsonschema(), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_main_file_matches_the_compose_spec() -> None:
    validate(BASE)


def test_cpu_override_alone_and_merged_match_the_compose_spec(tmp_path: Path) -> None:
    alone = tmp_path / "cpu-alone.yml"
    alone.write_text(json.dumps(drop_resets(load(CPU))))
    validate(alone)
    merged = tmp_path / "merged.yml"
    merged.write_text(json.dumps(merge(load(BASE), load(CPU))))
    validate(merged)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (v1) not installed")
def test_compose_v1_config_accepts_the_files(tmp_path: Path) -> None:
    merged = tmp_path / "merged.yml"
    merged.write_text(json.dumps(merge(load(BASE), load(CPU))))
    pd = tmp_path / "pd-merged.yml"
    pd.write_text(json.dumps(merge(load(BASE), load(ROOT / "docker-compose.pd.yml"))))
    for args in (
        ["-f", str(BASE)],
        ["--project-directory", str(ROOT), "-f", str(merged)],
        ["--project-directory", str(ROOT), "-f", str(pd)],
    ):
        proc = subprocess.run(
            ["docker-compose", *args, "config", "-q"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr


def _gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def test_gpu_ipc_health_and_ports_wiring() -> None:
    services = load(BASE)["services"]
    assert set(services) == {"block-manager", "cache-host", "worker", "frontend"}
    frontend = services.pop("frontend")
    for name, svc in services.items():
        env = svc["environment"]
        assert env["PAGEDKV_HOST"] == "0.0.0.0", name  # reachable from the other containers
        assert svc["healthcheck"]["test"][:3] == ["CMD", "python", "-m"], name
        assert "pagedkv.healthcheck" in svc["healthcheck"]["test"], name
        assert svc["command"] == [name], name
        for port in svc.get("ports", []):
            assert port.startswith("${PAGEDKV_BIND:-127.0.0.1}:"), (name, port)  # loopback unless chosen
    assert not _gpu_devices(services["block-manager"])
    for name in ("cache-host", "worker"):
        (dev,) = _gpu_devices(services[name])
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        assert dev["device_ids"] == _gpu_devices(services["cache-host"])[0]["device_ids"]  # one GPU for IPC
    assert services["cache-host"]["ipc"] == "shareable"
    assert services["worker"]["ipc"] == "service:cache-host"
    assert services["worker"]["pid"] == "service:cache-host"
    assert services["worker"]["environment"]["PAGEDKV_CACHE_HOST"] == "cache-host:50052"
    assert services["cache-host"]["depends_on"] == {"block-manager": {"condition": "service_healthy"}}
    assert services["worker"]["depends_on"] == {
        "cache-host": {"condition": "service_healthy"},
        "block-manager": {"condition": "service_healthy"},
    }
    assert {s["environment"]["PAGEDKV_PORT"] for s in services.values()} == {"50051", "50052", "50053"}
    # The OpenAI-compatible frontend: HTTP /health, loopback-published, after a healthy worker.
    assert frontend["command"] == ["serve"]
    assert "http://127.0.0.1:8000/health" in " ".join(frontend["healthcheck"]["test"])
    assert frontend["ports"] == ["${PAGEDKV_BIND:-127.0.0.1}:${PAGEDKV_HTTP_PORT:-8000}:8000"]
    assert frontend["environment"]["PAGEDKV_WORKERS"] == "worker:50053"
    assert frontend["depends_on"]["worker"] == {"condition": "service_healthy"}
    assert not _gpu_devices(frontend)


PD = ROOT / "docker-compose.pd.yml"


def test_services_come_back_after_a_crash_in_order() -> None:
    """Restart policies, the block manager's state volume, and the order the roles come back in:
    every long-running role restarts unless stopped; the block manager journals to a named volume;
    workers (here and in the PD file) start after a healthy cache host. (Compose's
    `depends_on.restart` would restart them with it on `docker compose restart`, but Compose v1
    rejects the key; after a crash, restart policies and the worker's own wait / re-attach order them.)"""
    doc = load(BASE)
    services = doc["services"]
    for name, svc in services.items():
        assert svc["restart"] == "unless-stopped", name
    bm = services["block-manager"]
    state = bm["environment"]["PAGEDKV_STATE_DIR"]
    volume, _, mount = bm["volumes"][0].partition(":")
    assert mount == state and volume in doc["volumes"]  # a named volume, not the container's layer
    from pagedkv.block_manager_svc.settings import BlockManagerSettings

    assert "state_dir" in BlockManagerSettings.model_fields  # PAGEDKV_STATE_DIR is a real setting
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f"mkdir -p {state} && chown pagedkv:pagedkv {state}" in dockerfile  # writable by the image's user
    pd = merge(doc, load(PD))["services"]
    for name in ("worker", "worker-decode"):
        assert pd[name]["restart"] == "unless-stopped", name
        assert pd[name]["depends_on"]["cache-host"] == {"condition": "service_healthy"}, name
        assert pd[name]["depends_on"]["block-manager"] == {"condition": "service_healthy"}, name
    assert services["frontend"]["depends_on"]["block-manager"] == {"condition": "service_healthy"}


def test_pd_file_merged_matches_the_compose_spec(tmp_path: Path) -> None:
    merged = tmp_path / "pd-merged.yml"
    merged.write_text(json.dumps(merge(load(BASE), load(PD))))
    validate(merged)


def test_cpu_variant_drops_the_gpu_and_builds_the_cpu_image() -> None:
    services = merge(load(BASE), load(CPU))["services"]
    for name, svc in services.items():
        assert not _gpu_devices(svc), name
        assert svc["build"]["args"]["TORCH_VARIANT"] == "cpu", name
        assert svc["image"] != load(BASE)["services"][name]["image"], name  # does not clobber the GPU tag
    for name in ("cache-host", "worker"):
        assert services[name]["environment"]["PAGEDKV_DEVICE"] == "cpu"
        assert services[name]["environment"]["PAGEDKV_HOST"] == "0.0.0.0"  # merged, not replaced
    assert services["worker"]["ipc"] == "service:cache-host"  # shared memory needs the IPC namespace too


def test_dockerfile_uses_one_cuda_major_throughout() -> None:
    """Base image, torch's wheel index and the CuPy extra name the same CUDA major."""
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=nvidia/cuda:(\d+)\.", text, re.M)
    major = re.search(r"^ARG CUDA_MAJOR=(\d+)$", text, re.M)
    index = re.search(r"^ARG TORCH_CUDA_INDEX=https://download\.pytorch\.org/whl/cu(\d+)$", text, re.M)
    assert base and major and index, "BASE_IMAGE, CUDA_MAJOR and TORCH_CUDA_INDEX must be declared"
    assert base.group(1) == major.group(1) == index.group(1)[:-1], (
        base.group(1),
        major.group(1),
        index.group(1),
    )
    assert '--index-url "${TORCH_CUDA_INDEX}"' in text, "torch's CUDA wheel from the index of that major"
    assert 'extras="worker,gpu-cuda${CUDA_MAJOR},text"' in text
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert all(dep.startswith(f"cupy-cuda{major.group(1)}x") for dep in extras[f"gpu-cuda{major.group(1)}"])
    assert "cuda12" not in text.replace("cupy-cuda12x", "") and "12.8" not in text


def test_dockerfile_and_dockerignore() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "ARG TORCH_VARIANT=cuda" in text and "download.pytorch.org/whl/cpu" in text
    assert "worker,gpu" in text and "pagedkv.healthcheck" in text
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "tests"} <= ignored
    assert "README.md" not in ignored and "pyproject.toml" not in ignored  # the package build needs them


PD = ROOT / "docker-compose.pd.yml"


def test_prefill_decode_layout_merges_valid_and_wires_roles_and_mps(tmp_path: Path) -> None:
    merged_doc = merge(load(BASE), load(PD))
    merged = tmp_path / "pd.yml"
    merged.write_text(json.dumps(merged_doc))
    validate(merged)
    services = merged_doc["services"]
    prefill, decode = services["worker"], services["worker-decode"]
    assert (
        prefill["environment"]["PAGEDKV_ROLE"] == "prefill"
        and decode["environment"]["PAGEDKV_ROLE"] == "decode"
    )
    assert prefill["environment"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "${PAGEDKV_PREFILL_SM_PERCENT:-30}"
    assert decode["environment"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "${PAGEDKV_DECODE_SM_PERCENT:-70}"
    for name in ("cache-host", "worker", "worker-decode"):  # one MPS server for every GPU process
        svc = services[name]
        assert svc["ipc"] == "host" and svc["environment"]["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps", (
            name
        )
        assert any(v.endswith(":/tmp/nvidia-mps") for v in svc["volumes"]), name
        assert _gpu_devices(svc)[0]["device_ids"] == _gpu_devices(services["cache-host"])[0]["device_ids"], (
            name
        )
    assert prefill["environment"]["PAGEDKV_HOST"] == "0.0.0.0"  # merged onto the main file's settings
    assert (
        decode["pid"] == "service:cache-host"
        and decode["environment"]["PAGEDKV_CACHE_HOST"] == "cache-host:50052"
    )
    assert decode["environment"]["PAGEDKV_PORT"] == "50054"
    # An MPS server only serves clients of its own UID: the daemon runs as the image's user, so does
    # every GPU service, explicitly; and shm_size (inert with ipc: host) is said to be so.
    image_uid = re.search(r"useradd .*--uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1)  # type: ignore[union-attr]
    for name in ("cache-host", "worker", "worker-decode"):
        assert services[name]["user"] == f"${{PAGEDKV_MPS_UID:-{image_uid}}}", name
    assert "shm_size` for the cache host is inert" in PD.read_text()
    assert f"sudo -u '#{image_uid}'" in PD.read_text()
    assert all(p.startswith("${PAGEDKV_BIND:-127.0.0.1}:") for p in decode["ports"])
