"""``arith``: integer arithmetic with exact-match verification, sized for a tiny byte-level policy.

A prompt is ``"12+34="`` and the answer ``46``; the model replies ``<answer>46</answer>``. With the defaults
(2-digit addition, no system message, a 64-token context) prompts are 6 bytes and answers at most 3, so a
~1M-parameter byte-level model can learn the task during warm start and improve on it with RL.
"""

from __future__ import annotations

import random
from typing import Literal

from rlbus.envs.base import HarnessConfig, Task, config_data, register_env
from rlbus.envs.chat import format_answer
from rlbus.envs.episode import Episode
from rlbus.envs.scoring import exact_match
from rlbus.schemas import Prompt, Reward

Op = Literal["+", "-", "*"]


class ArithConfig(HarnessConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which problems ``generate`` draws; the harness fields default to a one-turn, no-tools episode."""

    instructions: bool = False
    max_new_tokens: int = 32
    context_tokens: int = 64
    max_total_tokens: int = 64
    ops: tuple[Op, ...] = ("+",)
    """Operators to draw from."""
    digits: int = 2
    """Operands have 1..digits digits."""
    allow_negative: bool = False
    """For ``-``: allow a negative result (otherwise the larger operand comes first)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.digits <= 9:
            raise ValueError("digits must be in 1..9")
        if not self.ops:
            raise ValueError("ops must name at least one operator")


class ArithTask(Task[ArithConfig]):
    config_type = ArithConfig

    def generate(self, seed: int, n: int) -> list[Prompt]:
        rng = random.Random(seed)
        config = config_data(self.config)
        return [self._prompt(rng, f"arith-{seed}-{i}", config) for i in range(n)]

    def _prompt(self, rng: random.Random, prompt_id: str, config: dict[str, object]) -> Prompt:
        op = rng.choice(self.config.ops)
        top = 10**self.config.digits - 1
        a, b = rng.randint(0, top), rng.randint(0, top)
        if op == "-" and not self.config.allow_negative and a < b:
            a, b = b, a
        result = a + b if op == "+" else a - b if op == "-" else a * b
        return Prompt(prompt_id=prompt_id, env="arith", text=f"{a}{op}{b}=", reference=str(result), env_config=config)

    def reference_turns(self, prompt: Prompt) -> list[str]:
        return [format_answer(_reference(prompt))]

    async def score(self, episode: Episode, prompt: Prompt) -> Reward:
        return exact_match(episode, prompt)


def _reference(prompt: Prompt) -> str:
    if prompt.reference is None:
        raise ValueError(f"prompt {prompt.prompt_id} has no reference answer")
    return prompt.reference


register_env("arith", ArithTask)
