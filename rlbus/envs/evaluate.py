"""Held-out evaluation: greedy episodes of a model through the real harness, scored by the environment.

The evaluation plays each prompt exactly as a rollout worker would — the same chat format, system
message, tools, turn limits and stop tokens (`rlbus.envs.agent.run_episode`) — but greedily (temperature
0), on a bf16 copy of the weights (what the workers serve), and scores it with the environment's own
reward (or the run's ``[reward] function``, which replaces it in the reward worker too). Accuracy is the
share of prompts whose reward reaches ``threshold`` (1.0: exact match for the
verifiable tasks). All episodes run concurrently and their decode calls are merged into batches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rlbus.envs.agent import run_episode
from rlbus.envs.base import env_for
from rlbus.envs.chat import ChatFormat
from rlbus.envs.episode import Episode
from rlbus.schemas import Prompt, Reward, SamplingInfo

if TYPE_CHECKING:
    from rlbus.models.sources import Model


def held_out_prompts(env: str, env_config: dict[str, Any] | None, *, seed: int, n: int) -> list[Prompt]:
    """The evaluation set of a task: ``n`` prompts from seed 10,000 + ``seed``, a stream neither the warm
    start (seed + 1), the task pairs (seed + 2) nor RL (the producer's seed) draws from."""
    from rlbus.envs.tasks import generate_prompts

    return generate_prompts(env, seed=10_000 + seed, n=n, config=env_config)


class Scorer(Protocol):
    """What scores an episode in place of its environment: `rlbus.rewards.function.RewardFunction`."""

    async def score(self, episode: Episode, prompt: Prompt) -> Reward: ...


@dataclass(frozen=True)
class Evaluation:
    accuracy: float
    """Share of prompts with reward ≥ threshold."""
    mean_reward: float
    generated_tokens: int
    seconds: float


def evaluate(
    model: Model, prompts: Sequence[Prompt], chat: ChatFormat, *, pad_id: int = 0, max_batch: int = 64,
    threshold: float = 1.0, scorer: Scorer | None = None,
) -> Evaluation:
    """Greedy accuracy of the bf16 cast of ``model`` on ``prompts``: the torch engine's default 32 rows in
    flight, up to ``max_batch`` calls merged. Blocking (runs its own event loop). ``scorer`` (a run's
    ``[reward] function``) scores in place of each prompt's environment, as it does in the reward worker,
    so the accuracy measures what RL optimises."""
    import time

    from rlbus.engines.torch_stack import torch_stack

    engine = torch_stack(model, tokenizer=chat, pad_id=pad_id, batch_calls=max_batch, batch_window_s=0.02).batching
    greedy = SamplingInfo(temperature=0.0)

    async def one(prompt: Prompt) -> tuple[float, int]:
        env = env_for(prompt)
        episode = await run_episode(env, prompt, engine=engine, chat=chat, sampling=greedy)
        reward = await (scorer or env).score(episode, prompt)
        return reward.value, sum(episode.loss_mask)

    async def all_prompts() -> list[tuple[float, int]]:
        from concurrent.futures import ThreadPoolExecutor

        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max(4, len(prompts))))
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    started = time.perf_counter()
    scored = asyncio.run(all_prompts())
    rewards = [r for r, _ in scored]
    return Evaluation(
        accuracy=sum(r >= threshold for r in rewards) / max(1, len(rewards)),
        mean_reward=sum(rewards) / max(1, len(rewards)),
        generated_tokens=sum(n for _, n in scored),
        seconds=time.perf_counter() - started,
    )
