"""Least privilege on a real secure 3-broker cluster: every attempt to get in is refused, typed and logged;
every role can still do its job.

The module starts its own cluster (``kafka.start(secure=True, mtls=True)``: TLS on every listener, SCRAM +
client certificates for clients, the StandardAuthorizer with nothing allowed by default) on free ports in a
temporary home, about 45 s on two cores, and gives two namespaces their roles' users and ACLs with Kafka's
own Admin client. The refusal matrix is :data:`rlbus_tools.chaos.intrusion.ATTEMPTS` (the same list
``rlbus bench bus --security tls-scram`` runs). Fails, never skips, when Kafka or Redis cannot start.
"""

from __future__ import annotations

import asyncio
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlbus.bus.topics import PROMPTS, REWARDS, ROLLOUTS, WEIGHTS
from rlbus.cli.app import app
from rlbus.config import build_bus
from rlbus.errors import BusForbidden
from rlbus.security.kafka_acl import bindings
from rlbus_tools.chaos import intrusion
from rlbus_tools.services import kafka
from rlbus_tools.services.kafka_admin import describe_acls

pytestmark = pytest.mark.kafka


class _Loop:
    """One event loop in a thread for the module: the rig's async context stays open across tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 300):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[tuple[intrusion.Rig, _Loop]]:
    loop = _Loop()
    home = tmp_path_factory.mktemp("secure-kafka")
    context = intrusion.secure_cluster(brokers=3, mtls=True, home=home)
    try:
        prepared = loop.run(context.__aenter__())
        yield prepared, loop
    finally:
        loop.run(context.__aexit__(None, None, None))
        loop.close()


@pytest.fixture(scope="module")
def outcomes(rig: tuple[intrusion.Rig, _Loop], redis_url: str) -> dict[str, intrusion.AttemptOutcome]:
    prepared, loop = rig
    results = loop.run(intrusion.run_matrix(prepared, redis_admin_url=redis_url))
    return {f"{o.who}: {o.what}": o for o in results}


@pytest.mark.parametrize("index", range(len(intrusion.ATTEMPTS)), ids=[a.__name__ for a in intrusion.ATTEMPTS])
def test_every_attempt_is_refused_typed_unwritten_and_logged(
    outcomes: dict[str, intrusion.AttemptOutcome], index: int
) -> None:
    outcome = list(outcomes.values())[index]
    assert outcome.refused, f"{outcome.who} could {outcome.what}: {outcome.error}"
    assert not outcome.error.startswith("untyped"), outcome.error
    assert outcome.written in (None, False), f"{outcome.what} wrote something"
    assert outcome.logged in (None, True), f"{outcome.who}: {outcome.what} was refused but not logged"


def test_the_matrix_covers_kafka_blobs_redis_and_endpoints(outcomes: dict[str, intrusion.AttemptOutcome]) -> None:
    assert len(outcomes) == len(intrusion.ATTEMPTS)
    errors = " ".join(o.error for o in outcomes.values())
    for typed in ("BusForbidden", "BusAuthError", "BlobAuthError", "NoPermissionError", "HTTP 401", "ConfigError"):
        assert typed in errors


def test_each_role_can_do_its_job(rig: tuple[intrusion.Rig, _Loop]) -> None:
    """The ACLs are least privilege, not no privilege: the real paths of each role work."""
    prepared, loop = rig
    ns = intrusion.NAMESPACES[0]

    def name(topic: str) -> str:
        return f"{ns}.{topic}"

    async def produce(role: str, topic: str) -> None:
        async with build_bus(prepared.bus_config(ns, role)) as bus:
            await bus.send_raw(name(topic), f"from {role}".encode(), key=role.encode())

    async def consume(role: str, topic: str, group: str | None) -> int:
        seen = 0
        async with build_bus(prepared.bus_config(ns, role)) as bus:
            async with bus.consumer([name(topic)], group=group, from_beginning=True) as consumer:
                for _ in range(40):
                    records = await consumer.getmany(timeout_s=0.5)
                    for record in records:
                        consumer.mark(record)
                    seen += len(records)
                    if seen:
                        break
                if group is not None:
                    await consumer.commit()
        return seen

    async def job() -> None:
        await produce("producer", PROMPTS.name)
        assert await consume("rollout", PROMPTS.name, f"{ns}.rollout") >= 1
        await produce("rollout", ROLLOUTS.name)
        assert await consume("reward", ROLLOUTS.name, f"{ns}.reward-verifier") >= 1
        await produce("reward", REWARDS.name)
        assert await consume("trainer", REWARDS.name, f"{ns}.trainer") >= 1
        await produce("trainer", WEIGHTS.name)
        assert await consume("rollout", WEIGHTS.name, None) >= 1
        await produce("gateway", REWARDS.name)
        # The trainer dead-letters a bad rollout; the operator reads the dead letter and redrives it.
        async with build_bus(prepared.bus_config(ns, "trainer")) as bus:
            await bus.send_raw(name(ROLLOUTS.name) + ".dlq", b"poison", key=b"k")
        assert await consume("operator", ROLLOUTS.name + ".dlq", f"{ns}.operator") >= 1
        await produce("operator", ROLLOUTS.name)
        # …while the rollout worker may not dead-letter the trainer's inputs.
        with pytest.raises(BusForbidden):
            async with build_bus(prepared.bus_config(ns, "rollout")) as bus:
                await bus.send_raw(name(REWARDS.name) + ".dlq", b"poison", key=b"k")

    loop.run(job())


def test_acls_are_what_the_role_table_says(rig: tuple[intrusion.Rig, _Loop]) -> None:
    prepared, _ = rig
    held = set(describe_acls(kafka.admin_client_properties(prepared.cluster)))
    for namespace in intrusion.NAMESPACES:
        wanted = set(bindings(namespace))
        assert wanted <= held, sorted(wanted - held)[:3]
    # No role outside the operator holds anything PREFIXED beyond its reward-group family, or any wildcard.
    for acl in held:
        assert acl.name != "*"
        if acl.pattern == "PREFIXED":
            assert acl.principal.endswith((".operator", ".reward")), acl


def test_credentials_are_private_files_without_passwords_in_the_bus_table(rig: tuple[intrusion.Rig, _Loop]) -> None:
    prepared, _ = rig
    directory = prepared.credentials[intrusion.NAMESPACES[0]]
    for path in directory.glob("*.password"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        secret = path.read_text().strip()
        bus_table = (directory / path.name.replace(".password", ".bus.toml")).read_text()
        assert secret not in bus_table
        assert "SASL_SSL" in bus_table and "ssl_certfile" in bus_table  # the cluster requires client certificates


def test_topics_create_with_acls_from_the_cli(rig: tuple[intrusion.Rig, _Loop], tmp_path: Path) -> None:
    prepared, _ = rig
    admin_config = prepared.cluster.home / "kafka" / "tls" / "admin.bus.toml"
    assert admin_config.is_file()
    result = CliRunner().invoke(app, [
        "topics", "create", "--config", str(admin_config), "--namespace", "intr-c", "--replication", "3",
        "--acls", "--credentials", str(tmp_path / "creds"), "--home", str(prepared.cluster.home),
    ])
    assert result.exit_code == 0, result.output
    assert "intr-c.rl.weights.v1" in result.output
    for role in ("trainer", "rollout", "reward", "producer", "gateway", "operator"):
        assert f"User:intr-c.{role}" in result.output
        assert (tmp_path / "creds" / f"{role}.bus.toml").is_file()


def test_secrets_probe_with_a_rollout_credential_is_refused_everything(rig: tuple[intrusion.Rig, _Loop]) -> None:
    """`rlbus secrets probe` (what a deployed container runs against itself): with a rollout worker's own
    credential every Kafka attempt of rlbus/security/probe.py is refused with the typed error."""
    import tomllib

    from rlbus.launch.config import config_from_dict
    from rlbus.security.probe import probe

    prepared, loop = rig
    ns = intrusion.NAMESPACES[0]
    bus = tomllib.loads((prepared.credentials[ns] / "rollout.bus.toml").read_text())["bus"]
    config = config_from_dict({"run": {"namespace": ns}, "bus": bus, "state": {"url": "memory://"}}, environ={})
    found = loop.run(probe(config))
    assert [o.what for o in found] == [
        f"produce to {ns}.{WEIGHTS.name}", f"join consumer group {ns}.trainer", found[2].what,
        "log in with a wrong password", "speak SASL_PLAINTEXT to the TLS listener",
        "connect trusting another CA (man in the middle)"]
    for outcome in found:
        assert outcome.refused and not outcome.error.startswith("untyped"), (outcome.what, outcome.error)
