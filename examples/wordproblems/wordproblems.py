"""Word problems with integer answers: a user's own rlbus environment (`WordProblems`) and reward (`score`)."""

import random
import re

from rlbus.envs import HarnessConfig, Task
from rlbus.envs.base import config_data
from rlbus.envs.chat import format_answer
from rlbus.envs.scoring import exact_match
from rlbus.schemas import Prompt

PROBLEMS = [
    ("Ann has 3 apples and buys 4 more. How many apples does she have?", 7),
    ("A box holds 6 eggs. How many eggs are in 5 boxes?", 30),
    ("Tom had 20 marbles and lost 8. How many are left?", 12),
    ("12 cookies are shared equally by 4 children. How many does each get?", 3),
    ("It is 5 degrees and gets 9 degrees colder. What is the temperature now?", -4),
]


class WordProblems(Task[HarnessConfig]):
    """One problem per prompt; its own verifier (exact match of the answer) scores when no [reward] function is set."""

    config_type = HarnessConfig

    def generate(self, seed, n):
        rng, config = random.Random(seed), config_data(self.config)
        picks = [rng.choice(PROBLEMS) for _ in range(n)]
        return [Prompt(prompt_id=f"wp-{seed}-{i}", env="wordproblems", text=q, reference=str(a), env_config=config)
                for i, (q, a) in enumerate(picks)]

    def reference_turns(self, prompt):
        return [format_answer(prompt.reference)]

    async def score(self, episode, prompt):
        return exact_match(episode, prompt)


def score(prompt: str, completion: str, reference: str | None) -> float:
    """1.0 when the last integer the model wrote is the reference answer, else 0.0."""
    numbers = re.findall(r"-?\d+", completion)
    return float(bool(numbers) and reference is not None and int(numbers[-1]) == int(reference))
