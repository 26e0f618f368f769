"""Plain value types shared by every bus implementation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

from rlbus.errors import SchemaError

T = TypeVar("T")

Headers = tuple[tuple[str, bytes], ...]


class TopicPartition(NamedTuple):
    topic: str
    partition: int

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]"


@dataclass(frozen=True)
class RecordMetadata:
    """Where an acknowledged write landed."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int


@dataclass(frozen=True)
class TopicSpec:
    """Declarative description of one topic; ``rlbus topics create`` applies a list of these."""

    name: str
    partitions: int
    replication: int = 1
    config: dict[str, str] = field(default_factory=dict)
    doc: str = ""

    @property
    def compacted(self) -> bool:
        return "compact" in self.config.get("cleanup.policy", "")


@dataclass(frozen=True)
class TopicInfo:
    """What the broker reports about a topic."""

    name: str
    partitions: int
    replication: int
    config: dict[str, str]
    end_offsets: dict[int, int]


@dataclass
class Record(Generic[T]):
    """One consumed record: raw bytes plus lazy, validated decoding through the topic's codec.

    ``value`` raises :class:`rlbus.errors.SchemaError` for a malformed message; workers route that to
    the dead-letter topic (see :mod:`rlbus.bus.dlq`). The location fields name the record in logs.
    """

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    raw: bytes
    headers: Headers = ()
    decoder: Any = None
    _value: Any = field(default=None, repr=False)
    _decoded: bool = field(default=False, repr=False)

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.topic, self.partition)

    @property
    def value(self) -> T:
        if not self._decoded:
            if self.decoder is None:
                raise SchemaError(f"{self.where}: no schema bound to this topic; use .raw")
            self._value = self.decoder.decode(self.raw)
            self._decoded = True
        result: T = self._value
        return result

    @property
    def where(self) -> str:
        """``topic[partition]@offset`` — how logs name a record."""
        return f"{self.topic}[{self.partition}]@{self.offset}"

    def header(self, name: str) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None
