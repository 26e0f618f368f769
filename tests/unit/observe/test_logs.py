"""Log lines name the record they are about, in the human format and as JSON fields."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from rlbus.bus import Record
from rlbus.cli.app import app
from rlbus.observe.logs import HumanFormatter, JsonFormatter, record_fields, setup_logging

RECORD: Record[bytes] = Record(topic="rl.rollouts.v1", partition=3, offset=42, timestamp_ms=0, key=None, raw=b"")


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def line(formatter: logging.Formatter, message: str, *args: object, exc: bool = False, **extra: object) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    logger = logging.getLogger("rlbus.test.logs")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        if exc:
            try:
                raise ValueError("bad arrays")
            except ValueError:
                logger.exception(message, *args, extra=extra)
        else:
            logger.warning(message, *args, extra=extra)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


def test_human_lines_lead_with_the_place_rollout_and_version() -> None:
    text = line(HumanFormatter(), "scored in %.1fs", 0.25,
                **record_fields(RECORD, rollout_id="p1/0", version=7, worker="reward-0"))
    expected = " WARNING rlbus.test.logs rl.rollouts.v1[3]@42 rollout=p1/0 worker=reward-0 v7 scored in 0.2s\n"
    assert text.endswith(expected)
    assert text.count("\n") == 1 and text[:4].isdigit() and "Z " in text


def test_a_message_that_names_its_place_is_not_prefixed_twice() -> None:
    text = line(HumanFormatter(), "%s: prompt p1 done", RECORD.where, **record_fields(RECORD))
    assert text.count("rl.rollouts.v1[3]@42") == 1


def test_plain_lines_have_no_prefix() -> None:
    assert line(HumanFormatter(), "prompt source exhausted").endswith("rlbus.test.logs prompt source exhausted\n")


def test_json_lines_carry_the_fields() -> None:
    text = line(JsonFormatter(), "step %d", 5, exc=True, **record_fields(RECORD, rollout_id="p1/0", version=7))
    assert text.count("\n") == 1
    event = json.loads(text)
    assert event["msg"] == "step 5" and event["level"] == "ERROR" and event["logger"] == "rlbus.test.logs"
    assert (event["topic"], event["partition"], event["offset"]) == ("rl.rollouts.v1", 3, 42)
    assert (event["rollout_id"], event["version"]) == ("p1/0", 7)
    assert "ValueError: bad arrays" in event["exc"] and event["ts"].endswith("Z")


def test_setup_logging_replaces_its_own_handler_and_sets_the_level() -> None:
    stream = io.StringIO()
    setup_logging(json=False, level="debug")
    handler = setup_logging(json=True, level="INFO", stream=stream)
    root = logging.getLogger()
    assert root.level == logging.INFO
    assert sum(isinstance(h.formatter, JsonFormatter | HumanFormatter) for h in root.handlers) == 1
    logging.getLogger("rlbus.x").info("hello", extra={"version": 2})
    logging.getLogger("rlbus.x").debug("hidden")
    assert [json.loads(x)["version"] for x in stream.getvalue().splitlines()] == [2]
    assert handler in root.handlers
    with pytest.raises(ValueError, match="not one of"):
        setup_logging(level="LOUD")


def test_cli_global_log_options() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["--log-json", "--log-level", "info", "topics", "--help"])
    assert result.exit_code == 0, result.output
    root = logging.getLogger()
    assert root.level == logging.INFO
    assert any(isinstance(h.formatter, JsonFormatter) for h in root.handlers)
    bad = runner.invoke(app, ["--log-level", "loud", "topics", "--help"])
    assert bad.exit_code == 2 and "not one of" in bad.output
