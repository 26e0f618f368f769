"""``strings``: string transformations (reverse, uppercase, sort letters, drop repeats), exact match.

A prompt is ``"reverse: cat"`` and the answer ``tac``. Words are 3–6 random lowercase letters by default,
so answers stay short enough for a tiny byte-level model; each operation is a different copy/permute
pattern over the prompt's bytes.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from typing import Literal

from rlbus.envs.base import HarnessConfig, Task, config_data, register_env
from rlbus.envs.chat import format_answer
from rlbus.envs.episode import Episode
from rlbus.envs.scoring import exact_match
from rlbus.schemas import Prompt, Reward

Op = Literal["reverse", "upper", "sort", "dedupe"]

OPS: dict[str, Callable[[str], str]] = {
    "reverse": lambda w: w[::-1],
    "upper": str.upper,
    "sort": lambda w: "".join(sorted(w)),
    "dedupe": lambda w: "".join(dict.fromkeys(w)),
}


class StringsConfig(HarnessConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which transformations and word lengths ``generate`` draws; one turn, no tools."""

    instructions: bool = False
    max_new_tokens: int = 32
    context_tokens: int = 64
    max_total_tokens: int = 64
    ops: tuple[Op, ...] = ("reverse", "upper", "sort", "dedupe")
    """Transformations to draw from."""
    min_len: int = 3
    """Shortest word."""
    max_len: int = 6
    """Longest word."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError("min_len must be ≥ 1 and ≤ max_len")
        if not self.ops:
            raise ValueError("ops must name at least one transformation")


class StringsTask(Task[StringsConfig]):
    config_type = StringsConfig

    def generate(self, seed: int, n: int) -> list[Prompt]:
        rng = random.Random(seed)
        config = config_data(self.config)
        return [self._prompt(rng, f"strings-{seed}-{i}", config) for i in range(n)]

    def _prompt(self, rng: random.Random, prompt_id: str, config: dict[str, object]) -> Prompt:
        op = rng.choice(self.config.ops)
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(self.config.min_len, self.config.max_len)))
        return Prompt(
            prompt_id=prompt_id, env="strings", text=f"{op}: {word}", reference=OPS[op](word), env_config=config
        )

    def reference_turns(self, prompt: Prompt) -> list[str]:
        if prompt.reference is not None:
            return [format_answer(prompt.reference)]
        op, _, word = prompt.text.partition(": ")
        if op not in OPS:
            raise ValueError(f"prompt {prompt.prompt_id}: unknown transformation {op!r}")
        return [format_answer(OPS[op](word))]

    async def score(self, episode: Episode, prompt: Prompt) -> Reward:
        return exact_match(episode, prompt)


register_env("strings", StringsTask)
