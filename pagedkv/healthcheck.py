"""``python -m pagedkv.healthcheck [HOST:PORT]``: a grpc_health_probe stand-in for container health checks.

Calls grpc.health.v1 Check once and exits 0 when the answer is SERVING, 1
otherwise (unreachable, timed out, NOT_SERVING, unknown service) -- the exit
codes Docker's HEALTHCHECK and compose's ``healthcheck.test`` expect. It
imports only grpcio and grpcio-health-checking, so it starts fast and never
touches torch.

Without a target it checks ``127.0.0.1:$PAGEDKV_PORT`` (default 50051): inside
a container, the service's own port on loopback.

:func:`wait_healthy` is the one "wait until it is up" loop of the tree: the
stack launcher, benchmarks and tests poll a freshly started service with it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv import defaults, envs
from pagedkv.tls import add_client_tls_args, channel


def check(
    target: str,
    service: str = "",
    timeout_s: float = 3.0,
    *,
    tls_ca: str = "",
    tls_cert: str = "",
    tls_key: str = "",
    wait_for_ready: bool = True,
) -> tuple[bool, str]:
    """(healthy, what was seen). With any TLS file the probe speaks TLS (mutual with cert + key);
    health needs no bearer token. `wait_for_ready`: wait up to `timeout_s` for the connection
    (a one-shot probe) rather than fail at once when nothing listens yet (a polling loop)."""
    try:
        with channel(target, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service),
                timeout=timeout_s,
                wait_for_ready=wait_for_ready,
            )
    except grpc.RpcError as e:
        return False, f"{e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, status


def wait_healthy(
    target: str,
    service: str = "",
    timeout_s: float = 30.0,
    *,
    proc: subprocess.Popen | None = None,
    probe: Callable[[], tuple[bool, str]] | None = None,
    interval_s: float = 0.1,
    name: str = "",
    tls_ca: str = "",
    tls_cert: str = "",
    tls_key: str = "",
) -> None:
    """Poll until `target` answers SERVING for `service` (or `probe()` says healthy, for a
    service with another kind of health check), every `interval_s`.

    Raises RuntimeError as soon as `proc` (the process serving it, when the caller started one)
    has exited, and TimeoutError after `timeout_s`; both name the service as `name` (default: the
    health service name) and say what the last probe saw. Each probe dials afresh and fails fast
    while nothing listens, so the wait ends within `interval_s` of the service coming up."""
    label = name or service or "server"
    deadline = time.monotonic() + timeout_s
    seen = "no answer"
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{label} at {target} exited with code {proc.returncode} before it was ready")
        if probe is not None:
            healthy, seen = probe()
        else:
            healthy, seen = check(
                target,
                service,
                timeout_s=1.0,
                tls_ca=tls_ca,
                tls_cert=tls_cert,
                tls_key=tls_key,
                wait_for_ready=False,
            )
        if healthy:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{label} at {target} was not SERVING in time (last: {seen})")
        time.sleep(interval_s)


def main(argv: Sequence[str] | None = None) -> int:
    default_target = f"{defaults.HOST}:{envs.get_str('PAGEDKV_PORT')}"
    ap = argparse.ArgumentParser(prog="python -m pagedkv.healthcheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("target", nargs="?", default=default_target, help=f"host:port (default {default_target})")
    ap.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")
    ap.add_argument("-q", "--quiet", action="store_true", help="print nothing, only set the exit code")
    add_client_tls_args(ap)
    args = ap.parse_args(argv)
    healthy, seen = check(
        args.target,
        args.service,
        args.timeout,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )
    if not args.quiet:
        print(f"{args.target}: {seen}", file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
