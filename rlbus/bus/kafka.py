"""The bus over Apache Kafka (aiokafka).

Producers are idempotent (``enable_idempotence=True`` implies ``acks=all``) and compress at the Kafka
level (zstd by default). Consumers never auto-commit: a worker marks records once their side effect is
done and commits the marks; a rebalance listener commits the marks before partitions are revoked, so a
rebalance redelivers only what was not yet processed. Static membership (``instance_id`` →
``group.instance.id``) lets a restarted worker keep its partitions without a rebalance, and
``client_rack`` lets brokers serve a region's reads from a replica in that region (KIP-392).
aiokafka errors are translated into :mod:`rlbus.errors` here, where they cross into rlbus.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka import TopicPartition as KafkaTP
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.conn import create_conn
from aiokafka.errors import (
    AuthenticationFailedError,
    AuthenticationMethodNotSupported,
    ClusterAuthorizationFailedError,
    CommitFailedError,
    GroupAuthorizationFailedError,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    RebalanceInProgressError,
    SaslAuthenticationFailed,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
    UnknownTopicOrPartitionError,
)

from rlbus.bus.base import Bus, Consumer, TopicLike
from rlbus.bus.types import Headers, Record, RecordMetadata, TopicInfo, TopicPartition, TopicSpec
from rlbus.errors import BusAuthError, BusError, BusForbidden, BusUnavailable, CommitFailed, TopicNotFound


@dataclass(frozen=True)
class KafkaSettings:
    """Connection settings, passed through to aiokafka (SASL/TLS included)."""

    bootstrap: str = "127.0.0.1:9092"
    client_id: str = "rlbus"
    #: Region or availability zone of this client (``client.rack``) for follower fetching.
    client_rack: str | None = None
    compression: str | None = "zstd"
    linger_ms: int = 5
    max_request_bytes: int = 4 * 1024 * 1024
    #: Per-partition batch size. aiokafka's default (16 KiB) would put every rollout-sized message in
    #: a batch of its own and serialise the partition on one request per message.
    max_batch_bytes: int = 1024 * 1024
    request_timeout_ms: int = 30_000
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    #: Never shown by repr (nor by rich, which honours ``repr=False``).
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def client_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap,
            "client_id": self.client_id,
            "request_timeout_ms": self.request_timeout_ms,
            "security_protocol": self.security_protocol,
        }
        if self.sasl_mechanism:
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_username
            kwargs["sasl_plain_password"] = self.sasl_password
        if self.security_protocol in ("SSL", "SASL_SSL"):
            context = ssl.create_default_context(cafile=self.ssl_cafile)
            if self.ssl_certfile:
                context.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
            kwargs["ssl_context"] = context
        kwargs.update(self.extra)
        return kwargs


#: Kafka's TOPIC_, GROUP_, CLUSTER_ and TRANSACTIONAL_ID_AUTHORIZATION_FAILED.
_FORBIDDEN_CODES = {29, 30, 31, 53}


def _code_error(what: str, code: int, message: str | None = None) -> BusError:
    """The rlbus error for a Kafka error code in a response (authorisation failures are BusForbidden)."""
    detail = f"error {code} {message or ''}".strip()
    if code in _FORBIDDEN_CODES:
        return BusForbidden(f"{what}: not authorized ({detail})")
    return BusError(f"{what}: {detail}")


def _accept_any_certificate() -> ssl.SSLContext:
    """Only to tell whether a port speaks TLS at all (nothing is sent but a handshake)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


async def _first_read_error(reader: asyncio.StreamReader, wait_s: float = 1.0) -> str | None:
    """What the server said right after the handshake: a TLS alert or a closed connection (it refused the
    client's certificate), or None when it is still listening quietly, as Kafka does before a request."""
    try:
        async with asyncio.timeout(wait_s):
            data = await reader.read(1)
    except TimeoutError:
        return None
    except ssl.SSLError as exc:
        return str(exc.reason or exc)
    except OSError as exc:
        return type(exc).__name__
    return None if data else "connection closed"


