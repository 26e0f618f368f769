"""`rlbus secrets issue`: each consumer's directory holds its own credentials and nothing else, files are
private, a second run reissues nothing, and what the directories say agrees (SCRAM passwords with the
Admin request, Redis URLs with the ACL file, blob keys with the master)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from rlbus.blobs.keys import KeyClaims, is_scoped
from rlbus.config import KafkaBusConfig, parse
from rlbus.security import credentials, kafka_acl, redis_acl

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl (Debian: openssl)")

ROLES = credentials.ROLE_DIRS


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("secrets")
    credentials.issue(root, brokers=("kafka", "kafka-2"))
    return root


def _files(directory: Path) -> dict[str, str]:
    return {p.name: p.read_bytes().decode(errors="replace") for p in directory.iterdir()}


def test_every_file_is_private_and_the_ca_key_stays_in_its_own_directory(out: Path) -> None:
    for directory in out.iterdir():
        assert directory.stat().st_mode & 0o777 == 0o700, directory
        if directory.name == "ca":
            continue
        for path in directory.iterdir():
            assert path.stat().st_mode & 0o777 == 0o600, path
            assert "PRIVATE KEY" not in path.read_text(errors="replace") or path.name.endswith(".key"), path
        assert not any(p.name == "ca.key" for p in directory.iterdir())
    ca_key = (out / "ca/tls/ca.key").read_text()
    assert not any(ca_key in text for d in out.iterdir() if d.name != "ca" for text in _files(d).values())


def test_a_role_holds_only_its_own_secrets(out: Path) -> None:
    passwords = {role: (out / role / "kafka.password").read_text().strip() for role in ROLES}
    assert len(set(passwords.values())) == len(ROLES)
    for role in ROLES:
        others = [p for r, p in passwords.items() if r != role]
        for text in _files(out / role).values():
            assert not any(p in text for p in others), role
    for name in ("kafka", "redis", "blobs", "admin", "acl"):
        assert not any(p in text for text in _files(out / name).values() for p in passwords.values()
                       if name != "acl"), name


def test_bus_files_are_sasl_ssl_as_the_roles_principal(out: Path) -> None:
    for role in ROLES:
        table = tomllib.loads((out / role / "bus.toml").read_text())["bus"]
        table.pop("kind")
        config = parse(KafkaBusConfig, table, prefix="bus")
        assert config.security_protocol == "SASL_SSL" and config.sasl_mechanism == "SCRAM-SHA-512"
        assert config.sasl_username == kafka_acl.principal("", credentials.KAFKA_PRINCIPAL[role])
        assert config.bootstrap == "kafka:19093,kafka-2:19093"
        assert config.sasl_password is None and config.sasl_password_file == str(credentials.MOUNT / "kafka.password")


def test_the_admin_request_creates_each_roles_user_with_its_password_and_the_role_table_acls(out: Path) -> None:
    request = json.loads((out / "acl/kafka-request.json").read_text())
    users = {row["user"]: row["password"] for row in request["scram"]}
    for role in ROLES:
        principal = kafka_acl.principal("", credentials.KAFKA_PRINCIPAL[role])
        assert users[principal] == (out / role / "kafka.password").read_text().strip()
    expected = kafka_acl.bindings("", sorted(set(credentials.KAFKA_PRINCIPAL.values())))
    assert [kafka_acl.AclBinding(**row) for row in request["acls"]] == expected
    assert request["client"]["bootstrap.servers"] == "kafka:19092,kafka-2:19092"
    assert request["client"]["security.protocol"] == "SSL"


def test_brokers_get_their_own_certificate_and_no_plaintext_anywhere(out: Path) -> None:
    for node, host in enumerate(("kafka", "kafka-2"), start=1):
        properties = dict(line.split("=", 1) for line in (out / "kafka" / f"{host}.properties").read_text().splitlines()
                          if line and not line.startswith("#"))
        assert properties["ssl.keystore.location"] == f"/run/secrets/rlbus/{host}.p12"
        assert properties["allow.everyone.if.no.acl.found"] == "false"
        assert properties["super.users"] == "User:kafka-node-1;User:kafka-node-2;User:rlbus-admin"
        assert properties["listener.name.client.ssl.client.auth"] == "none"  # SCRAM authenticates clients
        assert "PLAINTEXT" not in "".join(properties.values())
        cert = out / f"ca/tls/kafka-node-{node}.pem"
        names = subprocess.run(["openssl", "x509", "-in", str(cert), "-noout", "-ext", "subjectAltName"],
                               capture_output=True, text=True, check=True).stdout
        assert f"DNS:{host}" in names and "IP Address:127.0.0.1" in names


def test_redis_users_match_the_role_urls_and_the_default_user_is_off(out: Path) -> None:
    acl = (out / "redis/users.acl").read_text().splitlines()
    assert "user default off resetchannels -@all" in acl
    hashes = {line.split()[1]: next(w for w in line.split() if w.startswith("#"))
              for line in acl if line.startswith("user ") and "#" in line}
    for role in ROLES:
        url = (out / role / "redis.url").read_text().strip()
        assert url.startswith("rediss://") and url.endswith("?ssl_ca_certs=/run/secrets/rlbus/ca.pem")
        user = redis_acl.url_user(url)
        assert user == redis_acl.username(credentials.REDIS_ROLE[role])
        password = url.split("@")[0].rsplit(":", 1)[1]
        assert hashes[user] == "#" + redis_acl.password_hash(password)
    health = (out / "redis/health.password").read_text().strip()
    assert f"user {credentials.HEALTH_USER} on #{redis_acl.password_hash(health)} resetchannels -@all +ping" in acl


def test_only_the_trainer_holds_the_blob_master(out: Path) -> None:
    master = (out / "blobs/blob.secret").read_text().strip()
    keys = {role: (out / role / "blob.secret").read_text().strip() for role in ROLES}
    assert keys["trainer"] == master and not is_scoped(master)
    for role in ("rollout", "serve"):
        claims = KeyClaims.decode(keys[role].split(".")[1])
        assert claims.write_prefix == "claims/" and claims.expires is not None
    for role in ("reward", "prompts"):
        assert KeyClaims.decode(keys[role].split(".")[1]).permissions == frozenset({"read"})
    assert "write" not in KeyClaims.decode(keys["operator"].split(".")[1]).permissions


def test_a_second_run_reissues_nothing(out: Path) -> None:
    before = {p: p.read_bytes() for d in ("ca", "kafka", "trainer") for p in (out / d).rglob("*") if p.is_file()}
    credentials.issue(out, brokers=("kafka", "kafka-2"))
    after = {p: p.read_bytes() for p in before}
    assert after == before


def test_a_bad_namespace_fails_before_any_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        credentials.issue(tmp_path / "x", namespace="once")
    assert not (tmp_path / "x").exists()
