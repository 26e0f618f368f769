"""A container deployment's credentials, issued into one directory per consumer (``rlbus secrets issue``).

``docker compose -f docker-compose.yml -f docker-compose.secure.yml up`` (and a Kubernetes job the same way)
runs this once, as root, in a one-shot container that mounts one volume per consumer; every service then
mounts only its own volume, read-only, at :data:`MOUNT`. So a rollout container holds the rollout role's
Kafka password, Redis URL and blob key and nothing else: not the CA's key, not the trainer's blob master,
not another role's password. What each directory holds (every file mode 0600, owned by the uid that reads it):

==========  =====================================================================================================
directory   files
==========  =====================================================================================================
``ca``      the CA and its key, every issued certificate, the passwords (kept: a second run reissues nothing)
``kafka``   ``ca.pem``; per broker ``<host>.p12`` and ``<host>.properties`` (its keystore, the CA, the TLS,
            SCRAM and ACL settings: :func:`rlbus_tools.services.kafka_broker.security_settings`), appended to the
            broker's properties by ``infra/kafka/entrypoint.sh``
``admin``   ``ca.pem``; the administrator's certificate (``CN=rlbus-admin``, a super user, mTLS on the
            INTERNAL listener) and ``admin.bus.toml``, for ``rlbus topics create --config`` (the rlbus image)
``acl``     the same certificate as a keystore and ``kafka-request.json``: the roles' SCRAM users and ACLs
            for Kafka's Admin client (``infra/kafka/SecurityAdmin.java``, run in the Kafka image)
``redis``   ``ca.pem``; ``redis.pem``/``redis.key``; ``users.acl`` (one user per role,
            :mod:`rlbus.security.redis_acl`, passwords as SHA-256, the default user off); ``health.password``
``blobs``   ``blob.secret``: the blob server's master secret
role        ``ca.pem``; ``bus.toml`` (``RLBUS_BUS_CONFIG``: SASL_SSL, the role's SCRAM user,
            ``kafka.password``); ``redis.url`` (``RLBUS_REDIS_URL_FILE``: ``rediss://`` as the role's user);
            ``blob.secret`` (``RLBUS_BLOB_SECRET_FILE``: the trainer's is the master, the others scoped keys,
            :func:`rlbus.blobs.keys.fleet_keys`)
==========  =====================================================================================================

Roles are the directories ``trainer``, ``rollout``, ``reward``, ``prompts``, ``serve`` and ``operator``; their
Kafka principals (:data:`KAFKA_PRINCIPAL`) and ACLs are :mod:`rlbus.security.kafka_acl`'s. Broker certificates
name the broker's host (``kafka``, ``kafka-2`` …) and ``127.0.0.1``/``localhost`` (the published loopback
port), so hostname verification stays on everywhere.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rlbus.errors import ConfigError
from rlbus.security import kafka_acl, kafka_broker, redis_acl
from rlbus.security.tls import LocalCA

#: Where every service mounts its own directory.
MOUNT = Path("/run/secrets/rlbus")
#: A role's directory → its Kafka principal's role (`rlbus.security.kafka_acl.ROLES`).
KAFKA_PRINCIPAL = {"trainer": "trainer", "rollout": "rollout", "reward": "reward", "prompts": "producer",
                   "serve": "gateway", "operator": "operator"}
#: A role's directory → its Redis user's role (`rlbus.security.redis_acl.ROLES`).
REDIS_ROLE = {"trainer": "trainer", "rollout": "rollout", "reward": "reward", "prompts": "prompts",
              "serve": "serve", "operator": "operator"}
ROLE_DIRS = tuple(KAFKA_PRINCIPAL)
#: The uid that reads each directory (the images' users: Dockerfile, infra/kafka, infra/redis).
RLBUS_UID, KAFKA_UID, REDIS_UID = 10001, 1000, 6379
HEALTH_USER = "rlbus-health"


@dataclass(frozen=True)
class Topology:
    """Where the services are, as the containers name them."""

    brokers: tuple[str, ...] = ("kafka",)
    #: The brokers' SASL_SSL listener for the roles (containers), and their mTLS one for the administrator.
    client_port: int = 19093
    internal_port: int = 19092
    redis: str = "redis:6379"
    namespace: str = ""
    blob_key_ttl: str = "30d"

    @property
    def client_bootstrap(self) -> str:
        return ",".join(f"{host}:{self.client_port}" for host in self.brokers)

    @property
    def internal_bootstrap(self) -> str:
        return ",".join(f"{host}:{self.internal_port}" for host in self.brokers)


class Issuer:
    """Issues (or, on a second run, reissues nothing and rewrites) every consumer's directory under ``out``."""

    def __init__(self, out: Path, topology: Topology, *, chown: bool = False) -> None:
        if not topology.brokers:
            raise ConfigError("brokers", "name at least one broker host")
        redis_acl.role_rules("rollout", topology.namespace)  # a bad namespace fails before any file is written
        self.out = out
        self.topology = topology
        self.chown = chown
        self.private = out / "ca"
        self.ca = LocalCA(self.private / "tls", common_name="rlbus deployment CA")

    def issue(self) -> list[Path]:
        """Write every directory; returns them."""
        self.private.mkdir(parents=True, exist_ok=True)
        os.chmod(self.private, 0o700)
        self.ca.ensure()
        return [self._kafka(), self._admin(), self._acl(), self._redis(), self._blobs(),
                *(self._role(r) for r in ROLE_DIRS)]

    # --- helpers -------------------------------------------------------------------------------------------
    def _secret(self, name: str, make: str | None = None) -> str:
        """A secret kept in the private directory: the same on every run."""
        path = self.private / "secrets" / name
        if not path.is_file():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.touch(mode=0o600)
            path.write_text((make or secrets.token_urlsafe(24)) + "\n")
        return path.read_text().strip()

    def _dir(self, name: str) -> Path:
        directory = self.out / name
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        shutil.copyfile(self.ca.cert, directory / "ca.pem")
        return directory

    def _finish(self, directory: Path, uid: int) -> Path:
        for path in directory.iterdir():
            os.chmod(path, 0o600)
            if self.chown:
                os.chown(path, uid, uid)
        if self.chown:
            os.chown(directory, uid, uid)
        return directory

    def _bus_file(self, role: str) -> str:
        user = kafka_acl.principal(self.topology.namespace, KAFKA_PRINCIPAL[role])
        return kafka_acl.bus_snippet(self.topology.client_bootstrap, user, MOUNT / "kafka.password", MOUNT / "ca.pem")

    # --- the consumers -------------------------------------------------------------------------------------
    def _kafka(self) -> Path:
        directory = self._dir("kafka")
        nodes = range(1, len(self.topology.brokers) + 1)
        supers = {kafka_broker.ADMIN, *(kafka_broker.node_principal(i) for i in nodes)}
        for node_id, host in enumerate(self.topology.brokers, start=1):
            issued = self.ca.issue(kafka_broker.node_principal(node_id), server=True, client=True,
                                   hosts=(host, "localhost", "127.0.0.1"))
            shutil.copyfile(issued.p12, directory / f"{host}.p12")
            settings = kafka_broker.security_settings(
                keystore=MOUNT / f"{host}.p12", keystore_password=issued.password, truststore=MOUNT / "ca.pem",
                super_users=supers, scram_listeners=("client", "external"), mtls=False,
            )
            (directory / f"{host}.properties").write_text(
                f"# {host}: written by `rlbus secrets issue` (rlbus/security/credentials.py)\n"
                + "".join(f"{key}={value}\n" for key, value in sorted(settings.items()))
            )
        return self._finish(directory, KAFKA_UID)

    def _admin(self) -> Path:
        directory = self._dir("admin")
        admin = self.ca.issue(kafka_broker.ADMIN, client=True)
        shutil.copyfile(admin.cert, directory / admin.cert.name)
        shutil.copyfile(admin.key, directory / admin.key.name)
        (directory / "admin.bus.toml").write_text(
            "[bus]\n"
            'kind = "kafka"\n'
            f'bootstrap = "{self.topology.internal_bootstrap}"\n'
            'security_protocol = "SSL"\n'
            f'ssl_cafile = "{MOUNT / "ca.pem"}"\n'
            f'ssl_certfile = "{MOUNT / admin.cert.name}"\n'
            f'ssl_keyfile = "{MOUNT / admin.key.name}"\n'
        )
        return self._finish(directory, RLBUS_UID)

    def _acl(self) -> Path:
        directory = self._dir("acl")
        admin = self.ca.issue(kafka_broker.ADMIN, client=True)
        shutil.copyfile(admin.p12, directory / admin.p12.name)
        users = {kafka_acl.principal(self.topology.namespace, KAFKA_PRINCIPAL[role]): self._secret(f"kafka-{role}")
                 for role in ROLE_DIRS}
        request = {
            "client": {
                "bootstrap.servers": self.topology.internal_bootstrap, "security.protocol": "SSL",
                "ssl.truststore.type": "PEM", "ssl.truststore.location": str(MOUNT / "ca.pem"),
                "ssl.keystore.type": "PKCS12", "ssl.keystore.location": str(MOUNT / admin.p12.name),
                "ssl.keystore.password": admin.password,
            },
            "scram": [{"user": user, "mechanism": kafka_acl.MECHANISM, "iterations": 8192, "password": password}
                      for user, password in sorted(users.items())],
            "acls": [asdict(b) for b in kafka_acl.bindings(self.topology.namespace,
                                                           sorted(set(KAFKA_PRINCIPAL.values())))],
        }
        (directory / "kafka-request.json").write_text(json.dumps(request, indent=1) + "\n")
        return self._finish(directory, KAFKA_UID)

    def _redis(self) -> Path:
        directory = self._dir("redis")
        host = self.topology.redis.rpartition(":")[0]
        issued = self.ca.issue("redis", server=True, client=False, hosts=(host, "localhost", "127.0.0.1"))
        shutil.copyfile(issued.cert, directory / "redis.pem")
        shutil.copyfile(issued.key, directory / "redis.key")
        health = self._secret("redis-health")
        (directory / "health.password").write_text(health + "\n")
        lines = ["user default off resetchannels -@all",  # an ACL file has no comments
                 f"user {HEALTH_USER} on #{redis_acl.password_hash(health)} resetchannels -@all +ping"]
        for role in sorted(set(REDIS_ROLE.values()) | {"observer"}):
            rules = redis_acl.role_rules(role, self.topology.namespace)
            password = self._secret(f"redis-{role}")
            lines.append(f"user {rules.username} {' '.join(rules.args())} #{redis_acl.password_hash(password)}")
        (directory / "users.acl").write_text("\n".join(lines) + "\n")
        return self._finish(directory, REDIS_UID)

    def _blobs(self) -> Path:
        directory = self._dir("blobs")
        (directory / "blob.secret").write_text(self._master() + "\n")
        return self._finish(directory, RLBUS_UID)

    def _master(self) -> str:
        return self._secret("blob-master", "rlbus-blob-" + secrets.token_urlsafe(32))

    def _role(self, role: str) -> Path:
        from rlbus.blobs.keys import fleet_keys, mint_for_role

        directory = self._dir(role)
        (directory / "kafka.password").write_text(self._secret(f"kafka-{role}") + "\n")
        (directory / "bus.toml").write_text(self._bus_file(role))
        redis_role = REDIS_ROLE[role]
        user = redis_acl.username(redis_role, self.topology.namespace)
        url = f"rediss://{self.topology.redis}/0?ssl_ca_certs={MOUNT / 'ca.pem'}"
        (directory / "redis.url").write_text(redis_acl.role_url(url, user, self._secret(f"redis-{redis_role}")) + "\n")
        keys = fleet_keys(self._master(), ttl=self.topology.blob_key_ttl)
        key = keys.get(role) or mint_for_role(self._master(), "operator", ttl=self.topology.blob_key_ttl)
        (directory / "blob.secret").write_text(key + "\n")
        return self._finish(directory, RLBUS_UID)


def issue(out: Path, *, brokers: Sequence[str] = ("kafka",), redis: str = "redis:6379", namespace: str = "",
          chown: bool = False) -> list[Path]:
    """Issue a deployment's credentials under ``out`` (see the module docstring)."""
    return Issuer(out, Topology(brokers=tuple(brokers), redis=redis, namespace=namespace), chown=chown).issue()
