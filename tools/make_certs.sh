#!/usr/bin/env bash
# Throwaway CA + server and client certificates for tests and local TLS/mTLS
# (docs/security.md). Not for production: keys are unencrypted, CA lives 30 days.
#
#   tools/make_certs.sh [OUT_DIR]   (default: ./certs)
#
# Writes ca.pem ca.key server.pem server.key (SAN localhost, 127.0.0.1, ::1 and
# the compose service names) client.pem client.key (CN pagedkv-client).
# Uses openssl when installed, else Python's `cryptography` (tools/make_certs.py).
set -euo pipefail
out="${1:-certs}"
here="$(cd "$(dirname "$0")" && pwd)"
if ! command -v openssl >/dev/null 2>&1; then
    exec python3 "$here/make_certs.py" "$out"
fi
mkdir -p "$out"
cd "$out"
san="DNS:localhost,IP:127.0.0.1,IP:::1,DNS:block-manager,DNS:cache-host,DNS:worker"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
    -subj "/CN=pagedkv test CA" -keyout ca.key -out ca.pem \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
for who in server client; do
    if [ "$who" = server ]; then eku=serverAuth; ext="subjectAltName=$san"; cn=localhost
    else eku=clientAuth; ext="subjectAltName=DNS:pagedkv-client"; cn=pagedkv-client; fi
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$cn" \
        -keyout "$who.key" -out "$who.csr" 2>/dev/null
    printf '%s\nextendedKeyUsage=%s\nbasicConstraints=CA:FALSE\n' "$ext" "$eku" > "$who.ext"
    openssl x509 -req -in "$who.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 30 \
        -extfile "$who.ext" -out "$who.pem" 2>/dev/null
    rm -f "$who.csr" "$who.ext"
done
rm -f ca.srl
chmod 600 ./*.key
echo "wrote $(pwd)/{ca,server,client}.{pem,key}"
