"""``rlbus secrets probe``: a deployed role tries, with its own credentials, what its role must not do.

:mod:`rlbus_tools.chaos.intrusion` proves the refusal matrix on a cluster it builds itself. A deployment (docker
compose, Kubernetes) is set up by other hands, so the question there is whether *this* container's
credentials are as narrow as they should be. Run inside a role's container (``docker compose exec rollout
rlbus secrets probe``), this reads the same configuration the worker does (``RLBUS_CONFIG``,
``RLBUS_BUS_CONFIG``, ``RLBUS_REDIS_URL_FILE``, ``RLBUS_BLOB_SECRET_FILE``) and makes each attempt below
once; each must be refused with the typed error named. Attempts a role is entitled to (the trainer
producing weights) are skipped for that role.

=========================================  =====================================  ======================
attempt                                    who may                                refused with
=========================================  =====================================  ======================
produce to the weights topic               trainer, operator                      BusAuthError
join the trainer's consumer group          trainer, operator                      BusAuthError
create a topic                             nobody (the administrator only)        BusAuthError
log in with a wrong password               —                                      BusAuthError
speak SASL_PLAINTEXT to the TLS listener   —                                      BusAuthError
trust another CA (a man in the middle)     —                                      BusAuthError
write the trainer's ledger in Redis        trainer, operator                      NoPermissionError
use Redis as the default user              — (it is off)                          AuthenticationError
plain ``redis://`` to the TLS port         —                                      ConnectionError
upload a weights manifest (blob key)       trainer                                BlobAuthError
=========================================  =====================================  ======================
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import msgspec

from rlbus.bus.topics import PROMPTS, WEIGHTS
from rlbus.bus.types import TopicSpec
from rlbus.config import KafkaBusConfig, build_bus
from rlbus.errors import BlobAuthError, BusAuthError, RlbusError
from rlbus.launch.config import RunConfig, blob_secret

if TYPE_CHECKING:
    from redis.asyncio import Redis

#: Roles (Kafka principal, without a namespace) allowed what an attempt tries.
MAY_PUBLISH = {"trainer", "operator"}
#: The roles that write the trainer's ledger in Redis (users ``rlbus-<role>``).
MAY_LEDGER = {"trainer", "operator"}


@dataclass
class AttemptOutcome:
    """What one attempt got."""

    who: str
    what: str
    refused: bool
    error: str
    #: Whether the target changed (a record appended, a blob written, a key changed); None: not applicable.
    written: bool | None = None
    #: Whether the refusing side logged the attempt (broker security.log, blob server, Redis ACL LOG).
    logged: bool | None = None
    seconds: float = 0.0

    def row(self) -> list[str]:
        return [self.who, self.what, "refused" if self.refused else "ALLOWED", self.error.split(":")[0],
                {None: "-", True: "yes", False: "no"}[self.written], {None: "-", True: "yes", False: "no"}[self.logged]]


async def refusal(action: Awaitable[Any], *errors: type[BaseException]) -> tuple[bool, str]:
    """Run ``action``; (refused, "ErrorType: message")."""
    try:
        async with asyncio.timeout(60):
            await action
    except errors as exc:
        return True, f"{type(exc).__name__}: {exc}"
    except RlbusError as exc:  # refused, but not with the typed error the matrix asks for
        return False, f"untyped {type(exc).__name__}: {exc}"
    except TimeoutError:
        return False, "no answer in 60 s"
    return False, "allowed"


async def produce_one(config: KafkaBusConfig, topic: str) -> None:
    async with build_bus(config) as bus:
        await bus.send_raw(topic, b"intrusion", key=b"intrusion")


async def consume_briefly(config: KafkaBusConfig, topic: str, group: str | None) -> None:
    async with build_bus(config) as bus, bus.consumer([topic], group=group) as consumer:
        for _ in range(10):
            await consumer.getmany(timeout_s=0.5)


class Probe:
    """The attempts of one process's configuration."""

    def __init__(self, config: RunConfig, work: Path) -> None:
        self.config = config
        self.work = work
        self.namespace = config.run.namespace
        self.role = (config.bus.sasl_username or "").removeprefix(f"{self.namespace}." if self.namespace else "")

    def topic(self, name: str) -> str:
        return f"{self.namespace}.{name}" if self.namespace else name

    def bus(self, **override: object) -> KafkaBusConfig:
        return msgspec.structs.replace(self.config.bus, **override)

    def who(self) -> str:
        return self.config.bus.sasl_username or "anonymous"

    async def run(self) -> list[AttemptOutcome]:
        attempts: list[Callable[[], Awaitable[AttemptOutcome | None]]] = [
            self.publish_weights, self.join_trainer_group, self.create_topic, self.wrong_password, self.plaintext,
            self.other_ca, self.write_ledger, self.redis_default_user, self.redis_plaintext, self.upload_manifest,
        ]
        outcomes = []
        for attempt in attempts:
            began = time.monotonic()
            outcome = await attempt()
            if outcome is not None:
                outcome.seconds = time.monotonic() - began
                outcomes.append(outcome)
        return outcomes

    # --- Kafka -------------------------------------------------------------------------------------------
    async def publish_weights(self) -> AttemptOutcome | None:
        if self.role in MAY_PUBLISH:
            return None
        topic = self.topic(WEIGHTS.name)
        refused, error = await refusal(produce_one(self.config.bus, topic), BusAuthError)
        return AttemptOutcome(self.who(), f"produce to {topic}", refused, error)

    async def join_trainer_group(self) -> AttemptOutcome | None:
        if self.role in MAY_PUBLISH:
            return None
        group = self.topic("trainer")
        refused, error = await refusal(consume_briefly(self.config.bus, self.topic(PROMPTS.name), group),
                                       BusAuthError)
        return AttemptOutcome(self.who(), f"join consumer group {group}", refused, error)

    async def create_topic(self) -> AttemptOutcome:
        name = self.topic(f"rogue.{int(time.time())}")

        async def create() -> None:
            async with build_bus(self.config.bus) as bus:
                await bus.create_topics([TopicSpec(name, partitions=1, replication=1)])

        refused, error = await refusal(create(), BusAuthError)
        return AttemptOutcome(self.who(), f"create topic {name}", refused, error)

    async def wrong_password(self) -> AttemptOutcome:
        wrong = self.work / "wrong.password"
        wrong.write_text("not-the-password\n")
        config = self.bus(sasl_password_file=str(wrong), sasl_password=None)
        refused, error = await refusal(produce_one(config, self.topic(PROMPTS.name)), BusAuthError)
        return AttemptOutcome(self.who(), "log in with a wrong password", refused, error)

    async def plaintext(self) -> AttemptOutcome:
        config = self.bus(security_protocol="SASL_PLAINTEXT")
        refused, error = await refusal(produce_one(config, self.topic(PROMPTS.name)), BusAuthError)
        return AttemptOutcome(self.who(), "speak SASL_PLAINTEXT to the TLS listener", refused, error)

    async def other_ca(self) -> AttemptOutcome:
        from rlbus.security.tls import LocalCA

        rogue = await asyncio.to_thread(LocalCA(self.work / "rogue-ca", common_name="not the rlbus CA").ensure)
        config = self.bus(ssl_cafile=str(rogue.cert))
        refused, error = await refusal(produce_one(config, self.topic(PROMPTS.name)), BusAuthError)
        return AttemptOutcome(self.who(), "connect trusting another CA (man in the middle)", refused, error)

    # --- Redis -------------------------------------------------------------------------------------------
    async def _redis(self, url: str, action: Callable[[Redis], Awaitable[object]],
                     *errors: type[BaseException]) -> tuple[bool, str]:
        from redis.asyncio import Redis

        client: Redis = Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10)
        try:
            return await refusal(action(client), *errors)
        finally:
            await client.aclose()

    async def write_ledger(self) -> AttemptOutcome | None:
        from redis.exceptions import NoPermissionError

        from rlbus.security.redis_acl import url_user

        if self.role in MAY_LEDGER or not self.config.state.url.startswith(("redis", "rediss")):
            return None
        key = f"{self.config.state_prefix}once:trainer:probe"
        refused, error = await self._redis(self.config.state.url, lambda r: r.set(key, b"forged"),
                                           NoPermissionError)
        return AttemptOutcome(f"redis {url_user(self.config.state.url)}", "write the trainer's ledger", refused, error)

    async def redis_default_user(self) -> AttemptOutcome | None:
        from redis.exceptions import AuthenticationError, NoPermissionError

        from rlbus.security.redis_acl import redact_url

        parts = urlsplit(self.config.state.url)
        if not parts.scheme.startswith("redis"):
            return None
        anonymous = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        refused, error = await self._redis(anonymous, lambda r: r.get(f"{self.config.state_prefix}ctr:trainer:steps"),
                                           AuthenticationError, NoPermissionError)
        what = f"use Redis without a user ({redact_url(anonymous)})"
        return AttemptOutcome("anyone on the network", what, refused, error)

    async def redis_plaintext(self) -> AttemptOutcome | None:
        from redis.exceptions import ConnectionError as RedisConnectionError

        parts = urlsplit(self.config.state.url)
        if parts.scheme != "rediss":
            return None
        plain = urlunsplit(parts._replace(scheme="redis", query=""))
        refused, error = await self._redis(plain, lambda r: r.ping(), RedisConnectionError)
        return AttemptOutcome("anyone on the network", "plain redis:// to the TLS port", refused, error)

    # --- blobs -------------------------------------------------------------------------------------------
    async def upload_manifest(self) -> AttemptOutcome | None:
        from rlbus.blobs.http import HttpStore

        if self.role == "trainer" or self.config.store.url is None:
            return None
        key = f"{self.namespace}/manifests/probe.json" if self.namespace else "manifests/probe.json"
        async with HttpStore(self.config.store.url, secret=blob_secret(self.config.store)) as store:
            refused, error = await refusal(store.put(key, b"forged manifest"), BlobAuthError)
        return AttemptOutcome(f"{self.role or 'this'} blob key", "upload a weights manifest", refused, error)


async def probe(config: RunConfig) -> list[AttemptOutcome]:
    """Every attempt this process's configuration may not make (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="rlbus-probe-") as work:
        return await Probe(config, Path(work)).run()
