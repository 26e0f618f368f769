"""Kafka with SASL/SCRAM end to end, and secrets that never show up on a command line, a repr or a log.

Starts its own one-broker cluster with a SASL_PLAINTEXT (SCRAM-SHA-512) listener in a temporary home
on free ports (about 15-20 s on two cores), creates a user through the admin API, and runs the
KafkaBus against it: produce and consume with the right password, a typed BusAuthError with a wrong
one. Fails, never skips, when Kafka cannot start.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.pretty import pretty_repr

from rlbus.bus.kafka import KafkaSettings
from rlbus.bus.types import TopicSpec
from rlbus.config import KafkaBusConfig, build_bus, parse, secret_from
from rlbus.errors import BusAuthError, ConfigError
from rlbus_tools.services import free_port, free_port_pair, kafka

USER = "rlbus-worker"


@pytest.fixture(scope="module")
def sasl_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[kafka.KafkaCluster, str]]:
    home = tmp_path_factory.mktemp("sasl-kafka")
    password = uuid.uuid4().hex
    try:
        cluster = kafka.start(
            brokers=1, port=free_port_pair(), home=home, timeout_s=120, sasl_port=free_port(),
            scram_users={USER: password},
        )
        yield cluster, password
    finally:
        kafka.stop(home, grace_s=10)


def _config(cluster: kafka.KafkaCluster, **fields: str) -> KafkaBusConfig:
    assert cluster.sasl_bootstrap is not None
    data = {
        "bootstrap": cluster.sasl_bootstrap,
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": USER,
        **fields,
    }
    config: KafkaBusConfig = parse(KafkaBusConfig, data, prefix="bus")
    return config


async def _round_trip(config: KafkaBusConfig) -> list[bytes]:
    topic = f"test.sasl.{uuid.uuid4().hex[:8]}"
    async with build_bus(config) as bus:
        await bus.create_topics([TopicSpec(topic, partitions=2)])
        for i in range(5):
            await bus.send_raw(topic, f"m{i}".encode(), key=f"k{i}".encode())
        seen: list[bytes] = []
        async with bus.consumer([topic], group=f"g-{topic}") as consumer:
            for _ in range(100):
                for record in await consumer.getmany(timeout_s=0.5):
                    seen.append(record.raw)
                    consumer.mark(record)
                if len(seen) >= 5:
                    break
            committed = await consumer.commit()
        assert sum(committed.values()) == 5
        return sorted(seen)


@pytest.mark.kafka
def test_scram_client_produces_and_consumes_with_password_from_a_file(
    sasl_cluster: tuple[kafka.KafkaCluster, str], tmp_path: Path
) -> None:
    cluster, password = sasl_cluster
    secret = tmp_path / "sasl-password"
    secret.write_text(password + "\n")
    assert asyncio.run(_round_trip(_config(cluster, sasl_password_file=str(secret)))) == [
        f"m{i}".encode() for i in range(5)
    ]


@pytest.mark.kafka
def test_password_from_the_environment(
    sasl_cluster: tuple[kafka.KafkaCluster, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster, password = sasl_cluster
    monkeypatch.setenv("RLBUS_SASL_PASSWORD", password)
    assert len(asyncio.run(_round_trip(_config(cluster)))) == 5


@pytest.mark.kafka
def test_wrong_password_is_a_typed_error_that_never_shows_the_password(
    sasl_cluster: tuple[kafka.KafkaCluster, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cluster, _ = sasl_cluster
    wrong = f"wrong-{uuid.uuid4().hex}"
    monkeypatch.setenv("RLBUS_SASL_PASSWORD", wrong)
    bus = build_bus(_config(cluster))

    async def connect() -> None:
        try:
            await bus.start()
        finally:
            await bus.close()

    caplog.set_level(logging.DEBUG)
    with pytest.raises(BusAuthError) as info:
        asyncio.run(connect())
    assert not info.value.retriable
    assert USER in str(info.value) and "SCRAM-SHA-512" in str(info.value)
    assert wrong not in str(info.value) and wrong not in repr(info.value)
    assert caplog.records and wrong not in caplog.text
    assert wrong not in repr(bus.settings) and wrong not in pretty_repr(bus.settings)  # type: ignore[attr-defined]


@pytest.mark.kafka
def test_the_plaintext_listener_sees_the_user_but_the_sasl_one_refuses_plaintext(
    sasl_cluster: tuple[kafka.KafkaCluster, str],
) -> None:
    cluster, _ = sasl_cluster
    assert kafka.status(cluster.home)["nodes"][0]["sasl_port"] == cluster.nodes[0].sasl_port
    config = parse(KafkaBusConfig, {"bootstrap": cluster.sasl_bootstrap, "linger_ms": 0}, prefix="bus")
    settings = KafkaSettings(bootstrap=config.bootstrap, request_timeout_ms=3000)
    from rlbus.bus.kafka import KafkaBus
    from rlbus.errors import BusUnavailable

    async def connect() -> None:
        bus = KafkaBus(settings)
        try:
            await bus.start()
        finally:
            await bus.close()

    with pytest.raises(BusUnavailable):  # a client without SASL cannot talk to the SASL listener
        asyncio.run(connect())


# --- secrets without a broker -------------------------------------------------------------------


def test_reprs_mask_the_password() -> None:
    password = uuid.uuid4().hex
    config = parse(
        KafkaBusConfig,
        {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "u",
         "sasl_password": password},
        prefix="bus",
    )
    settings = KafkaSettings(sasl_mechanism="SCRAM-SHA-512", sasl_username="u", sasl_password=password)
    for text in (repr(config), str(config), pretty_repr(config), repr(settings), pretty_repr(settings)):
        assert password not in text
    assert "***" in repr(config) and "sasl_username='u'" in repr(config)
    assert settings.client_kwargs()["sasl_plain_password"] == password  # still handed to the client


def test_secret_sources_and_their_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLBUS_TEST_SECRET", raising=False)
    assert secret_from(None, None, "RLBUS_TEST_SECRET", field="f") is None
    monkeypatch.setenv("RLBUS_TEST_SECRET", "from-env")
    assert secret_from(None, None, "RLBUS_TEST_SECRET", field="f") == "from-env"
    (tmp_path / "s").write_text("from-file\n")
    assert secret_from(None, tmp_path / "s", "RLBUS_TEST_SECRET", field="f") == "from-file"
    assert secret_from("given", tmp_path / "s", "RLBUS_TEST_SECRET", field="f") == "given"
    with pytest.raises(ConfigError, match=r"'f'.*cannot read"):
        secret_from(None, tmp_path / "missing", "RLBUS_TEST_SECRET", field="f")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        secret_from(None, tmp_path / "empty", "RLBUS_TEST_SECRET", field="f")


def test_sasl_without_a_password_fails_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLBUS_SASL_PASSWORD", raising=False)
    config = parse(
        KafkaBusConfig,
        {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "u"},
        prefix="bus",
    )
    with pytest.raises(ConfigError) as info:
        build_bus(config)
    assert info.value.field == "bus.sasl_password"
    with pytest.raises(ConfigError) as both:
        parse(KafkaBusConfig, {"sasl_password": "a", "sasl_password_file": "/x"}, prefix="bus")
    assert both.value.field == "bus.sasl_password"


def test_scram_user_password_never_comes_from_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RLBUS_SASL_PASSWORD", raising=False)
    with pytest.raises(ConfigError, match="RLBUS_SASL_PASSWORD"):
        kafka.scram_users_from("alice", None)
    monkeypatch.setenv("RLBUS_SASL_PASSWORD", "pw-env")
    assert kafka.scram_users_from("alice", None) == {"alice": "pw-env"}
    (tmp_path / "pw").write_text("pw-file")
    assert kafka.scram_users_from("alice", tmp_path / "pw") == {"alice": "pw-file"}
    assert kafka.scram_users_from(None, None) is None
    from typer.testing import CliRunner

    from rlbus.cli.app import app

    help_text = CliRunner().invoke(app, ["kafka", "start", "--help"], env={"COLUMNS": "200"}).output
    assert "--scram-password-file" in help_text
    assert "--scram-password " not in help_text and "--sasl-password" not in help_text


def test_sasl_listener_config() -> None:
    cluster = kafka.layout(Path("/h"), brokers=3, port=9092, cluster_id="id", sasl_port=9192)
    assert cluster.sasl_bootstrap == "127.0.0.1:9192,127.0.0.1:9193,127.0.0.1:9194"
    lines = kafka.node_config(cluster, cluster.nodes[1]).splitlines()
    config = dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
    assert config["listeners"] == "PLAINTEXT://127.0.0.1:9094,CONTROLLER://127.0.0.1:9095,SASL_PLAINTEXT://127.0.0.1:9193"
    assert config["advertised.listeners"] == "PLAINTEXT://127.0.0.1:9094,SASL_PLAINTEXT://127.0.0.1:9193"
    assert "SASL_PLAINTEXT:SASL_PLAINTEXT" in config["listener.security.protocol.map"]
    assert "ScramLoginModule" in config["listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config"]
    assert sum(1 for line in lines if line.startswith("listeners=")) == 1
    plain = kafka.layout(Path("/h"), brokers=1, port=9092, cluster_id="id")
    assert plain.sasl_bootstrap is None and "SASL" not in kafka.node_config(plain, plain.nodes[0])
