"""docker-compose.yml and docker-compose.cluster.yml stay valid and say what docs/compose.md says they run;
the Kafka image's entrypoint turns the environment into broker properties as the official image does.

`docker compose config` needs a docker client (skipped only where none is installed; where the client lacks
the compose plugin, Debian's standalone ``docker-compose``, which .ci/run installs, does the validation).
Running the files for real is `rlbus bench compose` (`make compose-test`), which CI runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
CLUSTER_FILE = ROOT / "docker-compose.cluster.yml"
#: The distributed run's services and the role each runs.
WORKERS = {"trainer": "trainer", "rollout": "rollout", "rollout-us": "rollout", "reward": "reward",
           "prompts": "prompts"}
GATEWAYS = {"serve": "serve", "serve-us": "serve"}
RELAYS = {"relay-eu": "eu-west", "relay-us": "us-east"}
DEFAULT = {"kafka", "topics", "redis", "blobs", *RELAYS, *WORKERS}


def _compose_command() -> list[str]:
    if shutil.which("docker") is None:
        pytest.skip("no docker client installed")
    if subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.fail("the docker client has no compose: install the compose plugin or Debian's docker-compose")


def _compose(*args: str, files: tuple[Path, ...] = (COMPOSE_FILE,)) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("COMPOSE_PROFILES", "RLBUS_COMPOSE_KAFKA_PORT")}
    command = [*_compose_command(), *(a for f in files for a in ("-f", str(f))), *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False, timeout=60)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr}"
    return done.stdout


def _services(*args: str, files: tuple[Path, ...] = (COMPOSE_FILE,)) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(_compose(*args, "config", files=files))["services"]


@pytest.mark.parametrize("files", [(COMPOSE_FILE,), (COMPOSE_FILE, CLUSTER_FILE)], ids=["one-broker", "cluster"])
def test_compose_files_are_valid(files: tuple[Path, ...]) -> None:
    _compose("config", "-q", files=files)
    _compose("--profile", "serve", "config", "-q", files=files)


def test_up_runs_the_loop_and_the_gateway_is_a_profile() -> None:
    default = set(_compose("config", "--services").split())
    with_serve = set(_compose("--profile", "serve", "config", "--services").split())
    assert DEFAULT <= default and with_serve == default | set(GATEWAYS)
    # Compose v1 lists every service whatever the profile; v2 only the enabled ones: both end up here.
    assert default in (DEFAULT, DEFAULT | set(GATEWAYS))


def test_worker_services_run_one_role_each_with_the_mounted_config() -> None:
    services = _services("--profile", "serve")
    regions = {}
    for name, role in (WORKERS | GATEWAYS).items():
        service = services[name]
        assert service["command"][:3] == ["rlbus", "worker", role], name
        env = service["environment"]
        assert env["RLBUS_CONFIG"] == "/etc/rlbus/run.toml" and env["RLBUS_KAFKA_BOOTSTRAP"] == "kafka:19092"
        assert any(str(v).endswith("/etc/rlbus/run.toml:ro") for v in service["volumes"])
        assert "9400" in [str(p) for p in service["expose"]]
        assert not any("secret" in str(arg).lower() for arg in service["command"])  # secrets: environment only
        assert "/healthz" in " ".join(service["healthcheck"]["test"])  # open, unlike /metrics
        assert not service.get("privileged"), name
        regions[name] = env.get("RLBUS_REGION")
    assert regions["rollout"] and regions["rollout-us"] and regions["rollout"] != regions["rollout-us"]
    assert regions["serve"] and regions["serve-us"] and regions["serve"] != regions["serve-us"]
    assert "container_name" not in services["rollout"] and "ports" not in services["rollout"]  # --scale works
    assert services["blobs"]["command"][:3] == ["rlbus", "blobs", "serve"]
    relay_of = {region: name for name, region in RELAYS.items()}
    for name in RELAYS:
        command = services[name]["command"]
        assert command[:3] == ["rlbus", "blobs", "serve"] and command[command.index("--upstream") + 1] == (
            "http://blobs:8470")
    for name in ("rollout", "rollout-us", *GATEWAYS):  # a region's workers read through its relay
        env = services[name]["environment"]
        assert env["RLBUS_BLOB_URL"] == f"http://{relay_of[env['RLBUS_REGION']]}:8470", name
        assert env["RLBUS_BLOB_FALLBACK_URL"] == "http://blobs:8470", name
    assert services["trainer"]["environment"]["RLBUS_BLOB_URL"] == "http://blobs:8470"  # it writes to the origin
    for name in GATEWAYS:
        assert "8000" in [str(p) for p in services[name]["expose"]] and "ports" not in services[name]
        assert services[name]["environment"]["RLBUS_SERVE_TOKENS"]  # tokens from the environment, not the command


def _published(service: dict[str, Any]) -> list[str]:
    """host_ip of each published port (v1 and v2 render ports differently)."""
    out = []
    for port in service.get("ports", []):
        out.append(port.get("host_ip", "") if isinstance(port, dict) else str(port).rsplit(":", 2)[0])
    return out


def test_only_loopback_is_published_and_images_are_the_ones_make_images_builds() -> None:
    for files in ((COMPOSE_FILE,), (COMPOSE_FILE, CLUSTER_FILE)):
        services = _services("--profile", "serve", files=files)
        for name, service in services.items():
            assert all(ip == "127.0.0.1" for ip in _published(service)), (name, service.get("ports"))
            assert str(service["image"]).startswith("rlbus/"), name  # infra/images/build.sh's images


def test_cluster_file_makes_three_brokers_with_three_replicas_and_workers_bootstrap_from_all() -> None:
    services = _services("--profile", "serve", files=(COMPOSE_FILE, CLUSTER_FILE))
    brokers = {name: s["environment"] for name, s in services.items() if name in ("kafka", "kafka-2", "kafka-3")}
    assert sorted(env["KAFKA_NODE_ID"] for env in brokers.values()) == ["1", "2", "3"]
    assert {env["KAFKA_CONTROLLER_QUORUM_VOTERS"] for env in brokers.values()} == {
        "1@kafka:9093,2@kafka-2:9093,3@kafka-3:9093"}
    durability = {(e["KAFKA_DEFAULT_REPLICATION_FACTOR"], e["KAFKA_MIN_INSYNC_REPLICAS"]) for e in brokers.values()}
    assert durability == {("3", "2")}
    assert len({env["CLUSTER_ID"] for env in brokers.values()}) == 1
    assert "--replication" in services["topics"]["command"]
    for name in WORKERS | GATEWAYS:
        assert services[name]["environment"]["RLBUS_KAFKA_BOOTSTRAP"] == "kafka:19092,kafka-2:19092,kafka-3:19092"


def test_kafka_entrypoint_turns_the_environment_into_properties(tmp_path: Path) -> None:
    """The official image's convention ('_' → '.', '__' → '_', '___' → '-'), the JVM's own variables kept
    out, storage formatted only while it is empty, then exec of the broker."""
    fake = tmp_path / "bin"
    fake.mkdir()
    calls = tmp_path / "calls"
    (fake / "java").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (fake / "java").chmod(0o755)
    data = tmp_path / "data"
    env = {"PATH": f"{fake}:/usr/bin:/bin", "CLUSTER_ID": "Dk6djo5ETZaK5NdoBkjZyg", "KAFKA_NODE_ID": "2",
           "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "INTERNAL:PLAINTEXT", "KAFKA_SOME__UNDERSCORE": "u",
           "KAFKA_A___DASH": "d", "KAFKA_HEAP_OPTS": "-Xmx64m", "KAFKA_LOG_DIRS": str(data),
           "RLBUS_KAFKA_PROPERTIES": str(tmp_path / "server.properties")}
    entry = ROOT / "infra/kafka/entrypoint.sh"
    subprocess.run([str(entry)], env=env, check=True, timeout=30)
    properties = dict(line.split("=", 1) for line in (tmp_path / "server.properties").read_text().splitlines()
                      if line and not line.startswith("#"))
    assert properties == {"node.id": "2", "listener.security.protocol.map": "INTERNAL:PLAINTEXT",
                          "some_underscore": "u", "a-dash": "d", "log.dirs": str(data)}
    format_call, start_call = calls.read_text().splitlines()
    assert "-Xmx64m" in format_call and "kafka.tools.StorageTool format -t Dk6djo5ETZaK5NdoBkjZyg" in format_call
    assert start_call.endswith(f"kafka.Kafka {tmp_path / 'server.properties'}")
    # formatted already (meta.properties there): straight to the broker
    data.mkdir()
    (data / "meta.properties").write_text("cluster.id=Dk6djo5ETZaK5NdoBkjZyg\n")
    calls.unlink()
    subprocess.run([str(entry)], env=env, check=True, timeout=30)
    assert [c.split()[-2] for c in calls.read_text().splitlines()] == ["kafka.Kafka"]
    missing = subprocess.run([str(entry)], env={**env, "CLUSTER_ID": ""}, capture_output=True, text=True, check=False)
    assert missing.returncode != 0 and "CLUSTER_ID" in missing.stderr


SECURE_FILE = ROOT / "docker-compose.secure.yml"


def test_secure_file_gives_every_service_only_its_own_credentials() -> None:
    """docker-compose.secure.yml: one secrets volume per consumer, mounted read-only by that consumer alone
    (the CA's by the issuing one-shot only); no secret left in any service's environment; no PLAINTEXT
    listener; workers start after the administrator made the topics and the ACLs."""
    files = (COMPOSE_FILE, SECURE_FILE)
    _compose("--profile", "serve", "config", "-q", files=files)
    services = _services("--profile", "serve", files=files)
    # the relays verify the workers' keys, minted from the blob master: they hold it, like the origin
    own = {"kafka": "kafka", "topics": "admin", "acls": "acl", "redis": "redis", "blobs": "blobs",
           **dict.fromkeys(RELAYS, "blobs"), **{name: role for name, role in (WORKERS | GATEWAYS).items()}}
    for name, service in services.items():
        mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}:{'ro' if v.get('read_only') else 'rw'}"
                  for v in service.get("volumes", [])]
        secret_mounts = [m for m in mounts if "secrets-" in m]
        if name == "secrets":
            assert any("secrets-ca:" in m for m in secret_mounts) and service["user"] == "0:0"
            continue
        assert [m.split("secrets-")[1].split(":")[0] for m in secret_mounts] == [own[name]], (name, secret_mounts)
        assert all(m.endswith(":ro") for m in secret_mounts), name
        env = service.get("environment") or {}
        assert not env.get("RLBUS_BLOB_SECRET") and not env.get("RLBUS_REDIS_URL"), name
    kafka = services["kafka"]["environment"]
    assert "PLAINTEXT" not in kafka["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].replace("SASL_SSL", "")
    assert kafka["RLBUS_KAFKA_EXTRA_PROPERTIES"] == "/run/secrets/rlbus/kafka.properties"
    for name in (*WORKERS, *GATEWAYS):
        env = services[name]["environment"]
        assert env["RLBUS_BUS_CONFIG"] == "/run/secrets/rlbus/bus.toml"
        assert env["RLBUS_REDIS_URL_FILE"] and env["RLBUS_BLOB_SECRET_FILE"]
        assert {"acls", "topics"} <= set(services[name]["depends_on"]), name
    assert services["topics"]["command"][-1] == "/run/secrets/rlbus/admin.bus.toml"
    assert "--tls-port" in services["redis"]["command"] and "--aclfile" in services["redis"]["command"]


def test_kafka_entrypoint_appends_the_extra_properties_file(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "java").write_text("#!/bin/sh\nexit 0\n")
    (fake / "java").chmod(0o755)
    extra = tmp_path / "node.properties"
    extra.write_text("ssl.keystore.password=s3cret\n")
    config = tmp_path / "server.properties"
    env = {"PATH": f"{fake}:/usr/bin:/bin", "CLUSTER_ID": "Dk6djo5ETZaK5NdoBkjZyg", "KAFKA_NODE_ID": "1",
           "KAFKA_LOG_DIRS": str(tmp_path / "data"), "RLBUS_KAFKA_PROPERTIES": str(config),
           "RLBUS_KAFKA_EXTRA_PROPERTIES": str(extra), "KAFKA_HEALTHCHECK_PORT": "19093"}
    subprocess.run([str(ROOT / "infra/kafka/entrypoint.sh")], env=env, check=True, timeout=30)
    lines = [line for line in config.read_text().splitlines() if line and not line.startswith("#")]
    assert lines == ["log.dirs=" + str(tmp_path / "data"), "node.id=1", "ssl.keystore.password=s3cret"]
    assert config.stat().st_mode & 0o777 == 0o600  # the keystore's password is in it
