"""``reasoning_gym``: reasoning-gym's procedural datasets as rlbus tasks, scored by their own ``score_answer``.

reasoning-gym (https://github.com/open-thought/reasoning-gym, ``pip install reasoning-gym``) generates
problems from a seed: ``create_dataset(name, seed=..., size=..., **config)`` gives entries with a
``question``, an ``answer`` and ``metadata``, and ``dataset.score_answer(answer, entry)`` grades an answer
in [0, 1] (partial credit where the dataset gives it). This module is the one place rlbus touches it.

Name a dataset after the colon, its own config fields in ``env_config.config``::

    [task]
    env = "reasoning_gym:basic_arithmetic"
    env_config = { config = { min_terms = 2, max_terms = 2, operators = ["+", "-"] } }

How it maps:

* **Prompts.** `Task.generate(seed, n)` is the dataset with that ``seed`` and ``size = n``; prompt ``i`` is
  entry ``i``: its ``question`` is the prompt text, its ``answer`` the reference (warm start answers it).
  The prompt's metadata records ``seed``, ``size`` and ``index``.
* **Scoring.** The reward worker regenerates the entry from those three (reasoning-gym's entries are a
  function of ``seed + index`` and the config) and checks that its question is the prompt's text, so the
  entry's ``metadata`` (which many graders read) never has to cross Kafka as JSON. The final answer
  (``<answer>…</answer>``) goes to the dataset's ``score_answer``; its value is the reward, source
  ``verifier``. An episode without an answer scores ``score_answer(None, entry)`` (0 for every dataset).
* **Format.** The model answers in rlbus's tagged format (the system message asks for it; with
  ``instructions = false`` it must learn the tags from warm start). reasoning-gym's own prompt templates
  (``<answer>`` in a chat message) are not used: rlbus's harness opens the episode.

What does not map: reasoning-gym's curricula (``create_curriculum``, difficulty that moves with the
score) — rlbus keeps one config per run; and composite datasets' weights can be given as
``config`` but their per-source scores are one number here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import Any

import msgspec

from rlbus.config import did_you_mean
from rlbus.envs.base import HarnessConfig, Task, config_data, register_env
from rlbus.envs.chat import format_answer
from rlbus.envs.episode import Episode
from rlbus.envs.scoring import make_reward
from rlbus.errors import ConfigError
from rlbus.schemas import Prompt, Reward

#: The prompt metadata keys that locate a prompt's entry in its dataset.
SEED_KEY, SIZE_KEY, INDEX_KEY = "reasoning_gym.seed", "reasoning_gym.size", "reasoning_gym.index"


class ReasoningGymConfig(HarnessConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A reasoning-gym dataset and its config; the harness fields default to one turn with instructions."""

    dataset: str = ""
    """The dataset's registered name (``basic_arithmetic``, ``chain_sum``, ``leg_counting`` …); the
    environment name after the colon sets it."""
    config: dict[str, Any] = msgspec.field(default_factory=dict)
    """The dataset config's fields (its dataclass: ``BasicArithmeticDatasetConfig`` …) but ``seed`` and
    ``size``, which come from the run."""
    max_new_tokens: int = 128


def _library() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError("env", "reasoning_gym environments need the reasoning-gym package: "
                          "pip install 'rlbus[envs]' (or pip install reasoning-gym)") from None
    return reasoning_gym


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str, seed: int, size: int) -> Any:
    """The dataset (cached: some read word lists or puzzles as they are built)."""
    return _library().create_dataset(name, seed=seed, size=size, **json.loads(config_json))


