"""Reward scorers: what ``[reward] kind`` (or ``scorers``) names, and what a reward worker scores with.

A scorer (`Scorer`) is one module and one registration. It is built from its own config table —
``[reward.<name>]``, parsed into its ``config_type`` struct with errors naming ``reward.<name>.<field>`` — and the
run's `ScorerContext`; it scores a finished episode against its prompt (``async score(episode, prompt) ->
Reward``), closes what it holds, and reports figures for the reward worker's heartbeat (`Scorer.stats`). The
reward worker (`rlbus.consumers.reward`) scores each rollout with all of its scorers concurrently and publishes
every reward; the reward's ``source`` says which scorer made it, and the trainer's ``reward_sources`` say which
it waits for.

Built in, registered by import path: ``verifier`` (the prompt's environment, or the user's ``[reward] function``
in its place: `rlbus.rewards.verifier`) and ``judge`` (an LM judge with a rubric, ``[reward.judge]``:
`rlbus.rewards.judge.scorer`); ``both`` is ``verifier`` and ``judge`` (`ALIASES`). A user's scorer is an
``rlbus.scorers`` entry point or ``"package.module:Scorer"`` (docs/extending.md). Importing this module imports
no scorer; a run config loads the scorers it names, as it imports ``[reward] function``, so every process
that loads the config needs their package.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from rlbus.config import parse
from rlbus.errors import ConfigError
from rlbus.registry import Registry, subclass_check

if TYPE_CHECKING:
    from rlbus.envs.episode import Episode
    from rlbus.schemas import Prompt, Reward

#: Names that stand for several scorers (``[reward] kind = "both"``).
ALIASES: dict[str, tuple[str, ...]] = {"both": ("verifier", "judge")}


class NoConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The config of a scorer that takes none: an empty table."""


@dataclass(frozen=True)
class ScorerContext:
    """What a scorer may need of the run beyond its own table."""

    #: ``[task] seed`` (a local judge samples from it).
    seed: int = 0
    #: ``[reward] function``: a user's reward function by import path, in the environment's place as verifier.
    function: str | None = None
    #: Where secrets named by the environment are read (an API key's ``api_key_env``).
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ)


class Scorer(abc.ABC):
    """A reward scorer (see the module docstring): ``Scorer(config, context)``."""

    #: The struct ``[reward.<name>]`` is parsed into (frozen msgspec, a docstring per field); `NoConfig`: none.
    config_type: ClassVar[type[Any]] = NoConfig

    def __init__(self, config: Any, context: ScorerContext) -> None:
        self.config = config
        self.context = context

    @classmethod
    def validate(cls, config: Any) -> None:
        """Checks of ``config`` that hold only when the scorer is in use (the judge needs a rubric); raises
        ConfigError naming the field inside the scorer's table."""
        return None

    @classmethod
    def check(cls, config: Any, context: ScorerContext) -> list[str]:
        """``rlbus config check``'s lines: what the scorer will use resolves (files parse, models resolve),
        without building it; ConfigError naming the field inside its table otherwise."""
        return []

    @abc.abstractmethod
    async def score(self, episode: Episode, prompt: Prompt) -> Reward:
        """The reward of a finished episode; raises only when scoring itself is impossible (the rollout is then
        dead-lettered with the reason)."""

    async def close(self) -> None:
        """Release what the scorer holds (HTTP sessions); the reward worker calls it once, when it stops."""
        return None

    def stats(self) -> dict[str, Any]:
        """Figures for the reward worker's heartbeat (``rlbus status``, the dashboard)."""
        return {}


#: The scorers by name (`rlbus.registry`): ``[reward] kind`` / ``scorers``.
SCORERS: Registry[type[Scorer]] = Registry(
    "scorer", group="rlbus.scorers", field="reward.kind", example="Scorer",
    check=subclass_check(Scorer, "a reward scorer (a subclass of rlbus.rewards.scorers.Scorer)"),
)
SCORERS.register("verifier", "rlbus.rewards.verifier:VerifierScorer")
SCORERS.register("judge", "rlbus.rewards.judge.scorer:JudgeScorer")


def scorer_config(name: str, table: Any, *, field: str | None = None) -> Any:
    """Scorer ``name``'s config from its table (a struct of its ``config_type`` as is, or a mapping parsed into
    one), validated for use; errors name ``reward.<name>.<field>``."""
    kind = SCORERS.get(name, field=field)
    config = table if isinstance(table, kind.config_type) else parse(kind.config_type, dict(table or {}),
                                                                      prefix=f"reward.{name}")
    try:
        kind.validate(config)
    except ConfigError as exc:
        raise ConfigError(f"reward.{name}.{exc.field}", exc.problem) from None
    return config


def build_scorers(tables: Mapping[str, Any], context: ScorerContext) -> list[Scorer]:
    """The scorers named by ``tables``' keys (in order), each built from its table (`scorer_config`)."""
    return [SCORERS.get(name)(scorer_config(name, table), context) for name, table in tables.items()]


def expand(names: Sequence[str]) -> list[str]:
    """``names`` with each alias (`ALIASES`) replaced by the scorers it stands for."""
    return [one for name in names for one in ALIASES.get(name, (name,))]
