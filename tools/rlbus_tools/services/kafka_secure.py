"""A secure local Kafka cluster: TLS on every listener, SCRAM for clients, ACLs for everything.

What ``rlbus kafka start --secure`` renders into each node's server.properties, and why:

* **No PLAINTEXT listener.** Three listeners per node: ``CLIENT`` (SASL_SSL, SCRAM-SHA-256/512; with
  ``mtls`` clients must also present a certificate from the cluster's CA), ``CONTROLLER`` and ``INTERNAL``
  (SSL with client certificates required). Brokers replicate over INTERNAL and reach the controllers over
  CONTROLLER, each authenticated by its own certificate (``CN=kafka-node-<i>``); the administrator reaches
  INTERNAL with ``CN=rlbus-admin``. A client that speaks PLAINTEXT to any port gets a TLS handshake failure.
* **Principals.** ``ssl.principal.mapping.rules`` maps ``CN=name`` to ``User:name``, so certificates and
  SCRAM users share one namespace of principals; the nodes and the administrator are ``super.users``. No
  SCRAM user is ever given a node's or the administrator's name (:mod:`rlbus.security.kafka_acl` refuses).
* **Authorization.** KRaft's ``StandardAuthorizer`` with ``allow.everyone.if.no.acl.found=false``: a
  principal may do only what an ACL allows. Roles get their ACLs from :mod:`rlbus.security.kafka_acl`.
* **Keys.** A local CA under ``<home>/kafka/tls`` (:class:`rlbus.security.tls.LocalCA`): each node's
  PKCS#12 keystore (its password in server.properties, mode 0600) and the CA as a PEM truststore.

Clients need the CA file (``[bus] ssl_cafile``), SASL_SSL and their SCRAM user; hostname verification
stays on (every certificate names 127.0.0.1 and localhost).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import TYPE_CHECKING

from rlbus.security.kafka_broker import ADMIN, node_principal, security_settings
from rlbus.security.tls import Issued, LocalCA

if TYPE_CHECKING:
    from rlbus_tools.services.kafka import KafkaCluster, KafkaNode

def reserved_principals(cluster: KafkaCluster) -> set[str]:
    """Names that are super users: no SCRAM user may take one."""
    return {ADMIN, *(node_principal(n.node_id) for n in cluster.nodes)}


def tls_dir(cluster: KafkaCluster) -> Path:
    return cluster.home / "kafka" / "tls"


def ca(cluster: KafkaCluster) -> LocalCA:
    return LocalCA(tls_dir(cluster), common_name=f"rlbus Kafka CA {cluster.cluster_id}")


def ca_file(cluster: KafkaCluster) -> Path:
    """The PEM file clients trust (``[bus] ssl_cafile``)."""
    return ca(cluster).cert


def issue_certificates(cluster: KafkaCluster) -> None:
    """The CA, one certificate per node (server and client: it is both) and the administrator's."""
    authority = ca(cluster).ensure()
    for node in cluster.nodes:
        authority.issue(node_principal(node.node_id), server=True, client=True)
    authority.issue(ADMIN, client=True)


def admin_certificate(cluster: KafkaCluster) -> Issued:
    return ca(cluster).issue(ADMIN, client=True)


def client_certificate(cluster: KafkaCluster, name: str) -> Issued:
    """A client certificate ``CN=name`` for an mTLS cluster (issued on first use)."""
    if name in reserved_principals(cluster):
        raise ValueError(f"{name!r} is a super user's principal: a client certificate may not take it")
    return ca(cluster).issue(name, client=True)


def secure_settings(cluster: KafkaCluster, node: KafkaNode, host: str) -> dict[str, str]:
    """The server.properties keys that make ``node`` (listening on ``host``) secure, replacing the
    template's listener keys."""
    keystore = ca(cluster).issue(node_principal(node.node_id), server=True, client=True)
    return {
        "listeners": (
            f"CLIENT://{host}:{node.port},CONTROLLER://{host}:{node.controller_port},"
            f"INTERNAL://{host}:{node.internal_port}"
        ),
        "advertised.listeners": f"CLIENT://{host}:{node.port},INTERNAL://{host}:{node.internal_port}",
        "listener.security.protocol.map": "CLIENT:SASL_SSL,CONTROLLER:SSL,INTERNAL:SSL",
        "inter.broker.listener.name": "INTERNAL",
        **security_settings(
            keystore=keystore.p12, keystore_password=keystore.password, truststore=ca_file(cluster),
            super_users=reserved_principals(cluster), scram_listeners=("client",), mtls=cluster.mtls,
        ),
    }


def admin_ssl_context(cluster: KafkaCluster) -> ssl.SSLContext:
    """Python's TLS context for the administrator (aiokafka, on the internal listener)."""
    admin = admin_certificate(cluster)
    context = ssl.create_default_context(cafile=str(ca_file(cluster)))
    context.load_cert_chain(str(admin.cert), str(admin.key))
    return context


def admin_java_properties(cluster: KafkaCluster) -> dict[str, str]:
    """The administrator's Java client properties (Kafka's Admin client, :mod:`rlbus_tools.services.kafka_admin`)."""
    admin = admin_certificate(cluster)
    return {
        "bootstrap.servers": cluster.internal_bootstrap or cluster.bootstrap,
        "security.protocol": "SSL",
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(ca_file(cluster)),
        "ssl.keystore.type": "PKCS12",
        "ssl.keystore.location": str(admin.p12),
        "ssl.keystore.password": admin.password,
    }


def admin_bus_file(cluster: KafkaCluster) -> Path:
    """A ``[bus]`` table with the administrator's certificate, for ``rlbus … --config`` (written on start)."""
    admin = admin_certificate(cluster)
    path = tls_dir(cluster) / "admin.bus.toml"
    path.write_text(
        "[bus]\n"
        'kind = "kafka"\n'
        f'bootstrap = "{cluster.internal_bootstrap}"\n'
        'security_protocol = "SSL"\n'
        f'ssl_cafile = "{ca_file(cluster)}"\n'
        f'ssl_certfile = "{admin.cert}"\n'
        f'ssl_keyfile = "{admin.key}"\n'
    )
    return path


def describe_secure(cluster: KafkaCluster) -> str:
    """What an operator needs to connect, for ``rlbus kafka start --secure``."""
    return "\n".join(
        [
            f"SASL_SSL (SCRAM{', client certificates required' if cluster.mtls else ''}) at {cluster.bootstrap}",
            f"CA certificate: {ca_file(cluster)}",
            f"administrator (mutual TLS) at {cluster.internal_bootstrap}: --config {admin_bus_file(cluster)}",
            "nothing is allowed without an ACL: `rlbus topics create --config <that file> --namespace NS --acls`",
            "creates a namespace's topics, one SCRAM user per role and the roles' ACLs",
        ]
    )
