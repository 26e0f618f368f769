"""`rlbus eval`: the held-out accuracy of a run's policy, where RL started or at a trainer checkpoint.

A distributed run has no driver that evaluates before and after, as `rlbus demo` does; this is that
measurement for any run config, from outside the run. The evaluation set and scoring are the demo's
(`rlbus.launch.arguments.evaluation_prompts`: ``[task] eval_prompts`` or held-out prompts of ``[task] env``
drawn with a seed training never uses; greedy episodes through the real harness on the bf16 cast the
workers serve, scored by the run's ``[reward] function`` when it has one: `rlbus.envs.evaluate`).

"Where RL started" is rebuilt, not read: the trainer's starting model is a deterministic function of the
config (`rlbus.launch.roles.starting_model`: the model, seeded, with its warm start and DPO stage), so the
same config gives the same weights the trainer published as its first version.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlbus.errors import RlbusError
from rlbus.launch.arguments import evaluation_name, evaluation_prompts, model_source, reward_function
from rlbus.launch.config import RunConfig


@dataclass(frozen=True)
class RunEvaluation:
    #: "start" (the model RL starts from) or the checkpoint file evaluated.
    model: str
    #: The checkpoint's trainer step and weight version (None for the start).
    step: int | None
    version: int | None
    accuracy: float
    mean_reward: float
    prompts: int
    eval_set: str
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def evaluate_run(config: RunConfig, *, checkpoint: Path | None = None, n: int = 100) -> RunEvaluation:
    """Greedy held-out accuracy of ``checkpoint`` (a trainer checkpoint file, or the newest of a directory)
    or, without one, of the model the run's trainer starts RL from. Blocking."""
    from rlbus.envs.evaluate import evaluate
    from rlbus.launch.roles import starting_model
    from rlbus.training.checkpoint import latest_checkpoint, load_checkpoint, model_from_state

    started = time.perf_counter()
    source = model_source(config)
    step = version = None
    if checkpoint is None:
        model, label = starting_model(config, "eval"), "start"
    else:
        file = latest_checkpoint(checkpoint) if checkpoint.is_dir() else checkpoint
        if file is None or not file.is_file():
            raise RlbusError(f"no trainer checkpoint at {checkpoint} (a checkpoint file, or a directory with one)")
        state = load_checkpoint(file)
        assert state is not None
        model, label, step, version = model_from_state(state), str(file), state.step, state.version
    prompts = evaluation_prompts(config, n)
    result = evaluate(model, prompts, source.chat, pad_id=source.pad_id, scorer=reward_function(config))
    return RunEvaluation(
        model=label, step=step, version=version, accuracy=result.accuracy, mean_reward=result.mean_reward,
        prompts=len(prompts), eval_set=evaluation_name(config), seconds=time.perf_counter() - started,
    )
