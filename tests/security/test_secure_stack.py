"""The whole stack secured, as processes: `pagedkv up --tls-dir DIR --auth-tokens-file FILE`.

Every server (block manager, cache host, workers) serves mutual TLS and requires a bearer token;
every connection between the roles presents a client certificate and a token (the cache host and
the workers fail to start otherwise). `pagedkv generate`, `demo` and `loadtest` reach the stack
with TLS flags and a token and the outputs equal transformers' greedy ones. At every server a
plaintext client, a client without a token and a client whose certificate comes from another CA
are refused.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest

from pagedkv.logging_setup import configure_logging
from pagedkv.tls import channel
from pagedkv.v1 import (
    block_manager_pb2,
    block_manager_pb2_grpc,
    cache_host_pb2,
    cache_host_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.frontend.launch.test_cli_stack import free_ports
from tests.frontend.up_process import UpProcess
from tests.security.conftest import TOKENS, TOOLS, write_tokens
from tests.worker_svc.conftest import HFModel, build_hf_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPT = [3, 17, 42, 9, 88, 5, 61, 23, 7, 101, 12, 64, 30, 2, 77, 45, 19]  # crosses a block boundary
ENV = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_")} | {
    "PAGEDKV_KERNEL_BACKEND": "reference"
}


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFModel:
    return build_hf_model(tmp_path_factory.mktemp("secure-llama"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A second, unrelated CA with its own client certificate (what an outsider would hold)."""
    out = tmp_path_factory.mktemp("other-ca")
    subprocess.run(["bash", str(TOOLS / "make_certs.sh"), str(out)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def stack(
    hf: HFModel, certs: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("secure-stack")
    tokens = write_tokens(tmp / "tokens.json")
    bm, ch, w, http = free_ports(4)
    tls_dir = str(pathlib.Path(certs["ca"]).parent)
    up = UpProcess(
        [
            "--block-manager-port",
            str(bm),
            "--cache-host-port",
            str(ch),
            "--worker-port",
            str(w),
            "--num-workers",
            "1",
            "--num-gpu-blocks",
            "256",
            "--device",
            "cpu",
            "--model",
            str(hf.path),
            "--log-format",
            "json",
            "--log-dir",
            str(tmp / "logs"),
            "--tls-dir",
            tls_dir,
            "--auth-tokens-file",
            tokens,
            "--serve-port",
            str(http),
        ],
        tmp,
        ENV,
    )
    try:
        up.wait_ready(150)
        up.wait_for("Ctrl-C stops everything")  # the whole message for people, which tests below read
        yield {
            "bm": f"localhost:{bm}",
            "cache_host": f"localhost:{ch}",
            "worker": f"localhost:{w}",
            "url": f"https://127.0.0.1:{http}",
            "ready": up.output(),
            "logs": str(tmp / "logs"),
            "tls_dir": tls_dir,
        }
    finally:
        out = up.stop()
    assert up.p.returncode == 0, out
    assert "no shared memory left behind" in out


def client_flags(certs: dict[str, str]) -> list[str]:
    return ["--tls-ca", certs["ca"], "--tls-cert", certs["client"], "--tls-key", certs["client_key"]]


def test_up_with_tls_and_tokens_tells_clients_how_to_connect(stack: dict[str, str]) -> None:
    assert f"--tls-ca {stack['tls_dir']}/ca.pem" in stack["ready"] and "--token-file" in stack["ready"]
    # the roles' own connections carried a client certificate and a token: the block manager saw them
    bm_log = (pathlib.Path(stack["logs"]) / "block-manager.log").read_text()
    assert "unauthenticated" not in bm_log
    assert TOKENS["alice"] not in bm_log
    # The cache host's start-up ResetPrefixCache (an admin method) is allowed to the stack's token.
    ch_log = (pathlib.Path(stack["logs"]) / "cache-host.log").read_text()
    assert '"event": "prefix_cache_reset"' in ch_log and "prefix_cache_reset_failed" not in ch_log, ch_log[
        -2000:
    ]


def test_generate_through_the_secured_stack_matches_transformers(
    stack: dict[str, str], certs, hf: HFModel
) -> None:  # type: ignore[no-untyped-def]
    args = [
        sys.executable,
        "-m",
        "pagedkv.cli",
        "generate",
        "--token-ids",
        ",".join(map(str, PROMPT)),
        "--max-tokens",
        "6",
        "--block-manager",
        stack["bm"],
        "--workers",
        stack["worker"],
        "--timeout-s",
        "20",
        *client_flags(certs),
    ]
    ok = subprocess.run(
        args,
        cwd=ROOT,
        env=ENV | {"PAGEDKV_TOKEN": TOKENS["alice"]},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["completions"][0]["token_ids"] == hf.greedy(PROMPT, 6)
    assert TOKENS["alice"] not in ok.stderr
    refused = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr


def test_the_frontend_serves_https_with_mutual_tls_and_its_own_token(
    stack: dict[str, str],
    certs,  # type: ignore[no-untyped-def]
    hf: HFModel,
) -> None:
    """`pagedkv serve` in the secured stack: HTTPS + client certificates, and its engine reaches the
    token-guarded block manager and worker with the token `up` made for it."""
    assert f"pagedkv generate --url {stack['url']}" in stack["ready"]
    args = [
        sys.executable,
        "-m",
        "pagedkv.cli",
        "generate",
        "--url",
        stack["url"],
        "--token-ids",
        ",".join(map(str, PROMPT)),
        "--max-tokens",
        "6",
    ]
    ok = subprocess.run(
        [*args, *client_flags(certs)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["completions"][0]["token_ids"] == hf.greedy(PROMPT, 6)
    no_cert = subprocess.run(
        [*args, "--tls-ca", certs["ca"]], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120
    )
    assert no_cert.returncode != 0


def test_demo_and_loadtest_reach_the_secured_stack(
    stack: dict[str, str], certs, monkeypatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    from pagedkv.frontend.apps import demo, loadtest

    monkeypatch.setenv("PAGEDKV_TOKEN", TOKENS["alice"])
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            rc = demo.main(
                [
                    "--block-manager",
                    stack["bm"],
                    "--workers",
                    stack["worker"],
                    "--requests",
                    "3",
                    "--no-progress",
                    *client_flags(certs),
                ]
            )
    finally:
        configure_logging(
            "info", "console", cache=False
        )  # demo.main configured it for itself: the suite's again
    assert rc == 0 and "pagedkv demo results" in out.getvalue()
    # An admin token: a tenant without a GPU quota is shown no free blocks, and loadtest sizes its run
    # by them.
    monkeypatch.setenv("PAGEDKV_TOKEN", TOKENS["root"])
    report = tmp_path / "lt.json"
    rc = loadtest.main(
        [
            "--target",
            stack["bm"],
            "--scenario",
            "lifecycle",
            "-c",
            "2",
            "--total",
            "40",
            "--num-tokens",
            "16",
            "--format",
            "json",
            "--output",
            str(report),
            *client_flags(certs),
        ]
    )
    rep = json.loads(report.read_text())
    assert rc == 0 and rep["status_code_distribution"] == {"OK": rep["count"]} and rep["pool_check"]["ok"]


def _calls(target: str, ch: grpc.Channel, md: tuple) -> object:
    """One real RPC of the server at ``target`` (not health, which is open by design)."""
    if target == "bm":
        return block_manager_pb2_grpc.BlockManagerStub(ch).GetConfig(
            block_manager_pb2.GetConfigRequest(), metadata=md, timeout=10
        )
    if target == "cache_host":
        return cache_host_pb2_grpc.CacheHostStub(ch).GetCacheInfo(
            cache_host_pb2.GetCacheInfoRequest(), metadata=md, timeout=10
        )
    return worker_pb2_grpc.WorkerStub(ch).GetWorkerInfo(
        worker_pb2.GetWorkerInfoRequest(), metadata=md, timeout=10
    )


@pytest.mark.parametrize("server", ["bm", "cache_host", "worker"])
def test_every_server_refuses_plaintext_tokenless_and_foreign_ca_clients(
    stack: dict[str, str], certs: dict[str, str], other_ca: pathlib.Path, server: str
) -> None:
    address = stack[server]
    token = (("authorization", f"Bearer {TOKENS['alice']}"),)
    mtls = {"tls_ca": certs["ca"], "tls_cert": certs["client"], "tls_key": certs["client_key"]}
    with channel(address, **mtls) as ch:  # the control: the right certificate and a token work
        assert _calls(server, ch, token)
    with channel(address, **mtls) as ch, pytest.raises(grpc.RpcError) as e:
        _calls(server, ch, ())
    assert e.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as e:
        _calls(server, ch, token)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    foreign = {
        "tls_ca": certs["ca"],
        "tls_cert": str(other_ca / "client.pem"),
        "tls_key": str(other_ca / "client.key"),
    }
    with channel(address, **foreign) as ch, pytest.raises(grpc.RpcError) as e:
        _calls(server, ch, token)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE


def test_up_refuses_missing_certificates_and_a_reserved_tenant(tmp_path, capsys, certs) -> None:  # type: ignore[no-untyped-def]
    from pagedkv.frontend.launch import processes as up

    assert up.main(["--tls-dir", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert (
        "missing ca.pem, server.pem, server.key, client.pem, client.key" in err
        and "tools/make_certs.sh" in err
    )
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tenants": [{"name": "pagedkv-stack", "token_sha256": "0" * 64}]}))
    assert (
        up.main(["--tls-dir", str(pathlib.Path(certs["ca"]).parent), "--auth-tokens-file", str(tokens)]) == 2
    )
    assert "reserved" in capsys.readouterr().err
    # Tokens without TLS would travel in plaintext between the roles: refused, naming the way out.
    ok_tokens = write_tokens(tmp_path / "ok.json")
    assert up.main(["--auth-tokens-file", ok_tokens]) == 2
    err = capsys.readouterr().err
    assert "--tls-dir" in err and "--allow-insecure" in err and "plaintext" in err


def _https_get(url: str, context: object, path: str = "/health") -> int:
    """GET ``path`` over ``context`` (an ssl.SSLContext, or None for plain HTTP); the status."""
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    conn = (
        http.client.HTTPSConnection(u.hostname, u.port, context=context, timeout=20)
        if context is not None
        else http.client.HTTPConnection(u.hostname, u.port, timeout=20)
    )
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def _tls_context(ca: str, cert: str | None = None, key: str | None = None, tls12: bool = False):  # type: ignore[no-untyped-def]
    import ssl

    ctx = ssl.create_default_context(cafile=ca)
    if tls12:  # the server's verdict on our certificate arrives inside the handshake (TLS 1.3: after it)
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def test_the_https_front_door_refuses_plain_http_and_foreign_or_missing_client_certificates(
    stack: dict[str, str], certs: dict[str, str], other_ca: pathlib.Path
) -> None:
    """`pagedkv serve --tls-cert/--tls-key --tls-client-ca`: only a TLS client with a certificate our CA
    signed gets an HTTP answer. Plain HTTP gets no HTTP response at all (the server closes the
    connection after a failed TLS handshake); a client certificate from another CA, or none, ends the
    TLS handshake; a client verifying the server against another CA refuses the server."""
    import http.client
    import ssl

    assert _https_get(stack["url"], _tls_context(certs["ca"], certs["client"], certs["client_key"])) == 200
    with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
        _https_get(stack["url"], None)
    foreign = (str(other_ca / "client.pem"), str(other_ca / "client.key"))
    for cert in (foreign, (None, None)):
        # TLS 1.2: the server checks our certificate inside the handshake, which it ends (an EOF
        # instead of its Finished message; an alert naming the reason from servers that send one).
        with pytest.raises(ssl.SSLError) as e:
            _https_get(stack["url"], _tls_context(certs["ca"], *cert, tls12=True))
        assert isinstance(e.value, ssl.SSLEOFError) or "ALERT" in str(e.value.reason), repr(e.value)
        # TLS 1.3: the client's side of the handshake ends first; the server then closes the
        # connection and no HTTP response ever comes.
        with pytest.raises((ssl.SSLError, http.client.RemoteDisconnected, ConnectionResetError)):
            _https_get(stack["url"], _tls_context(certs["ca"], *cert))
    # A client that verifies the server against another CA refuses the front door itself.
    with pytest.raises(ssl.SSLCertVerificationError):
        _https_get(stack["url"], _tls_context(str(other_ca / "ca.pem"), certs["client"], certs["client_key"]))
