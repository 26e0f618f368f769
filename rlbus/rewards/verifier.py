"""The ``verifier`` scorer: the prompt's environment scores the episode, or a user's reward function in its place.

A rollout carries its prompt (environment, config, reference), so the verifier needs nothing else: it asks the
prompt's environment (`rlbus.envs.base.env_for`: exact match, hidden unit tests in the sandbox, tool-task
answers), and the reward's source is what the environment says (``verifier``, ``sandbox``). A user's reward
function (``[reward] function``, `rlbus.rewards.function.RewardFunction`) takes the environment's place (source
``verifier``); when it raises or returns no finite number the rollout is dead-lettered with that reason. It has
no table of its own. Never imports torch.
"""

from __future__ import annotations

from typing import Any

from rlbus.envs.base import env_for
from rlbus.envs.episode import Episode
from rlbus.rewards.function import RewardFunction
from rlbus.rewards.scorers import NoConfig, Scorer, ScorerContext
from rlbus.schemas import Prompt, Reward


class VerifierScorer(Scorer):
    """``kind = "verifier"``. ``function`` (default: the context's ``[reward] function``, imported) replaces the
    environment's verifier."""

    def __init__(
        self, config: NoConfig | None = None, context: ScorerContext | None = None, *,
        function: RewardFunction | None = None,
    ) -> None:
        context = context or ScorerContext()
        super().__init__(config or NoConfig(), context)
        if function is None and context.function is not None:
            function = RewardFunction.load(context.function)
        self.function = function

    @classmethod
    def check(cls, config: Any, context: ScorerContext) -> list[str]:
        if context.function is None:
            return []
        return [f"reward: function {context.function} is callable as score(prompt, completion, reference)"]

    async def score(self, episode: Episode, prompt: Prompt) -> Reward:
        if self.function is not None:
            return await self.function.score(episode, prompt)
        return await env_for(prompt).score(episode, prompt)
