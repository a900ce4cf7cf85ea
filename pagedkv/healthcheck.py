"""``python -m pagedkv.healthcheck [HOST:PORT]``: a grpc_health_probe stand-in for container health checks.

Calls grpc.health.v1 Check once and exits 0 when the answer is SERVING, 1
otherwise (unreachable, timed out, NOT_SERVING, unknown service) -- the exit
codes Docker's HEALTHCHECK and compose's ``healthcheck.test`` expect. It
imports only grpcio and grpcio-health-checking, so it starts fast and never
touches torch.

Without a target it checks ``127.0.0.1:$PAGEDKV_PORT`` (default 50051): inside
a container, the service's own port on loopback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.tls import channel


def check(target: str, service: str = "", timeout_s: float = 3.0, *, tls_ca: str = "", tls_cert: str = "",
          tls_key: str = "") -> tuple[bool, str]:
    """(healthy, what was seen). With any TLS file the probe speaks TLS (mutual with cert + key);
    health needs no bearer token."""
    try:
        with channel(target, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, wait_for_ready=True
            )
    except grpc.RpcError as e:
        return False, f"{e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: Sequence[str] | None = None) -> int:
    default_target = f"127.0.0.1:{os.environ.get('PAGEDKV_PORT', '50051')}"
    ap = argparse.ArgumentParser(prog="python -m pagedkv.healthcheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("target", nargs="?", default=default_target, help=f"host:port (default {default_target})")
    ap.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer")
    ap.add_argument("-q", "--quiet", action="store_true", help="print nothing, only set the exit code")
    ap.add_argument("--tls-ca", default=os.environ.get("PAGEDKV_TLS_CA", ""),
                    help="CA bundle verifying the server: TLS [env PAGEDKV_TLS_CA]")
    ap.add_argument("--tls-cert", default=os.environ.get("PAGEDKV_TLS_CLIENT_CERT", ""),
                    help="client certificate for a mutual-TLS server [env PAGEDKV_TLS_CLIENT_CERT]")
    ap.add_argument("--tls-key", default=os.environ.get("PAGEDKV_TLS_CLIENT_KEY", ""),
                    help="client key [env PAGEDKV_TLS_CLIENT_KEY]")
    args = ap.parse_args(argv)
    healthy, seen = check(args.target, args.service, args.timeout, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                          tls_key=args.tls_key)
    if not args.quiet:
        print(f"{args.target}: {seen}", file=sys.stdout if healthy else sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
