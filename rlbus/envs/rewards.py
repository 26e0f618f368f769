"""Deterministic rewards — the first kind docs/architecture.md §6 reaches for — and the one way a `Reward` is built.

Every reward of an episode from one source has the id ``{rollout_id}:{source}``, so a redelivered rollout
scored twice produces the same reward id and the trainer's join stays idempotent.

Exact match compares the final answer with the prompt's ``reference`` after stripping surrounding
whitespace (case and inner spacing matter: "Olleh" is not "olleh"). An episode that ended without an answer
(``max_turns``, ``length``) scores 0 with the finish reason recorded.

A user's reward function (``[reward] function = "mypkg.rewards:score"``, `RewardFunction`) takes the
verifier's place in the reward worker::

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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from rlbus.config import import_object
from rlbus.envs.episode import Episode
from rlbus.errors import ConfigError, RewardFunctionError
from rlbus.schemas import Prompt, Reward
from rlbus.schemas.reward import HACK_KINDS as HACK_KINDS  # environments report their hack monitor's findings under it


def make_reward(
    episode: Episode,
    prompt: Prompt,
    *,
    source: str,
    value: float,
    reason: str,
    components: dict[str, float] | None = None,
    metadata: dict[str, str] | None = None,
) -> Reward:
    return Reward(
        reward_id=f"{episode.episode_id}:{source}",
        rollout_id=episode.episode_id,
        prompt_id=prompt.prompt_id,
        source=source,
        value=value,
        components=components or {},
        reason=reason,
        created_at=time.time(),
        metadata=metadata or {},
    )


def normalize_answer(text: str) -> str:
    return text.strip()


def exact_match(episode: Episode, prompt: Prompt, *, expected: str | None = None) -> Reward:
    """1.0 when the answer equals ``expected`` (default: ``prompt.reference``) after stripping, else 0.0."""
    target = expected if expected is not None else prompt.reference
    if target is None:
        raise ValueError(f"prompt {prompt.prompt_id} has no reference answer to match")
    if episode.answer is None:
        reason = f"no answer (episode ended with {episode.finish_reason!r})"
        return make_reward(episode, prompt, source="verifier", value=0.0, reason=reason, components={"exact": 0.0})
    ok = normalize_answer(episode.answer) == normalize_answer(target)
    reason = "exact match" if ok else f"expected {target!r}, got {episode.answer[:200]!r}"
    value = 1.0 if ok else 0.0
    return make_reward(episode, prompt, source="verifier", value=value, reason=reason, components={"exact": value})


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


HackPolicy = Literal["zero", "penalty", "flag"]


def apply_hack_policy(reward: Reward, policy: HackPolicy, penalty: float) -> Reward:
    """``reward`` under the run's ``[reward] hack_policy`` when its environment found hacking
    (`Reward.hack_kinds`: ``HACK_KINDS`` in its metadata, or a tampered test run): ``zero`` scores 0,
    ``penalty`` subtracts ``penalty`` (not below 0), ``flag`` keeps the value. The reason says what was
    found and what was done; the metadata keeps the value before."""
    kinds = ",".join(reward.hack_kinds)
    if not kinds or policy == "flag":
        return reward
    value = 0.0 if policy == "zero" else max(0.0, reward.value - penalty)
    reason = f"hack monitor found {kinds} (hack_policy {policy}: {reward.value:g} → {value:g}); {reward.reason}"
    metadata = {**reward.metadata, "value_before_hack_policy": f"{reward.value:g}"}
    return msgspec.structs.replace(reward, value=value, reason=reason[:2000], metadata=metadata)

