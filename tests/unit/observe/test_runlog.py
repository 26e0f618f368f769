from dataclasses import dataclass
from pathlib import Path

from rlbus.observe.runlog import WEIGHTS, RunLog, RunLogTail, read, read_all_syncs, syncs_name


@dataclass
class Event:
    version: int
    kind: str


def test_events_round_trip_with_time_and_nan_as_null(tmp_path: Path) -> None:
    with RunLog(tmp_path, clock=lambda: 12.5) as log:
        log.write("steps", {"step": 1, "kl": float("nan"), "staleness": {0: 3}})
        log.write("weights", Event(version=2, kind="delta"))
        log.write(syncs_name("rollout-0"), {"version": 2})
        log.write(syncs_name("rollout-1"), {"version": 3})
    assert list(read(tmp_path, "steps")) == [{"t": 12.5, "step": 1, "kl": None, "staleness": {"0": 3}}]
    assert list(read(tmp_path, "weights")) == [{"t": 12.5, "version": 2, "kind": "delta"}]
    assert [e["version"] for e in read_all_syncs(tmp_path)] == [2, 3]
    assert list(read(tmp_path, "absent")) == []


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    with RunLog(tmp_path) as log:
        log.write("steps", {"step": 1})
    with (tmp_path / "steps.jsonl").open("a") as handle:
        handle.write('{"t": 1, "ste')
    assert [e["step"] for e in read(tmp_path, "steps")] == [1]


def test_tail_reads_only_what_was_appended_and_waits_for_a_torn_line(tmp_path: Path) -> None:
    tail = RunLogTail(tmp_path)
    assert tail.events(WEIGHTS) == []  # no file yet
    with RunLog(tmp_path) as log:
        log.write(WEIGHTS, {"version": 1}, t=1.0)
        assert [e["version"] for e in tail.events(WEIGHTS)] == [1]
        log.write(WEIGHTS, {"version": 2}, t=2.0)
        path = tmp_path / f"{WEIGHTS}.jsonl"
        with path.open("a") as raw:  # a writer caught mid-line
            raw.write('{"t":3.0,"vers')
        assert [e["version"] for e in tail.events(WEIGHTS)] == [1, 2]
        with path.open("a") as raw:
            raw.write('ion":3}\n')
        assert [e["version"] for e in tail.events(WEIGHTS)] == [1, 2, 3]
        assert tail.events(WEIGHTS) == list(read(tmp_path, WEIGHTS))
    (tmp_path / f"{WEIGHTS}.jsonl").write_text('{"t":9.0,"version":9}\n')  # a new run in the same directory
    assert [e["version"] for e in tail.events(WEIGHTS)] == [9]
