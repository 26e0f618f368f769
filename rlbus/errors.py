"""One error tree for rlbus.

Lower-level errors (aiokafka, msgspec, aiohttp, redis) are translated into these where they cross into
rlbus, so callers handle one hierarchy. Each class says whether retrying the same operation can help
(``retriable``); workers route non-retriable input errors to the dead-letter topic with the reason.

    RlbusError                       base; retriable = False
    ├── ConfigError                  bad configuration; names the offending field; fails at start
    │   └── PromptFileError          a bad line in a JSONL prompt file (rlbus.envs.tasks.jsonl)
    ├── SchemaError                  a message does not match its schema (bad input → DLQ)
    │   ├── MalformedMessage         bytes are not valid MessagePack for the schema
    │   └── SchemaVersionError       schema_version is not one this build can read
    ├── BusError                     transport problems
    │   ├── BusUnavailable           broker unreachable / timed out          (retriable)
    │   ├── TopicNotFound            topic does not exist (auto-create is off)
    │   └── CommitFailed             offset commit rejected (e.g. rebalance)   (retriable)
    ├── StateError                   state store problems                      (retriable)
    ├── WeightSyncError              weight versions
    │   ├── ChunkCorrupt             a chunk's hash does not match the manifest
    │   ├── DigestMismatch           the applied model's digest is not the manifest's
    │   └── VersionGap               a delta's base is not the version held
    ├── SandboxError                 the sandbox could not be set up (not: the program failed)
    ├── JudgeError                   an LM judge endpoint refused or answered garbage
    │   └── JudgeUnavailable         it could not be reached or kept failing       (retriable)
    └── ServiceError                 a local service (Kafka, Redis) failed to start or stop
"""

from __future__ import annotations


class RlbusError(Exception):
    """Base of every rlbus error."""

    retriable: bool = False


class ConfigError(RlbusError):
    """Invalid configuration; the message names the field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"config field {field!r}: {problem}")
        self.field = field
        self.problem = problem


class SchemaError(RlbusError):
    """A message does not match its schema."""


class MalformedMessage(SchemaError):
    """The payload is not valid MessagePack for the expected struct."""


class SchemaVersionError(SchemaError):
    """The payload carries a schema_version this build cannot read."""


class BusError(RlbusError):
    """A transport-level failure."""


class BusUnavailable(BusError):
    """The broker cannot be reached or timed out."""

    retriable = True


class TopicNotFound(BusError):
    """The topic does not exist; rlbus never relies on broker auto-create."""


class CommitFailed(BusError):
    """An offset commit was rejected, typically because the group rebalanced."""

    retriable = True


class StateError(RlbusError):
    """The state store failed."""

    retriable = True


class WeightSyncError(RlbusError):
    """A weight version cannot be staged or applied."""


class ChunkCorrupt(WeightSyncError):
    """A downloaded chunk's hash does not match its manifest entry, or it does not decode."""


class DigestMismatch(WeightSyncError):
    """After applying a version, the model digest differs from the manifest's."""


class VersionGap(WeightSyncError):
    """A delta's base version is not the version the worker holds."""


class SandboxError(RlbusError):
    """The sandbox itself could not be set up (distinct from the sandboxed program failing)."""


class JudgeError(RlbusError):
    """The judge endpoint rejected the request or answered something that is not a chat completion."""


class JudgeUnavailable(JudgeError):
    """The judge endpoint could not be reached or kept failing after the retries."""

    retriable = True


class ServiceError(RlbusError):
    """A local service (Kafka, Redis) could not be started, reached or stopped."""
