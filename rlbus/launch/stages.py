"""``rlbus train dpo``: the offline stages of a run config alone — warm start (SFT), DPO, the quality gate —
ending in a checkpoint the RL trainer starts from (``[model] checkpoint = OUT``; its first version is then
a keyframe of those weights).

Reported (and written with ``--json``, under ``summary``): held-out preference accuracy and mean margin
before and after DPO, held-out *task* accuracy (greedy exact match through the harness, as the demo
measures it) before and after, DPO tokens/s and whether the gate passed. ``--baseline-sft`` also trains a
copy of the same starting model with SFT on the chosen responses alone (same steps, batch and learning
rate) and reports the same figures for it: the same-run baseline DPO is judged against.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlbus.launch.arguments import (
    dpo_config,
    dpo_data_args,
    evaluation_prompts,
    initial_model,
    model_source,
    reward_function,
    warm_start_args,
)
from rlbus.launch.config import RunConfig


def prepare_dpo(config: RunConfig, source: Any) -> tuple[list[Any], list[Any], Any, float]:
    """The DPO stage's inputs from the run config: (training pairs, held-out pairs, `DPOConfig`, gate)."""
    from rlbus.training.offline import stage_pairs

    pairs, held_out = stage_pairs(source.chat, **dpo_data_args(config))
    return pairs, held_out, dpo_config(config, pad_id=source.pad_id), config.dpo.gate_accuracy


def run_dpo(
    config: RunConfig, *, out: Path, baseline_sft: bool = False, eval_size: int = 100,
    log: Callable[[str], None] = print, on_step: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Warm start (unless ``model.checkpoint``), DPO, gate, checkpoint in ``out``; returns the figures."""
    from rlbus.envs.evaluate import evaluate
    from rlbus.training.checkpoint import TrainerState, save_checkpoint
    from rlbus.training.dpo import evaluate_preferences, reference_logprobs
    from rlbus.training.offline import dpo_stage
    from rlbus.training.sft import pretrain
    from rlbus.training.warm import warm_start

    started = time.monotonic()
    torch.manual_seed(config.task.seed)
    source = model_source(config, progress=log)
    if config.model.checkpoint is not None:
        model: Any = initial_model(config)
        log(f"starting from {config.model.checkpoint}")
    else:
        model = source.build(seed=config.task.seed)
        if config.trainer.warm_steps:
            log(f"warm start (SFT): {config.trainer.warm_steps} steps")
            warm_start(model, chat=source.chat, **warm_start_args(config))
    chat = source.chat
    train_pairs, eval_pairs, dpo, gate = prepare_dpo(config, source)
    log(f"{len(train_pairs)} training pairs, {len(eval_pairs)} held out "
        f"({config.dpo.data or 'from the task: reference vs off-by-one answers'})")
    prompts = evaluation_prompts(config, eval_size)
    scorer = reward_function(config)  # the run's reward function scores as it does in RL

    def task_accuracy(m: Any) -> float:
        return evaluate(m, prompts, chat, pad_id=source.pad_id, scorer=scorer).accuracy

    figures: dict[str, Any] = {"task_accuracy_start": task_accuracy(model)}
    start = copy.deepcopy(model) if baseline_sft else None
    report = dpo_stage(model, train_pairs, eval_pairs, dpo, gate_accuracy=gate, on_step=on_step, enforce=False)
    steps = report.result.steps
    figures |= {
        "eval_pref_accuracy_start": report.accuracy_start,
        "eval_pref_accuracy_end": report.accuracy_end,
        "eval_margin_start": report.result.evals[0].margin if report.result.evals else None,
        "eval_margin_end": report.result.evals[-1].margin if report.result.evals else None,
        "train_accuracy_last": steps[-1].accuracy if steps else None,
        "tokens_per_s": statistics.fmean(s.tokens_per_s for s in steps) if steps else 0.0,
        "task_accuracy_end": task_accuracy(model),
        "gate_accuracy": gate,
        "gate_passed": report.passed,
        "train_pairs": report.train_pairs,
        "eval_pairs": report.eval_pairs,
    }
    if start is not None:
        log(f"baseline: SFT on the chosen responses, {dpo.steps} steps")
        reference = reference_logprobs(start, eval_pairs, dpo)
        pretrain(start, [p.chosen for p in train_pairs], dpo.steps, dpo.lr, dpo.batch_size, dpo.seed)
        figures["sft_baseline"] = {
            "eval_pref_accuracy_end": evaluate_preferences(start, eval_pairs, reference, dpo).accuracy,
            "task_accuracy_end": task_accuracy(start),
        }
    path = save_checkpoint(out, TrainerState(step=0, version=0, model=model.state_dict(),
                                             model_description=model.describe()))
    figures["checkpoint"] = str(path)
    figures["wall_s"] = time.monotonic() - started
    return figures
