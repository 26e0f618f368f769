"""The base of every message struct and the typed encode/decode used by topics.

Messages are msgspec Structs encoded as plain MessagePack maps (field name → value), so a reader in any
language with a MessagePack library can decode them without rlbus. Each struct carries
``schema_version``; a reader accepts only the version it was built for, because a new major version is a
new topic (``rl.rollouts.v2``) and minor changes only add fields with defaults, which older readers
ignore.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import msgspec

from rlbus.errors import MalformedMessage, SchemaVersionError


class Message(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Base struct; subclasses set ``SCHEMA_VERSION`` and declare ``schema_version`` with that default."""

    SCHEMA_VERSION: ClassVar[int] = 1


M = TypeVar("M", bound=Message)

_encoder = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


class Codec:
    """Encodes and validates one message type; built once per topic."""

    def __init__(self, schema: type[Message]) -> None:
        self.schema = schema
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(schema)
        self._peek = msgspec.msgpack.Decoder(_VersionOnly)

    def encode(self, message: Message) -> bytes:
        if not isinstance(message, self.schema):
            raise TypeError(f"expected {self.schema.__name__}, got {type(message).__name__}")
        return _encoder.encode(message)

    def decode(self, data: bytes) -> Any:
        """Decode and validate; raises MalformedMessage or SchemaVersionError, never a msgspec error."""
        try:
            version = self._peek.decode(data).schema_version
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MalformedMessage(f"{self.schema.__name__}: {exc}") from exc
        if version != self.schema.SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{self.schema.__name__}: schema_version {version} is not readable by this build"
                f" (expects {self.schema.SCHEMA_VERSION})"
            )
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise MalformedMessage(f"{self.schema.__name__}: {exc}") from exc


class _VersionOnly(msgspec.Struct, forbid_unknown_fields=False):
    schema_version: int


def decode(schema: type[M], data: bytes) -> M:
    result: M = Codec(schema).decode(data)
    return result
