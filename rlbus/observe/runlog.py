"""A run directory's event log: what a finished run leaves behind for `rlbus report` and for debugging.

Every process of a run appends JSON lines to files in one run directory (a local path; in the
distributed mode each process writes its own files, named by role and worker id, so nothing is shared
between writers). One file per kind of event, one JSON object per line, each with ``t`` (Unix time):

==================  =================================  ================================================
file                written by                          fields (besides ``t``)
==================  =================================  ================================================
``steps.jsonl``     the trainer, per GRPO step          the step metrics (``step``, ``version``,
                                                        ``reward_mean``, ``kl_k3``, ``ess`` …,
                                                        ``staleness`` histogram)
``prompts.jsonl``   the prompt producer, per prompt     ``prompt_id``, ``created_at``, ``version``
``inputs.jsonl``    the trainer, per GRPO step          ``step``, ``groups``: [{``prompt_id``,
                                                        ``rollout_ids``, ``rewards``, ``versions``}]
``completions``     the trainer, per GRPO step          ``step``, ``completed_at``: {prompt_id: when the
``.jsonl``                                              group became complete in the ordered join}
``weights.jsonl``   the weight publisher, per version   ``version``, ``kind``, ``full_bytes``,
                                                        ``delta_bytes``, ``keyframe_bytes``, ``*_s``
``syncs-<worker>``  each rollout worker, per swap       ``worker``, ``version``, ``kind``,
``.jsonl``                                              ``bytes_fetched``, ``stage_s``,
                                                        ``swap_pause_s``, ``lag_s``, ``rebuilt``,
                                                        ``manifest_at``
``rollouts-<wid>``  each rollout worker, per rollout    ``rollout_id``, ``prompt_id``, ``created_at``,
``.jsonl``                                              ``sampled_tokens``, ``versions``, ``timings``
``rewards.jsonl``   the trainer, per trained group      ``source``, ``value``, ``rollout_id``
``summary.json``    the run's driver at the end         the run's headline figures
==================  =================================  ================================================

Lines are flushed as they are written, so a crashed run still leaves everything up to the crash, and
`read` skips a torn last line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

STEPS = "steps"
INPUTS = "inputs"
WEIGHTS = "weights"
PROMPTS = "prompts"
COMPLETIONS = "completions"
REWARDS = "rewards"


def syncs_name(worker_id: str) -> str:
    return f"syncs-{worker_id}"


def rollouts_name(worker_id: str) -> str:
    return f"rollouts-{worker_id}"


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _jsonable(value.item())
    return value


class RunLog:
    """Appends events to ``<run_dir>/<name>.jsonl``; one open file per name, line-buffered."""

    def __init__(self, run_dir: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._files: dict[str, IO[str]] = {}

    def write(self, name: str, event: Any, *, t: float | None = None) -> None:
        """Append one event (a mapping or dataclass) to ``name``.jsonl, stamped with ``t`` (default: now)."""
        record = {"t": self._clock() if t is None else t, **_jsonable(event)}
        handle = self._files.get(name)
        if handle is None:
            handle = self._files[name] = (self.run_dir / f"{name}.jsonl").open("a", buffering=1)
        handle.write(json.dumps(record, separators=(",", ":")) + "\n")

    def summary(self, figures: Mapping[str, Any]) -> Path:
        path = self.run_dir / "summary.json"
        path.write_text(json.dumps(_jsonable(figures), indent=2) + "\n")
        return path

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read(run_dir: Path, name: str) -> Iterator[dict[str, Any]]:
    """The events of ``name``.jsonl in order (nothing when the file is absent; a torn line is skipped)."""
    path = Path(run_dir) / f"{name}.jsonl"
    if not path.exists():
        return
    with path.open() as handle:
        for line in handle:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


class RunLogTail:
    """Follows a run directory's logs while the run writes them: each call to :meth:`events` reads only
    the bytes appended since the last one, so a driver polling a long run does not re-parse every file
    on every poll. A line is taken once its newline is written (a line being written is left for the
    next call); a file that shrank (a new run in the same directory) is read again from the start."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._events: dict[str, list[dict[str, Any]]] = {}
        self._offsets: dict[str, int] = {}

    def events(self, name: str) -> list[dict[str, Any]]:
        """Every complete event of ``name``.jsonl so far, in order (the list is the tail's own: copy it
        before changing it)."""
        events = self._events.setdefault(name, [])
        path = self.run_dir / f"{name}.jsonl"
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return events
        offset = self._offsets.get(name, 0)
        if size < offset:
            events.clear()
            offset = 0
        if size == offset:
            return events
        with path.open("rb") as handle:
            handle.seek(offset)
            data = handle.read(size - offset)
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        self._offsets[name] = offset + end
        return events


def read_all_syncs(run_dir: Path) -> Iterator[dict[str, Any]]:
    """The swap events of every worker that wrote into ``run_dir``."""
    for path in sorted(Path(run_dir).glob("syncs-*.jsonl")):
        yield from read(run_dir, path.stem)
