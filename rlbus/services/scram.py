"""Create Kafka SCRAM users from Python (AlterUserScramCredentials, KIP-554), without a JVM tool.

The local cluster's SASL listener (``rlbus kafka start --sasl-port``) needs users. Kafka's own tools
take the password as a command-line argument (``kafka-storage format --add-scram``) or need the
``kafka-tools`` jar the broker's dependencies do not include. So rlbus sends the admin request itself
over the broker's PLAINTEXT listener: the client derives the salted password (RFC 5802 ``Hi()`` =
PBKDF2-HMAC with the mechanism's hash) and the broker stores only that, so neither the password nor
the salted form ever appears on a command line or in a log.

Wire format (API key 51, version 0, a flexible version)::

    request:  deletions [name, mechanism:int8], upsertions [name, mechanism:int8, iterations:int32,
              salt:bytes, salted_password:bytes]
    response: throttle_time_ms:int32, results [user_name, error_code:int16, error_message]

Mechanism codes: 1 = SCRAM-SHA-256, 2 = SCRAM-SHA-512 (Kafka's ``ScramMechanism``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Mapping
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import CompactArray, CompactBytes, CompactString, Int8, Int16, Int32, Schema, TaggedFields

from rlbus.errors import ConfigError, ServiceError

MECHANISMS = {"SCRAM-SHA-256": (1, "sha256"), "SCRAM-SHA-512": (2, "sha512")}
#: Kafka refuses fewer than 4096 iterations; more only slows every login.
ITERATIONS = 8192


class _AlterScramResponse(Response):
    API_KEY = 51
    API_VERSION = 0
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "results",
            CompactArray(
                ("user_name", CompactString("utf-8")),
                ("error_code", Int16),
                ("error_message", CompactString("utf-8")),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class _AlterScramRequestV0(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 51
    API_VERSION = 0
    RESPONSE_TYPE = _AlterScramResponse
    SCHEMA = Schema(
        ("deletions", CompactArray(("name", CompactString("utf-8")), ("mechanism", Int8), ("tags", TaggedFields))),
        (
            "upsertions",
            CompactArray(
                ("name", CompactString("utf-8")),
                ("mechanism", Int8),
                ("iterations", Int32),
                ("salt", CompactBytes),
                ("salted_password", CompactBytes),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class _AlterScram(Request[_AlterScramRequestV0]):
    API_KEY = 51

    def __init__(self, upsertions: list[tuple[Any, ...]]) -> None:
        self._upsertions = upsertions

    def build(self, request_struct_class: type[_AlterScramRequestV0]) -> _AlterScramRequestV0:
        return request_struct_class([], self._upsertions, {})


def salted_password(password: str, salt: bytes, iterations: int, mechanism: str) -> bytes:
    """RFC 5802 ``Hi(password, salt, i)``: PBKDF2-HMAC with the mechanism's hash, one hash-length block."""
    _, digest = _mechanism(mechanism)
    return hashlib.pbkdf2_hmac(digest, password.encode(), salt, iterations)


def _mechanism(name: str) -> tuple[int, str]:
    try:
        return MECHANISMS[name]
    except KeyError:
        raise ConfigError("sasl_mechanism", f"{name!r} is not one of {sorted(MECHANISMS)}") from None


async def upsert_scram_users(
    bootstrap: str, users: Mapping[str, str], *, mechanism: str = "SCRAM-SHA-512", iterations: int = ITERATIONS
) -> None:
    """Create or update SCRAM ``users`` (name → password) through a PLAINTEXT ``bootstrap`` listener.

    Raises ServiceError naming the user when the broker refuses one (its message, never the password).
    """
    code, _ = _mechanism(mechanism)
    upsertions: list[tuple[Any, ...]] = []
    for name, password in users.items():
        if not name or not password:
            raise ConfigError("scram_users", "every SCRAM user needs a non-empty name and password")
        salt = os.urandom(32)
        derived = await asyncio.to_thread(salted_password, password, salt, iterations, mechanism)
        upsertions.append((name, code, iterations, salt, derived, {}))
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=15_000)
    try:
        await admin.start()
        response = await admin._send_to_controller(_AlterScram(upsertions))
    except KafkaError as exc:
        raise ServiceError(f"creating SCRAM users at {bootstrap} failed: {type(exc).__name__}: {exc}") from None
    finally:
        await admin.close()
    failed = [
        f"{result['user_name']}: error {result['error_code']} {result['error_message'] or ''}".strip()
        for result in response.to_object()["results"]
        if result["error_code"]
    ]
    if failed:
        raise ServiceError("the broker refused SCRAM users: " + "; ".join(failed))
