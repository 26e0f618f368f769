"""``rlbus kafka grant``: the roles of a namespace get their SCRAM users and ACLs on the local secure cluster.

The ACLs are :mod:`rlbus.security.kafka_acl`'s (what each role may do); this module applies them with Kafka's Admin
client (:mod:`rlbus_tools.services.kafka_admin`) and writes each role's credential where a worker reads it.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from pathlib import Path

from rlbus.errors import ConfigError
from rlbus.security.kafka_acl import MECHANISM, ROLES, RoleCredential, bindings, bus_snippet, principal
from rlbus_tools.services import kafka
from rlbus_tools.services.kafka_admin import create_acls, upsert_scram_users
from rlbus_tools.services.kafka_secure import ca_file, client_certificate, reserved_principals


def grant(
    cluster: object,
    namespace: str,
    out_dir: Path,
    *,
    roles: Sequence[str] = ROLES,
    rotate: bool = False,
) -> list[RoleCredential]:
    """Create (or update) the SCRAM users and ACLs of ``roles`` in ``namespace`` on a secure ``cluster``
    (a :class:`rlbus_tools.services.kafka.KafkaCluster`), and write their credentials under ``out_dir``.

    A role's password is kept in ``out_dir/<role>.password`` and reused, unless ``rotate``. The ACLs are
    added (adding an existing one is a no-op), so running it twice changes nothing.
    """
    assert isinstance(cluster, kafka.KafkaCluster)
    if not cluster.secure:
        raise ConfigError("secure", f"the cluster under {cluster.home} is not secure: start it with --secure")
    out_dir.mkdir(parents=True, exist_ok=True)
    out_dir.chmod(0o700)
    users: dict[str, str] = {}
    credentials = []
    for role in roles:
        user = principal(namespace, role)
        if user in reserved_principals(cluster):
            raise ConfigError("namespace", f"the principal {user!r} would be a super user's")
        password_file = out_dir / f"{role}.password"
        if rotate or not password_file.is_file():
            password_file.touch(mode=0o600)
            password_file.write_text(secrets.token_urlsafe(24) + "\n")
        users[user] = password_file.read_text().strip()
        bus_file = out_dir / f"{role}.bus.toml"
        certificate = client_certificate(cluster, user) if cluster.mtls else None
        bus_file.write_text(bus_snippet(cluster.bootstrap, user, password_file, ca_file(cluster), certificate))
        credentials.append(RoleCredential(role, user, password_file, bus_file))
    admin = kafka.admin_client_properties(cluster)
    upsert_scram_users(admin, users, mechanism=MECHANISM)
    create_acls(admin, bindings(namespace, roles))
    return credentials
