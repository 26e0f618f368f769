"""Healthy when the broker answers an ApiVersions request on its first listener (exit 0), else exit 1.

A broker accepts connections on its listeners only once it can serve requests, so an answer means
ready, where an open port would not: the kernel completes TCP handshakes on a bound socket that
Kafka does not accept from yet. A few bytes of Kafka's wire protocol (ApiVersions v0: size, api key
18, version 0, correlation id, client id; the answer starts with the same correlation id and error
code 0) instead of a JVM tool, which would cost a second or more of CPU per check on every node.

With ``KAFKA_HEALTHCHECK_CAFILE`` the check speaks TLS, verifying the broker's certificate with that CA:
on a SASL_SSL listener a broker answers ApiVersions before authentication (KIP-43), so the check needs no
credential (docker-compose.secure.yml).
"""

import os
import socket
import ssl
import struct
import sys

port = int(os.environ.get("KAFKA_HEALTHCHECK_PORT", "19092"))
cafile = os.environ.get("KAFKA_HEALTHCHECK_CAFILE")
client_id = b"healthcheck"
request = struct.pack(">hhih", 18, 0, 7, len(client_id)) + client_id
try:
    with socket.create_connection(("127.0.0.1", port), timeout=4) as raw:
        sock = raw
        if cafile:
            sock = ssl.create_default_context(cafile=cafile).wrap_socket(raw, server_hostname="127.0.0.1")
        sock.sendall(struct.pack(">i", len(request)) + request)
        header = b""
        while len(header) < 10:
            chunk = sock.recv(10 - len(header))
            if not chunk:
                break
            header += chunk
except (OSError, ssl.SSLError) as exc:
    print(f"no answer on 127.0.0.1:{port}: {exc}")
    sys.exit(1)
if len(header) < 10:
    print(f"connection on 127.0.0.1:{port} closed before an answer")
    sys.exit(1)
_, correlation_id, error_code = struct.unpack(">iih", header)
if correlation_id != 7 or error_code != 0:
    print(f"unexpected answer: correlation id {correlation_id}, error code {error_code}")
    sys.exit(1)
sys.exit(0)
