"""``rlbus eval``: held-out accuracy where RL started or at a checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from rlbus.cli.common import (
    RunConfigFile,
    console,
    print_error,
)
from rlbus.errors import RlbusError


def eval_(
    config: RunConfigFile = None,
    checkpoint: Annotated[Path | None, typer.Option(
        help="A trainer checkpoint file or directory (its newest); default: the model RL starts from.")] = None,
    n: Annotated[int, typer.Option(help="Held-out prompts to score.", min=1)] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    device: Annotated[str | None, typer.Option(
        help="auto, cpu, cuda … (default: the config's [model] device).")] = None,
) -> None:
    """Held-out accuracy of a run's policy: at a trainer checkpoint, or where RL starts (the run's model with
    its warm start, rebuilt from the config), greedy through the harness as the demo measures it.

    Example: rlbus eval --config run.toml --checkpoint runs/x/checkpoints
    """
    from rlbus.launch.config import load_config
    from rlbus.launch.evaluation import evaluate_run

    try:
        run = load_config(config)
        if device is not None:
            run = run.tuned(model={"device": device})
        result = evaluate_run(run, checkpoint=checkpoint, n=n)
    except RlbusError as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    if as_json:
        sys.stdout.write(json.dumps(result.as_dict()) + "\n")
        return
    where = "where RL starts" if result.step is None else f"step {result.step} (v{result.version})"
    console.print(f"held-out accuracy {result.accuracy:.1%} {where}: {result.prompts} prompts of {result.eval_set}, "
                  f"mean reward {result.mean_reward:.3f}, {result.seconds:.1f} s")
