"""Throwaway CA + server/client certificates with Python's `cryptography`
(the fallback of tools/make_certs.sh, and what the tests use).

    python tools/make_certs.py [OUT_DIR]
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAMES = ("localhost", "block-manager", "cache-host", "worker")
SERVER_IPS = ("127.0.0.1", "::1")


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(k: ec.EllipticCurvePrivateKey) -> bytes:
    return k.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_certs(out: Path | str, days: int = 30) -> dict[str, Path]:
    """Write ca/server/client .pem + .key under `out`; returns their paths by name."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    until = now + dt.timedelta(days=days)
    ca_key = _key()
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("pagedkv test CA"))
        .issuer_name(_name("pagedkv test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": out / "ca.pem", "ca_key": out / "ca.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["ca_key"].write_bytes(_pem_key(ca_key))
    for who, cn, eku, sans in (
        (
            "server",
            "localhost",
            ExtendedKeyUsageOID.SERVER_AUTH,
            [x509.DNSName(n) for n in SERVER_NAMES]
            + [x509.IPAddress(ipaddress.ip_address(i)) for i in SERVER_IPS],
        ),
        ("client", "pagedkv-client", ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName("pagedkv-client")]),
    ):
        key = _key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        paths[who] = out / f"{who}.pem"
        paths[f"{who}_key"] = out / f"{who}.key"
        paths[who].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{who}_key"].write_bytes(_pem_key(key))
        paths[f"{who}_key"].chmod(0o600)
    paths["ca_key"].chmod(0o600)
    return paths


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "certs")
    make_certs(target)
    print(f"wrote {target.resolve()}/{{ca,server,client}}.{{pem,key}}")
