"""One error tree for rlbus.

Lower-level errors (aiokafka, msgspec, aiohttp, redis) are translated into these where they cross into
rlbus, so callers handle one hierarchy. Each class says whether retrying the same operation can help
(``retriable``); workers route non-retriable input errors to the dead-letter topic with the reason.

    RlbusError                       base; retriable = False
    ├── ConfigError                  bad configuration; names the offending field; fails at start
    │   ├── PromptFileError          a bad line in a JSONL prompt file (rlbus.envs.tasks.jsonl)
    │   └── TaskFormatError          a coding task that cannot be loaded (rlbus.envs.swe.task)
    ├── SchemaError                  a message does not match its schema (bad input → DLQ)
    │   ├── MalformedMessage         bytes are not valid MessagePack for the schema
    │   ├── SchemaVersionError       schema_version is not one this build can read
    │   └── ClaimError               a claim-checked payload cannot be fetched back (rlbus.bus.claimcheck)
    │       ├── ClaimMissing         its blob is gone (collected, or never written)
    │       ├── ClaimCorrupt         size, xxh3-128 or codec does not match the reference
    │       └── ClaimUnavailable     the blob store kept failing while fetching it
    ├── BusError                     transport problems
    │   ├── BusUnavailable           broker unreachable / timed out          (retriable)
    │   ├── TopicNotFound            topic does not exist (auto-create is off)
    │   ├── BusAuthError             the broker refused the credentials (SASL, TLS)
    │   │   └── BusForbidden         authenticated, but no ACL allows this (topic, group, cluster)
    │   └── CommitFailed             offset commit rejected (e.g. rebalance)   (retriable)
    ├── StateError                   state store problems                      (retriable)
    ├── WeightSyncError              weight versions
    │   ├── ChunkCorrupt             a chunk's hash does not match the manifest
    │   ├── DigestMismatch           the applied model's digest is not the manifest's
    │   └── VersionGap               a delta's base is not the version held
    ├── BlobNotFound                 no blob under that key, in any blob store
    ├── BlobStoreError               a blob store read or write failed (network, disk)  (retriable)
    ├── BlobAuthError                the HTTP blob server refused the request's signature
    ├── SandboxError                 the sandbox could not be set up (not: the program failed)
    ├── RewardFunctionError          a user's reward function raised or returned no finite number (→ DLQ)
    ├── JudgeError                   an LM judge endpoint refused or answered garbage
    │   └── JudgeUnavailable         it could not be reached or kept failing       (retriable)
    ├── FeedbackError                the feedback API refused a user signal or could not be reached
    │   └── FeedbackRejected         a request it answers with 400; names the field (rlbus.producers.feedback)
    ├── ApiError                     the gateway refuses an HTTP request: status, OpenAI error type, param, code
    │                                (rlbus.serve; a 429 is retriable after its Retry-After)
    ├── ServiceError                 a local service (Kafka, Redis) failed to start or stop
    ├── RunLogMissing                a run directory has no run log to report on (rlbus.observe.report)
    ├── GenerateError                a task corpus cannot be generated from a library (rlbus.taskgen)
    ├── ToolError                    an expected tool failure; the model sees the message (rlbus.envs.agent)
    ├── QualityGateFailed            the offline stages ended below the bar RL waits for (rlbus.training.offline)
    └── WorkerCrashed                a chaos scenario's pipeline stopped while it ran (rlbus_tools.chaos.harness)
"""

from __future__ import annotations

import os


class RlbusError(Exception):
    """Base of every rlbus error."""

    retriable: bool = False