class ReasoningGymTask(Task[ReasoningGymConfig]):
    config_type = ReasoningGymConfig
    name_field = "dataset"

    def __init__(self, config: ReasoningGymConfig) -> None:
        super().__init__(config)
        known = sorted(_library().factory.DATASETS)
        if config.dataset not in known:
            hint = did_you_mean(config.dataset, known) if config.dataset else ""
            raise ConfigError("env_config.dataset", f"unknown reasoning-gym dataset {config.dataset!r}{hint} "
                              f"({len(known)} known: reasoning_gym.factory.DATASETS)")
        reserved = {"seed", "size"} & set(config.config)
        if reserved:
            raise ConfigError(f"env_config.config.{sorted(reserved)[0]}", "is set by rlbus (the run's seed and "
                              "the number of prompts drawn); leave it out")
        config_type: Any = _library().factory.DATASETS[config.dataset][1]
        if isinstance(config_type, type) and dataclasses.is_dataclass(config_type):
            fields = [f.name for f in dataclasses.fields(config_type) if f.name not in ("seed", "size")]
            for name in config.config:
                if name not in fields:
                    raise ConfigError(f"env_config.config.{name}", f"is not a field of {config_type.__name__}"
                                      f"{did_you_mean(name, fields)} (its fields: {', '.join(fields)})")
        self._config_json = json.dumps(config.config, sort_keys=True)
        try:  # a bad field or value fails here, at start, not in a reward worker later
            self._entry(seed=0, size=1, index=0)
        except (TypeError, ValueError, AssertionError) as exc:
            raise ConfigError("env_config.config", f"reasoning-gym rejects the config of {config.dataset!r}: "
                              f"{type(exc).__name__}: {exc}") from None

    def _entry(self, *, seed: int, size: int, index: int) -> dict[str, Any]:
        entry: dict[str, Any] = _dataset(self.config.dataset, self._config_json, seed, size)[index]
        return entry

    def generate(self, seed: int, n: int) -> list[Prompt]:
        env_config = config_data(self.config)
        prompts = []
        for i in range(n):
            entry = self._entry(seed=seed, size=n, index=i)
            prompts.append(Prompt(
                prompt_id=f"rg-{self.config.dataset}-{seed}-{i}", env=f"reasoning_gym:{self.config.dataset}",
                text=str(entry["question"]), reference=str(entry["answer"]), env_config=env_config,
                metadata={SEED_KEY: str(seed), SIZE_KEY: str(n), INDEX_KEY: str(i),
                          "dataset": f"reasoning_gym:{self.config.dataset}"},
            ))
        return prompts

    def reference_turns(self, prompt: Prompt) -> list[str]:
        """The prompt's ``reference`` as the answer (what every task's warm start answers, so a warm start that
        alters references, the sloppy teacher's ``n + 1``, alters this one too); the entry's without one."""
        answer = prompt.reference if prompt.reference is not None else str(self.entry_of(prompt)["answer"])
        return [format_answer(answer)]

    def entry_of(self, prompt: Prompt) -> dict[str, Any]:
        """The dataset entry ``prompt`` was drawn from; ValueError when its metadata does not locate one whose
        question is the prompt's text (a prompt not made by `generate`, or another reasoning-gym version)."""
        return self._located(prompt)[1]

    def _located(self, prompt: Prompt) -> tuple[Any, dict[str, Any]]:
        """The dataset ``prompt`` was drawn from and its entry (see `entry_of`)."""
        try:
            seed, size, index = (int(prompt.metadata[key]) for key in (SEED_KEY, SIZE_KEY, INDEX_KEY))
        except (KeyError, ValueError):
            raise ValueError(f"prompt {prompt.prompt_id} does not locate its reasoning-gym entry (metadata "
                             f"{SEED_KEY}, {SIZE_KEY}, {INDEX_KEY}); reasoning_gym prompts come from the "
                             "task's generator, not a prompt file") from None
        dataset = _dataset(self.config.dataset, self._config_json, seed, size)
        entry: dict[str, Any] = dataset[index]
        if str(entry["question"]) != prompt.text:
            raise ValueError(f"prompt {prompt.prompt_id}: entry {index} of {self.config.dataset!r} (seed {seed}) "
                             "is another question here; the worker's reasoning-gym version or dataset config "
                             "differs from the producer's")
        return dataset, entry

    async def score(self, episode: Episode, prompt: Prompt) -> Reward:
        dataset, entry = self._located(prompt)
        started = time.perf_counter()
        value = float(dataset.score_answer(episode.answer, entry))
        if episode.answer is None:
            reason = f"no answer (episode ended with {episode.finish_reason!r})"
        else:
            reason = f"reasoning_gym {self.config.dataset} score {value:g} (expected {str(entry['answer'])[:80]!r})"
        return make_reward(episode, prompt, source="verifier", value=value, reason=reason,
                           components={"reasoning_gym": value},
                           metadata={"grader": f"reasoning_gym:{self.config.dataset}",
                                     "grade_ms": f"{(time.perf_counter() - started) * 1e3:.1f}"})


register_env("reasoning_gym", ReasoningGymTask)