@contextlib.asynccontextmanager
async def translated(what: str) -> AsyncIterator[None]:
    """Translate aiokafka errors raised inside the block into rlbus errors naming ``what``."""
    try:
        yield
    except UnknownTopicOrPartitionError as exc:
        raise TopicNotFound(f"{what}: topic does not exist ({exc})") from exc
    except (
        TopicAuthorizationFailedError, GroupAuthorizationFailedError, ClusterAuthorizationFailedError,
        TransactionalIdAuthorizationFailed,
    ) as exc:
        raise BusForbidden(f"{what}: not authorized ({type(exc).__name__}: {exc})") from exc
    except (CommitFailedError, RebalanceInProgressError) as exc:
        raise CommitFailed(f"{what}: {exc}") from exc
    except (KafkaConnectionError, KafkaTimeoutError) as exc:
        raise BusUnavailable(f"{what}: {exc}") from exc
    except KafkaError as exc:
        raise BusError(f"{what}: {exc}") from exc


class KafkaBus(Bus):
    kind = "kafka"

    def __init__(self, settings: KafkaSettings | None = None) -> None:
        self.settings = settings or KafkaSettings()
        self._producer: AIOKafkaProducer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._meta: AIOKafkaConsumer | None = None
        self._known_topics: set[str] = set()

    async def start(self) -> None:
        kwargs = self.settings.client_kwargs()
        self._producer = AIOKafkaProducer(
            **kwargs,
            enable_idempotence=True,
            acks="all",
            compression_type=self.settings.compression,
            linger_ms=self.settings.linger_ms,
            max_batch_size=self.settings.max_batch_bytes,
            max_request_size=self.settings.max_request_bytes,
        )
        self._admin = AIOKafkaAdminClient(**_admin_kwargs(kwargs))
        self._meta = AIOKafkaConsumer(**kwargs, enable_auto_commit=False)
        try:
            async with translated(f"connect to Kafka at {self.settings.bootstrap}"):
                await self._producer.start()
                await self._admin.start()
                await self._meta.start()
        except BaseException as exc:
            await self.close()  # the clients that did start hold connections and background tasks
            if isinstance(exc, BusUnavailable):
                await self._explain_bootstrap_failure()
            raise

    async def _explain_bootstrap_failure(self) -> None:
        await self._raise_if_tls_refused()
        if self.settings.sasl_mechanism:
            await self._raise_if_credentials_refused()

    async def _raise_if_tls_refused(self) -> None:
        """A TLS mismatch also reads as "unable to bootstrap". Shake hands with the first broker directly
        and name the cause: PLAINTEXT spoken to a TLS listener, a broker certificate this client's CA did
        not sign, or a client certificate the broker refused (another CA, expired)."""
        s = self.settings
        host, _, port = s.bootstrap.split(",")[0].rpartition(":")
        tls = s.security_protocol in ("SSL", "SASL_SSL")
        probe = s.client_kwargs().get("ssl_context") if tls else _accept_any_certificate()
        try:
            async with asyncio.timeout(10):
                reader, writer = await asyncio.open_connection(host, int(port), ssl=probe, server_hostname=host)
            # TLS 1.3 refuses a client certificate only after the handshake: the alert arrives at the first read.
            reader_error = await _first_read_error(reader) if tls else None
            writer.close()
        except ssl.SSLCertVerificationError as exc:
            raise BusAuthError(
                f"Kafka at {host}:{port}: this client does not trust the broker's certificate ({exc.verify_message}); "
                "check [bus] ssl_cafile"
            ) from None
        except ssl.SSLError as exc:
            if tls:
                raise BusAuthError(
                    f"Kafka at {host}:{port} refused the TLS handshake ({exc.reason}): its client certificate check "
                    "failed (certificate from another CA, or expired), or the port does not speak TLS"
                ) from None
            return
        except (OSError, TimeoutError):
            return
        if reader_error is not None and tls:
            raise BusAuthError(
                f"Kafka at {host}:{port} closed the connection after the TLS handshake ({reader_error}): it refused "
                "this client's certificate (another CA, expired, or none given where one is required)"
            ) from None
        if not tls:
            raise BusAuthError(
                f"Kafka at {host}:{port} speaks TLS but security_protocol is {s.security_protocol}: use SSL or "
                "SASL_SSL with [bus] ssl_cafile"
            )

    async def _raise_if_credentials_refused(self) -> None:
        """aiokafka reports refused SASL credentials as "unable to bootstrap", which reads like an
        outage worth retrying; ask the brokers directly so a wrong password is a BusAuthError."""
        s = self.settings
        context = s.client_kwargs().get("ssl_context")
        for address in s.bootstrap.split(","):
            host, _, port = address.rpartition(":")
            try:
                conn = await create_conn(
                    host, int(port), client_id=s.client_id, request_timeout_ms=s.request_timeout_ms,
                    ssl_context=context, security_protocol=s.security_protocol, sasl_mechanism=s.sasl_mechanism,
                    sasl_plain_username=s.sasl_username, sasl_plain_password=s.sasl_password,
                )
            except (SaslAuthenticationFailed, AuthenticationFailedError, AuthenticationMethodNotSupported) as exc:
                raise BusAuthError(
                    f"Kafka at {address} refused {s.sasl_mechanism} credentials of user {s.sasl_username!r}: "
                    f"{type(exc).__name__}"
                ) from None
            except (OSError, KafkaError, TimeoutError):
                continue
            conn.close()

    async def close(self) -> None:
        for closer in (self._producer and self._producer.stop, self._meta and self._meta.stop):
            if closer is not None:
                with contextlib.suppress(KafkaError):
                    await closer()
        if self._admin is not None:
            with contextlib.suppress(KafkaError):
                await self._admin.close()

    # --- produce -----------------------------------------------------------------------------------
    async def send_raw(
        self,
        topic: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Headers = (),
        timestamp_ms: int | None = None,
        partition: int | None = None,
    ) -> RecordMetadata:
        assert self._producer is not None, "KafkaBus used before start()"
        if topic not in self._known_topics:
            # Fail fast: aiokafka would otherwise wait a full request timeout for a topic that
            # will never appear, because broker auto-create is off.
            await self.partitions(topic)
            self._known_topics.add(topic)
        async with translated(f"produce to {topic}"):
            future = await self._producer.send(
                topic,
                value,
                key=key,
                headers=list(headers) or None,
                timestamp_ms=timestamp_ms,
                partition=partition,
            )
            meta = await future
        return RecordMetadata(meta.topic, meta.partition, meta.offset, meta.timestamp)

    # --- admin -------------------------------------------------------------------------------------
    @property
    def admin(self) -> AIOKafkaAdminClient:
        assert self._admin is not None, "KafkaBus used before start()"
        return self._admin

    async def create_topics(self, specs: Sequence[TopicSpec]) -> list[str]:
        existing = set(await self.list_topics())
        new = [s for s in specs if s.name not in existing]
        if not new:
            return []
        async with translated("create topics"):
            response = await self.admin.create_topics(
                [NewTopic(s.name, s.partitions, s.replication, topic_configs=dict(s.config)) for s in new]
            )
        for name, code, message in _topic_errors(response):
            if code not in (0, 36):  # 36 = TOPIC_ALREADY_EXISTS (a concurrent creator won)
                raise _code_error(f"create topic {name}", code, message)
        await self._wait_for_leaders([s.name for s in new])
        return [s.name for s in new]

    async def _wait_for_leaders(self, names: list[str], timeout_s: float = 30.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            topics = await self.admin.describe_topics(names)
            ready = all(
                t["error_code"] == 0 and t["partitions"] and all(p["leader"] >= 0 for p in t["partitions"])
                for t in topics
            )
            if ready:
                return
            if loop.time() > deadline:
                raise BusUnavailable(f"topics {names} have no leaders after {timeout_s:.0f}s")
            await asyncio.sleep(0.1)

    async def list_topics(self) -> list[str]:
        async with translated("list topics"):
            names = await self.admin.list_topics()
        return sorted(n for n in names if not n.startswith("__"))

    async def partitions(self, topic: str) -> list[int]:
        async with translated(f"describe {topic}"):
            (info,) = await self.admin.describe_topics([topic])
        if info["error_code"] == 3:
            raise TopicNotFound(f"topic {topic!r} does not exist (create it with `rlbus topics create`)")
        if info["error_code"]:
            raise _code_error(f"describe {topic}", info["error_code"])
        return sorted(p["partition"] for p in info["partitions"])

    async def describe(self, topic: str) -> TopicInfo:
        async with translated(f"describe {topic}"):
            (info,) = await self.admin.describe_topics([topic])
            if info["error_code"] == 3:
                raise TopicNotFound(f"topic {topic!r} does not exist")
            if info["error_code"]:
                raise _code_error(f"describe {topic}", info["error_code"])
            responses = await self.admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
        config: dict[str, str] = {}
        for response in responses:
            for resource in response.to_object()["resources"]:
                for entry in resource["config_entries"]:
                    if entry["config_source"] == 1:  # DYNAMIC_TOPIC_CONFIG: set on this topic
                        config[entry["config_names"]] = entry["config_value"]
        replication = max((len(p["replicas"]) for p in info["partitions"]), default=0)
        return TopicInfo(
            name=topic,
            partitions=len(info["partitions"]),
            replication=replication,
            config=config,
            end_offsets=await self.end_offsets(topic),
        )

    async def _tps(self, topic: str) -> list[KafkaTP]:
        return [KafkaTP(topic, p) for p in await self.partitions(topic)]

    async def end_offsets(self, topic: str) -> dict[int, int]:
        assert self._meta is not None
        tps = await self._tps(topic)
        async with translated(f"end offsets of {topic}"):
            found = await self._meta.end_offsets(tps)
        return {tp.partition: off for tp, off in found.items()}

    async def beginning_offsets(self, topic: str) -> dict[int, int]:
        assert self._meta is not None
        tps = await self._tps(topic)
        async with translated(f"beginning offsets of {topic}"):
            found = await self._meta.beginning_offsets(tps)
        return {tp.partition: off for tp, off in found.items()}

    async def offsets_for_time(self, topic: str, timestamp_ms: int) -> dict[int, int]:
        assert self._meta is not None
        tps = await self._tps(topic)
        async with translated(f"offsets for time in {topic}"):
            found = await self._meta.offsets_for_times({tp: timestamp_ms for tp in tps})
        ends = await self.end_offsets(topic)
        return {tp.partition: (ends[tp.partition] if hit is None else hit.offset) for tp, hit in found.items()}

    async def committed(self, group: str, topic: str) -> dict[int, int | None]:
        tps = await self._tps(topic)
        async with translated(f"committed offsets of group {group}"):
            found = await self.admin.list_consumer_group_offsets(group, partitions=tps)
        out: dict[int, int | None] = {}
        for tp in tps:
            meta = found.get(tp)
            out[tp.partition] = meta.offset if meta is not None and meta.offset >= 0 else None
        return out

    # --- consume -----------------------------------------------------------------------------------
    def consumer(
        self,
        topics: Sequence[TopicLike],
        *,
        group: str | None = None,
        from_beginning: bool = True,
        instance_id: str | None = None,
    ) -> KafkaConsumer:
        return KafkaConsumer(self, topics, group=group, from_beginning=from_beginning, instance_id=instance_id)


def _admin_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    allowed = {
        "bootstrap_servers",
        "client_id",
        "request_timeout_ms",
        "security_protocol",
        "ssl_context",
        "sasl_mechanism",
        "sasl_plain_username",
        "sasl_plain_password",
    }
    return {k: v for k, v in kwargs.items() if k in allowed}


def _topic_errors(response: Any) -> list[tuple[str, int, str | None]]:
    out = []
    for item in getattr(response, "topic_errors", []) or getattr(response, "topics", []):
        name, code = item[0], item[1]
        message = item[2] if len(item) > 2 and isinstance(item[2], str) else None
        out.append((name, code, message))
    return out


class _CommitOnRevoke(ConsumerRebalanceListener):
    """Commits the positions a worker marked as processed before its partitions are taken away."""

    def __init__(self, consumer: KafkaConsumer) -> None:
        self._consumer = consumer

    async def on_partitions_revoked(self, revoked: list[KafkaTP]) -> None:
        await self._consumer._commit_on_revoke({TopicPartition(tp.topic, tp.partition) for tp in revoked})

    async def on_partitions_assigned(self, assigned: list[KafkaTP]) -> None:
        return None


class KafkaConsumer(Consumer):
    def __init__(
        self,
        bus: KafkaBus,
        topics: Sequence[TopicLike],
        *,
        group: str | None,
        from_beginning: bool,
        instance_id: str | None,
    ) -> None:
        super().__init__(topics, group)
        self._bus = bus
        kwargs = bus.settings.client_kwargs()
        self._consumer = AIOKafkaConsumer(
            **kwargs,
            group_id=group,
            group_instance_id=instance_id if group else None,
            client_rack=bus.settings.client_rack,
            enable_auto_commit=False,
            auto_offset_reset="earliest" if from_beginning else "latest",
            max_partition_fetch_bytes=bus.settings.max_request_bytes,
            fetch_max_bytes=max(bus.settings.max_request_bytes * 4, 52_428_800),
        )
        self._from_beginning = from_beginning

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            with contextlib.suppress(KafkaError):  # a consumer that never started still warns when collected
                await self._consumer.stop()
            raise

    async def _start(self) -> None:
        async with translated(f"start consumer of {self.topics}"):
            for topic in self.topics:
                await self._bus.partitions(topic)  # raises TopicNotFound early: auto-create is off
            await self._consumer.start()
            if self.group is not None:
                self._consumer.subscribe(self.topics, listener=_CommitOnRevoke(self))
            else:
                tps = [tp for topic in self.topics for tp in await self._bus._tps(topic)]
                self._consumer.assign(tps)
                if self._from_beginning:
                    await self._consumer.seek_to_beginning(*tps)
                else:
                    await self._consumer.seek_to_end(*tps)

    async def close(self) -> None:
        try:
            if self.group is not None:
                with contextlib.suppress(CommitFailed, BusError):
                    await self.commit()
        finally:
            with contextlib.suppress(KafkaError):
                await self._consumer.stop()

    async def _commit_on_revoke(self, revoked: set[TopicPartition]) -> None:
        offsets = {tp: off for tp, off in self._marked.items() if tp in revoked}
        for tp in offsets:
            del self._marked[tp]
        if offsets:
            await self._commit(offsets)

    def assignment(self) -> set[TopicPartition]:
        return {TopicPartition(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    async def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        if self.group is None:
            raise BusError("a consumer without a group cannot commit (replay and tail never commit)")
        async with translated(f"commit {self.group}"):
            await self._consumer.commit({KafkaTP(tp.topic, tp.partition): off for tp, off in offsets.items()})

    async def committed(self, tp: TopicPartition) -> int | None:
        if self.group is None:
            return None
        async with translated(f"committed {tp}"):
            offset = await self._consumer.committed(KafkaTP(tp.topic, tp.partition))
        return None if offset is None or offset < 0 else int(offset)

    async def position(self, tp: TopicPartition) -> int:
        async with translated(f"position {tp}"):
            return int(await self._consumer.position(KafkaTP(tp.topic, tp.partition)))

    async def lag(self) -> dict[TopicPartition, int]:
        assigned = self.assignment()
        out: dict[TopicPartition, int] = {}
        for topic in sorted({tp.topic for tp in assigned}):
            ends = await self._bus.end_offsets(topic)
            done = await self._bus.committed(self.group, topic) if self.group is not None else {}
            for tp in sorted(tp for tp in assigned if tp.topic == topic):
                base = done.get(tp.partition)
                if base is None:
                    base = await self.position(tp)
                out[tp] = max(0, ends[tp.partition] - base)
        return out

    async def seek(self, tp: TopicPartition, offset: int) -> None:
        if tp not in self.assignment():
            raise BusError(f"cannot seek {tp}: not assigned to this consumer")
        self._consumer.seek(KafkaTP(tp.topic, tp.partition), offset)

    async def _offsets_for_time(
        self, tps: Sequence[TopicPartition], timestamp_ms: int
    ) -> dict[TopicPartition, int]:
        out: dict[TopicPartition, int] = {}
        for topic in {tp.topic for tp in tps}:
            found = await self._bus.offsets_for_time(topic, timestamp_ms)
            out.update({tp: found[tp.partition] for tp in tps if tp.topic == topic})
        return out

    async def getmany(self, *, timeout_s: float = 1.0, max_records: int = 500) -> list[Record[Any]]:
        async with translated(f"fetch {self.topics}"):
            batches = await self._consumer.getmany(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        out: list[Record[Any]] = []
        for tp, records in batches.items():
            decoder = self._decoders.get(tp.topic)
            for r in records:
                out.append(
                    Record(
                        topic=r.topic,
                        partition=r.partition,
                        offset=r.offset,
                        timestamp_ms=r.timestamp,
                        key=r.key,
                        raw=r.value if r.value is not None else b"",
                        headers=tuple((k, bytes(v)) for k, v in (r.headers or ())),
                        decoder=decoder,
                    )
                )
        return out