class ConfigError(RlbusError):
    """Invalid configuration; the message names the field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"config field {field!r}: {problem}")
        self.field = field
        self.problem = problem


class PromptFileError(ConfigError):
    """A prompt file line that cannot be used; ``field`` is ``path:line``."""

    def __init__(self, path: str | os.PathLike[str], line: int, problem: str) -> None:
        super().__init__(f"{path}:{line}", problem)
        self.args = (f"{path}:{line}: {problem}",)


class SchemaError(RlbusError):
    """A message does not match its schema."""


class MalformedMessage(SchemaError):
    """The payload is not valid MessagePack for the expected struct."""


class SchemaVersionError(SchemaError):
    """The payload carries a schema_version this build cannot read."""


class ClaimError(SchemaError):
    """A record's payload lives in the blob store (a claim check) and cannot be fetched back intact; the
    record goes to the DLQ with the reason, which names the blob key."""


class ClaimMissing(ClaimError):
    """The claim's blob is not in the store: collected before the record was read, or never written."""


class ClaimCorrupt(ClaimError):
    """The claim's blob does not match its reference (size, xxh3-128, codec), or the reference is bad."""


class ClaimUnavailable(ClaimError):
    """The blob store kept failing while the claim was fetched; redrive the dead letter once it is back."""


class BusError(RlbusError):
    """A transport-level failure."""


class BusUnavailable(BusError):
    """The broker cannot be reached or timed out."""

    retriable = True


class TopicNotFound(BusError):
    """The topic does not exist; rlbus never relies on broker auto-create."""


class BusAuthError(BusError):
    """The broker refused this client's credentials; retrying with the same ones cannot help."""


class BusForbidden(BusAuthError):
    """The broker knows who this client is and no ACL lets it do this (write that topic, join that group):
    a deployment error, never retried. The message names the principal's resource and operation."""


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


class BlobNotFound(RlbusError):
    """No blob under that key."""


class BlobStoreError(RlbusError):
    """The store failed to read or write (network, disk); retrying may help."""

    retriable = True


class BlobAuthError(RlbusError):
    """The server refused the signature (wrong secret, expired, or tampered request)."""


class SandboxError(RlbusError):
    """The sandbox itself could not be set up (distinct from the sandboxed program failing)."""


class TaskFormatError(ConfigError):
    """A coding task (task directory or SWE-bench row) that cannot be loaded; ``field`` is
    ``file: field`` (``toolz-1/task.toml: tests.fail_to_pass``). Not retriable: fix the task."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(where, problem)
        self.args = (f"{where}: {problem}",)


class RewardFunctionError(RlbusError):
    """A user's reward function (``[reward] function``) raised or returned something other than a finite
    number; the rollout goes to the dead-letter topic with this reason."""


class JudgeError(RlbusError):
    """The judge endpoint rejected the request or answered something that is not a chat completion."""


class JudgeUnavailable(JudgeError):
    """The judge endpoint could not be reached or kept failing after the retries."""

    retriable = True


class FeedbackError(RlbusError):
    """A user signal was refused (the message names the field) or the feedback API could not be reached."""


class FeedbackRejected(FeedbackError):
    """A request the API refuses with 400; ``field`` is the JSON path of the offending field, if any."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ApiError(RlbusError):
    """A request the OpenAI-compatible gateway refuses; rendered as ``{"error": {message, type, param, code}}``
    with ``status``. ``retry_after_s`` (429/503) becomes the Retry-After header."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.retriable = status in (429, 503)


class ServiceError(RlbusError):
    """A local service (Kafka, Redis) could not be started, reached or stopped."""


class RunLogMissing(RlbusError):
    """``rlbus report`` was pointed at a directory without a run log; the message names the missing file."""


class GenerateError(RlbusError):
    """A library cannot be turned into tasks: no sdist, no tests, a suite that fails unchanged (rlbus.taskgen)."""


class ToolError(RlbusError):
    """An expected tool failure (bad input, missing key); the model sees the message as the observation."""


class QualityGateFailed(RlbusError):
    """The model after the offline stages (SFT, DPO) missed the run's quality gate; RL does not start."""


class WorkerCrashed(RlbusError):
    """A chaos scenario's pipeline (its task group) ended while the scenario still ran; the message names
    the worker's error. The scenario reports it as a failed row."""
