"""The offline stages before RL: warm start (SFT) → DPO → the quality gate that lets RL start.

The seeds' recipe trains offline first and turns RL on only once the model passes a quality bar. A run
config chains the stages (``[trainer] warm_steps`` for SFT, ``[dpo]`` for preference learning); the trainer
runs them before its first version — which is then a keyframe of the resulting weights — and ``rlbus train
dpo`` runs them alone and writes a checkpoint RL starts from.

Preference data comes from a JSONL file (text, chat or token pairs — ``rlbus offline pairs`` mines those
from a run's own log) or, without one, from the task: the reference solution against the same solution
with a wrong final answer (the sloppy teacher's ``n + 1``), played through the real harness, so the pairs
have exactly a rollout's token layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlbus.envs.chat import ChatFormat
from rlbus.envs.tasks import generate_prompts
from rlbus.errors import QualityGateFailed
from rlbus.models.base import TrainableLM
from rlbus.training.dpo import DPOConfig, DPOResult, DPOStep, load_preference_data, split_pairs, train_dpo
from rlbus.training.preference import PreferencePair
from rlbus.training.ranks import Ranks
from rlbus.training.warm import sft_examples, sloppy_teacher


def pairs_from_task(
    chat: ChatFormat, *, env: str, env_config: dict[str, Any] | None, seed: int, n: int
) -> list[PreferencePair]:
    """``n`` prompts of ``env`` (seed + 2: neither the warm start's nor the RL stream's): the reference
    solution is chosen, the same solution answering ``n + 1`` is rejected. Prompts whose reference is not a
    number have no wrong twin and are left out. Blocking (plays episodes on its own event loop)."""
    prompts = generate_prompts(env, seed=seed + 2, n=n, config=env_config)
    wrong = sloppy_teacher(prompts, 1.0, seed=seed)
    keep = [i for i, (p, w) in enumerate(zip(prompts, wrong, strict=True)) if p.reference != w.reference]
    chosen = sft_examples([prompts[i] for i in keep], chat)
    rejected = sft_examples([wrong[i] for i in keep], chat)
    return [
        PreferencePair(chosen=c, rejected=r, prompt_id=prompts[i].prompt_id, chosen_reward=1.0, rejected_reward=0.0)
        for i, c, r in zip(keep, chosen, rejected, strict=True)
    ]


def stage_pairs(
    chat: ChatFormat, *, data: str | None, eval_data: str | None, eval_fraction: float, task_pairs: int,
    env: str, env_config: dict[str, Any] | None, seed: int,
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    """The DPO stage's (train, held-out) pairs: ``data`` (or the task's own pairs when None), held out by
    ``eval_data`` or a seeded ``eval_fraction`` split (whole prompts go to one side)."""
    if data is not None:
        pairs = load_preference_data(Path(data), chat)
    else:
        pairs = pairs_from_task(chat, env=env, env_config=env_config, seed=seed, n=task_pairs)
    if eval_data is not None:
        return pairs, load_preference_data(Path(eval_data), chat)
    return split_pairs(pairs, eval_fraction, seed)



@dataclass(frozen=True)
class StageReport:
    """What the DPO stage did and whether RL may start."""

    result: DPOResult
    train_pairs: int
    eval_pairs: int
    gate_accuracy: float
    passed: bool

    @property
    def accuracy_start(self) -> float | None:
        return self.result.evals[0].accuracy if self.result.evals else None

    @property
    def accuracy_end(self) -> float | None:
        return self.result.evals[-1].accuracy if self.result.evals else None


def dpo_stage(
    model: TrainableLM, pairs: list[PreferencePair], eval_pairs: list[PreferencePair], config: DPOConfig, *,
    gate_accuracy: float = 0.0, on_step: Callable[[DPOStep], None] | None = None, enforce: bool = True,
    ranks: Ranks | None = None,
) -> StageReport:
    """Train ``model`` in place with DPO (on every rank of ``ranks``: `train_dpo`), then check the gate:
    held-out preference accuracy at the end must reach ``gate_accuracy``; with ``enforce`` a miss raises
    `QualityGateFailed` (RL must not start)."""
    result = train_dpo(model, pairs, config, eval_pairs=eval_pairs or None, on_step=on_step, ranks=ranks)
    accuracy = result.evals[-1].accuracy if result.evals else None
    passed = gate_accuracy <= 0 or (accuracy is not None and accuracy >= gate_accuracy)
    report = StageReport(result=result, train_pairs=len(pairs), eval_pairs=len(eval_pairs),
                         gate_accuracy=gate_accuracy, passed=passed)
    if enforce and not passed:
        raise QualityGateFailed(
            f"held-out preference accuracy {accuracy if accuracy is not None else 'n/a'} after DPO is below "
            f"dpo.gate_accuracy = {gate_accuracy}: RL does not start"
        )
    return report
