"""Log lines an operator can grep and a log pipeline can index: one line per event, with its place.

Workers pass what a line is about as ``extra=`` fields — the record's ``topic``, ``partition`` and
``offset`` (:func:`record_fields` builds them from a bus record), a ``prompt_id`` or ``rollout_id``,
the policy ``version``, the ``worker`` — instead of only formatting them into the text. The human
format puts them in front of the message (``rl.rollouts.v1[3]@42 rollout=… v7``; the place is left
out when the message already names it); ``--log-json`` writes one JSON object per line with those as
fields, for Loki/Elasticsearch/``jq``. :func:`setup_logging` installs one handler on the root logger
(replacing the one it installed before) that writes to whatever ``sys.stderr`` is at the time.
"""

from __future__ import annotations

import json as jsonlib
import logging
import sys
import time
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlbus.bus.types import Record

#: ``extra=`` fields the formats know, in the order the human format shows them.
FIELDS = ("topic", "partition", "offset", "prompt_id", "rollout_id", "version", "worker")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def record_fields(record: Record[Any], **more: Any) -> dict[str, Any]:
    """``extra=`` for a line about a bus record: its place, plus ``more`` (rollout_id=…, version=…)."""
    return {"topic": record.topic, "partition": record.partition, "offset": record.offset, **more}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {name: getattr(record, name) for name in FIELDS if getattr(record, name, None) is not None}


def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class HumanFormatter(logging.Formatter):
    """``<time> <LEVEL> <logger> <topic[partition]@offset prompt=… rollout=… v7 worker=…> <message>``."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        fields = _fields(record)
        parts: list[str] = []
        if "topic" in fields:
            where = f"{fields['topic']}[{fields.get('partition', '?')}]"
            if "offset" in fields:
                where += f"@{fields['offset']}"
            if where not in message:
                parts.append(where)
        for name, label in (("prompt_id", "prompt"), ("rollout_id", "rollout"), ("worker", "worker")):
            if name in fields:
                parts.append(f"{label}={fields[name]}")
        if "version" in fields:
            parts.append(f"v{fields['version']}")
        line = f"{_timestamp(record)} {record.levelname:<7} {record.name} "
        line += (" ".join(parts) + " ") if parts else ""
        line += message
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg``, the known fields, ``exc``."""

    def format(self, record: logging.LogRecord) -> str:
        event: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return jsonlib.dumps(event, default=str, ensure_ascii=False)


class _StderrHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (test runners and CLIs swap it), like logging's last resort."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, value: IO[str]) -> None:
        return None


_installed: logging.Handler | None = None


def parse_level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    name = level.strip().upper()
    if name not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    return int(getattr(logging, name))


def setup_logging(json: bool = False, level: str | int = "INFO", *, stream: IO[str] | None = None) -> logging.Handler:
    """Route every logger through one handler in the human or JSON format at ``level``; idempotent.
    ``stream`` fixes the destination (default: the current ``sys.stderr`` at each line)."""
    global _installed
    root = logging.getLogger()
    if _installed is not None:
        root.removeHandler(_installed)
    handler: logging.Handler = _StderrHandler() if stream is None else logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if json else HumanFormatter())
    root.addHandler(handler)
    level_no = parse_level(level)
    root.setLevel(level_no)
    # aiokafka logs "Authenticated as <user> via SCRAM" at INFO for every connection (a dozen per worker
    # start on a secure cluster); a refused login is an error it still reports.
    # DEBUG keeps them.
    quieter = logging.DEBUG if level_no <= logging.DEBUG else max(level_no, logging.WARNING)
    logging.getLogger("aiokafka.conn").setLevel(quieter)
    _installed = handler
    return handler
