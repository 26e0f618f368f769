"""``Topic``: a name bound to a schema and a key function — the only place bytes meet messages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from rlbus.schemas.base import Codec, Message

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class Topic(Generic[M]):
    """A typed topic. ``key`` extracts the partitioning key from a message (e.g. ``prompt_id``)."""

    name: str
    schema: type[M]
    key: Callable[[M], str]
    codec: Codec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "codec", Codec(self.schema))

    def encode(self, message: M) -> tuple[bytes, bytes]:
        """(key bytes, value bytes) of a message."""
        return self.key(message).encode(), self.codec.encode(message)

    def decode(self, data: bytes) -> M:
        result: M = self.codec.decode(data)
        return result

    @property
    def dlq(self) -> str:
        return dlq_name(self.name)


def dlq_name(topic: str) -> str:
    return f"{topic}.dlq"

