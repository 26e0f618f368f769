"""Kafka's own Admin API for what aiokafka lacks: SCRAM users and ACLs, in one JVM per request.

aiokafka has no public call for AlterUserScramCredentials (KIP-554) nor for CreateAcls, and hand-built
protocol requests are exactly what a security review should not have to audit. So rlbus drives Kafka's Java
``Admin`` client: ``infra/kafka/SecurityAdmin.java`` is compiled once per Kafka release and source digest
into the jar cache (``<cache>/kafka-<version>/tools/``) and run on the broker's classpath. The request,
passwords included, goes in on stdin as JSON; the answer comes back on stdout with one entry per user and
per ACL binding, so a refusal names what was refused.

Compiling needs ``javac`` (Debian: ``openjdk-17-jdk-headless``); the broker itself needs only the JRE.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlbus.errors import ConfigError, ServiceError
from rlbus.security.kafka_acl import AclBinding
from rlbus_tools.services.kafka_jars import pom_path, resolve_jars

SOURCE_NAME = "SecurityAdmin.java"
MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
#: Kafka refuses fewer than 4096 iterations; more only slows every login.
ITERATIONS = 8192
TIMEOUT_S = 120.0


def _source() -> Path:
    return pom_path().parent / SOURCE_NAME


def compiled(jars: Path) -> Path:
    """The directory holding ``SecurityAdmin.class`` for these ``jars`` (compiled when the source changed)."""
    source = _source()
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    out = jars.parent / "tools" / digest
    if (out / "SecurityAdmin.class").is_file():
        return out
    javac = shutil.which("javac")
    if javac is None:
        raise ServiceError(
            "'javac' not found on PATH; install a JDK (Debian: apt-get install -y openjdk-17-jdk-headless)"
        )
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    done = subprocess.run(
        [javac, "-nowarn", "-d", str(staging), "-cp", f"{jars}/*", str(source)],
        capture_output=True, text=True, check=False,
    )
    if done.returncode != 0:
        raise ServiceError(f"compiling {source.name} failed:\n{done.stderr[-2000:]}")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def run(client: Mapping[str, str], request: Mapping[str, Any], *, jars: Path | None = None) -> dict[str, Any]:
    """Send one request through the Admin client configured by ``client`` (Java client properties).

    Returns the answer; raises ServiceError when the request could not be sent, and when the brokers refused
    an entry (naming each refused user or binding, never a password).
    """
    jars = jars or resolve_jars()
    classes = compiled(jars)
    java = shutil.which("java")
    if java is None:
        raise ServiceError("'java' not found on PATH; install it (Debian: apt-get install -y openjdk-17-jre-headless)")
    payload = json.dumps({"client": dict(client), **request})
    try:
        done = subprocess.run(
            [java, "-Xmx256m", "-Dlog4j2.level=ERROR", "-cp", f"{classes}:{jars}/*", "SecurityAdmin"],
            input=payload, capture_output=True, text=True, check=False, timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        where = client.get("bootstrap.servers")
        raise ServiceError(f"the Kafka admin request to {where} took over {TIMEOUT_S:.0f} s") from None
    answer_line = next((line for line in reversed(done.stdout.splitlines()) if line.startswith("{")), None)
    if done.returncode == 1 or answer_line is None:
        errors = [line for line in done.stderr.splitlines() if not line.lstrip().startswith("at ")]
        raise ServiceError(
            f"the Kafka admin request to {client.get('bootstrap.servers')} failed: " + "\n".join(errors[-8:])
        )
    answer: dict[str, Any] = json.loads(answer_line)
    refused = [f"user {row['user']}: {row['error']}" for row in answer.get("scram", []) if row["error"]]
    refused += [f"{row['binding']}: {row['error']}" for row in answer.get("acls", []) if row["error"]]
    if refused:
        raise ServiceError("the brokers refused: " + "; ".join(refused))
    return answer


def upsert_scram_users(
    client: Mapping[str, str], users: Mapping[str, str], *, mechanism: str = "SCRAM-SHA-512",
    iterations: int = ITERATIONS, jars: Path | None = None,
) -> None:
    """Create or update SCRAM ``users`` (name → password). The broker stores only the salted form."""
    if mechanism not in MECHANISMS:
        raise ConfigError("sasl_mechanism", f"{mechanism!r} is not one of {list(MECHANISMS)}")
    for name, password in users.items():
        if not name or not password:
            raise ConfigError("scram_users", "every SCRAM user needs a non-empty name and password")
    scram = [
        {"user": name, "mechanism": mechanism, "iterations": iterations, "password": password}
        for name, password in users.items()
    ]
    run(client, {"scram": scram}, jars=jars)


def create_acls(client: Mapping[str, str], bindings: Sequence[AclBinding], *, jars: Path | None = None) -> None:
    """Add ``bindings`` (adding one that exists is a no-op for Kafka)."""
    run(client, {"acls": [asdict(b) for b in bindings]}, jars=jars)


def delete_acls(client: Mapping[str, str], bindings: Sequence[AclBinding], *, jars: Path | None = None) -> int:
    """Remove exactly ``bindings``; returns how many the brokers deleted."""
    answer = run(client, {"delete_acls": [asdict(b) for b in bindings]}, jars=jars)
    return int(answer.get("deleted_acls", 0))


def describe_acls(client: Mapping[str, str], *, jars: Path | None = None) -> list[AclBinding]:
    """Every ACL the cluster holds."""
    answer = run(client, {"describe_acls": True}, jars=jars)
    return sorted(AclBinding(**row) for row in answer.get("described", []))
