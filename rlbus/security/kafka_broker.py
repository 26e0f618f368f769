"""A secure Kafka broker's own settings: TLS on every listener, SCRAM for clients, nothing allowed without an ACL.

Shared by the two places that render a broker's ``server.properties``: a local secure cluster
(``rlbus kafka start --secure``, :mod:`rlbus_tools.services.kafka_secure`, which adds its listeners and ports)
and a container deployment's credentials (``rlbus secrets issue``, :mod:`rlbus.security.credentials`, whose
brokers listen on their container names). Certificates map to principals by their common name
(``CN=name`` → ``User:name``), so certificates and SCRAM users share one namespace; the nodes
(:func:`node_principal`) and the administrator (:data:`ADMIN`) are super users.
"""

from __future__ import annotations

from pathlib import Path

ADMIN = "rlbus-admin"
SCRAM_LOGIN = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"


def node_principal(node_id: int) -> str:
    return f"kafka-node-{node_id}"


def security_settings(
    *, keystore: Path, keystore_password: str, truststore: Path, super_users: set[str],
    scram_listeners: tuple[str, ...], mtls: bool,
) -> dict[str, str]:
    """TLS, SCRAM and ACL settings of a node whose ``scram_listeners`` (lower-case listener names) take
    SASL_SSL clients and whose other listeners take certificates only; the listeners themselves are the
    caller's (a local node's ports, a container's names). Shared by the local cluster and
    :mod:`rlbus.security.credentials` (docker-compose.secure.yml)."""
    settings = {
        "ssl.keystore.type": "PKCS12",
        "ssl.keystore.location": str(keystore),
        "ssl.keystore.password": keystore_password,
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(truststore),
        "ssl.client.auth": "required",
        "ssl.principal.mapping.rules": "RULE:^CN=([^,]+)$/$1/,DEFAULT",
        "sasl.enabled.mechanisms": "SCRAM-SHA-256,SCRAM-SHA-512",
        "authorizer.class.name": AUTHORIZER,
        "allow.everyone.if.no.acl.found": "false",
        "super.users": ";".join(f"User:{name}" for name in sorted(super_users)),
    }
    for listener in scram_listeners:
        settings[f"listener.name.{listener}.ssl.client.auth"] = "required" if mtls else "none"
        settings[f"listener.name.{listener}.scram-sha-256.sasl.jaas.config"] = SCRAM_LOGIN
        settings[f"listener.name.{listener}.scram-sha-512.sasl.jaas.config"] = SCRAM_LOGIN
    return settings
