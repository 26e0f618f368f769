"""The prompt producer: a built-in task's seeded prompt stream, or a JSONL prompt file, under admission control.

With ``prompts`` (``[task] prompts``) the file is parsed and validated whole when the producer is built — the
first bad line raises `PromptFileError` naming the file and line — and its prompts are published in the
file's order, cycled (`rlbus.producers.prompts.file_prompts`); each line names its environment, so ``env``
and ``env_config`` are not used, ``group_size`` is that of lines giving none, and ``seed`` does not apply
(there is no shuffling).

Prompts are numbered from ``start`` (the run's ``prompts:seq`` counter, so a restarted producer continues
the numbering and the stream where they were) and admitted at most ``max_staleness`` versions ahead of the
version the progress reader reports.
"""

from __future__ import annotations

import itertools
from typing import Any

from rlbus.bus.base import Bus
from rlbus.producers.prompts import Admission, PromptProducer, file_prompts, progress_from_state, task_prompts
from rlbus.state.base import StateStore
from rlbus.training.ordered import stamp


def prompt_producer(
    *,
    bus: Bus,
    state: StateStore,
    env: str,
    seed: int,
    group_size: int,
    max_staleness: int,
    groups_per_version: int,
    env_config: dict[str, Any] | None = None,
    prompts: str | None = None,
    admission_slack: int = 0,
    served_by: str | None = None,
    start: int = 0,
    first_version: int = 0,
    run_id: str | None = None,
    limit: int | None = None,
) -> PromptProducer:
    """Prompts of ``env`` (seed + 1000 onwards), or of the file ``prompts`` (validated here, see the module
    docstring), stamped with their sequence number from ``start``. ``groups_per_version`` is groups per step ×
    steps per published version; ``served_by`` names the registry role whose lowest served version admission
    counts from (None: the trainer's version)."""
    if prompts is not None:
        from rlbus.envs.tasks.jsonl import validate_prompts

        validate_prompts(prompts)
        source = file_prompts(prompts, group_size=group_size)
    else:
        source = task_prompts(env, seed=seed + 1000, group_size=group_size, config=env_config)
    return PromptProducer(
        bus=bus,
        prompts=stamp(itertools.islice(source, start, None), start),
        admission=Admission(max_staleness=max_staleness, groups_per_step=groups_per_version, slack=admission_slack),
        progress=progress_from_state(state, served_by=served_by),
        first_version=first_version,
        run_id=run_id,
        limit=limit,
    )
