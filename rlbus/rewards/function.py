"""A user's reward function (``[reward] function = "mypkg.rewards:score"``), scoring in the environment's place.

It takes the verifier's place in the reward worker::

    def score(prompt: str, completion: str, reference: str | None) -> float   # or: async def

``prompt`` is the task statement the model saw (``Prompt.text``), ``completion`` everything the model wrote,
its turns joined by newlines (the final answer is inside ``<answer>…</answer>``), ``reference`` the prompt's
reference answer (None when it has none). A plain function runs in a worker thread, a coroutine function on
the worker's event loop. Its reward keeps the source ``verifier`` (so the trainer's default
``reward_sources`` joins it, and ``kind = "both"`` pairs it with the judge), with ``components["function"]``
and ``metadata["function"]`` naming it. A function that raises, or returns anything but a finite number,
raises `RewardFunctionError`: the rollout goes to the dead-letter topic with that reason.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlbus.config import import_object
from rlbus.envs.episode import Episode
from rlbus.envs.scoring import make_reward
from rlbus.errors import ConfigError, RewardFunctionError
from rlbus.schemas import Prompt, Reward


@dataclass(frozen=True)
class RewardFunction:
    """A user's reward function named by import path (see the module docstring for its contract)."""

    path: str
    function: Callable[..., Any]

    @classmethod
    def load(cls, path: str, *, field: str = "reward.function") -> RewardFunction:
        """Import ``path`` (``module:name``) and check it can be called as ``(prompt, completion, reference)``;
        ConfigError names ``field`` and what failed."""
        function = import_object(path, field=field)
        if isinstance(function, type) or not callable(function):
            raise ConfigError(field, f"{path!r} is {_what(function)}, not a function "
                              "score(prompt, completion, reference) -> float")
        try:
            inspect.signature(function).bind("prompt", "completion", "reference")
        except TypeError as exc:
            raise ConfigError(field, f"{path!r} cannot be called as score(prompt, completion, reference): {exc}") \
                from None
        except ValueError:
            pass  # no signature to inspect (some builtins): calling it will tell
        return cls(path, function)

    async def score(self, episode: Episode, prompt: Prompt) -> Reward:
        args = (prompt.text, episode.model_text(), prompt.reference)
        try:
            if inspect.iscoroutinefunction(self.function) or inspect.iscoroutinefunction(
                    getattr(self.function, "__call__", None)):  # noqa: B004 (an async __call__ counts)
                value = await self.function(*args)
            else:
                value = await asyncio.to_thread(self.function, *args)
                if inspect.isawaitable(value):
                    value = await value
        except Exception as exc:  # the user's code: any failure is this rollout's dead letter, not a crash
            raise RewardFunctionError(f"reward.function {self.path} raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(value, numbers.Real):
            raise RewardFunctionError(f"reward.function {self.path} returned {_what(value)}, not a number")
        number = float(value)
        if not math.isfinite(number):
            raise RewardFunctionError(f"reward.function {self.path} returned {number}, not a finite number")
        return make_reward(episode, prompt, source="verifier", value=number, reason=f"reward.function {self.path}",
                           components={"function": number}, metadata={"function": self.path})


def _what(value: Any) -> str:
    if isinstance(value, type):
        return f"the class {value.__qualname__}"
    return f"{type(value).__name__} {value!r}"[:120]
