"""The environment protocol: harness (tools and turn limits), world state, reward — registered by name.

An episode runs in three parts (docs/architecture.md §6). The *harness* is the agent loop (`rlbus.envs.agent`) with the
environment's tools and limits. The *world* is per-episode state — a sandbox directory and the processes
run in it, an in-memory table — created when the episode starts and destroyed when it ends:
``async with env.world(prompt) as world``. The *reward* is `Environment.score`, a function of the finished
episode and its prompt, so a reward worker in another process can compute it from the rollout alone.

Environments are configured by data: a `Prompt` names its environment (``prompt.env``) and carries the
configuration (``prompt.env_config``), which is validated into the environment's msgspec config struct;
unknown fields and bad values raise `ConfigError` naming the field (``env_config.max_turns``). A `Task`
is an environment that can also generate its own prompts from a seed and solve them (reference turns for
warm start / supervised mid-training).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import msgspec

from rlbus.config import parse
from rlbus.envs.chat import format_answer, format_tool_call
from rlbus.errors import ConfigError
from rlbus.registry import Registry, subclass_check
from rlbus.schemas import Prompt, Reward

if TYPE_CHECKING:
    from rlbus.envs.episode import Episode


class HarnessConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Turn-loop limits shared by every environment; each environment's config extends it."""

    max_turns: int = 1
    """Model turns (actions) before the episode ends with ``max_turns``; summary turns do not count."""
    max_new_tokens: int = 64
    """Tokens the model may sample in one turn."""
    context_tokens: int = 1024
    """Tokens one context segment may hold (the model's window, or less)."""
    max_total_tokens: int = 4096
    """Tokens of the whole episode, all segments together; beyond it the episode ends with ``length``."""
    summarize: bool = False
    """When a context is full, ask the model for a summary and continue in a fresh context from it."""
    max_segments: int = 4
    """Context segments an episode may use when summarizing."""
    summary_max_tokens: int = 128
    """Tokens the model may sample for a summary."""
    max_observation_tokens: int = 256
    """Tool output beyond this many tokens is cut."""
    tool_timeout_s: float = 10.0
    """Seconds one tool call may take before the model sees a timeout error."""
    instructions: bool = True
    """Open each episode with a system message describing the action format and the tools."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_new_tokens", "context_tokens", "max_total_tokens", "max_segments"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1")
        if self.summary_max_tokens < 1 or self.max_observation_tokens < 0 or self.tool_timeout_s <= 0:
            raise ValueError("summary_max_tokens must be ≥ 1, max_observation_tokens ≥ 0, tool_timeout_s > 0")

    def limits(self) -> Limits:
        return Limits(
            max_turns=self.max_turns,
            max_new_tokens=self.max_new_tokens,
            context_tokens=self.context_tokens,
            max_total_tokens=self.max_total_tokens,
            summarize=self.summarize,
            max_segments=self.max_segments,
            summary_max_tokens=self.summary_max_tokens,
            max_observation_tokens=self.max_observation_tokens,
            tool_timeout_s=self.tool_timeout_s,
        )


@dataclass(frozen=True, kw_only=True)
class Limits:
    """The agent loop's budgets, as plain arguments (see `HarnessConfig` for each field's meaning)."""

    max_turns: int = 1
    max_new_tokens: int = 64
    context_tokens: int = 1024
    max_total_tokens: int = 4096
    summarize: bool = False
    max_segments: int = 4
    summary_max_tokens: int = 128
    max_observation_tokens: int = 256
    tool_timeout_s: float = 10.0


@dataclass(frozen=True)
class Tool:
    """A tool the model can call with ``<tool name="NAME">INPUT</tool>`` (or a native ``<tool_call>`` whose
    ``arguments.input`` is INPUT: `rlbus.envs.tool_calls`); ``run`` maps INPUT to output.

    A tool with ``parameters`` (a JSON schema of its arguments object) is offered with that schema, and a
    native call's whole ``arguments`` object reaches ``run`` as JSON text. A ``final`` tool ends the
    episode when it succeeds (``submit``); its output becomes the episode's answer."""

    name: str
    description: str
    run: Callable[[str], Awaitable[str]]
    parameters: Mapping[str, Any] | None = None
    final: bool = False


@dataclass
class World:
    """One episode's state as the harness sees it: the tools bound to that state.

    ``result``, when set, is awaited after the last turn and before the world closes; what it returns goes
    into the rollout's metadata (the coding environment's final diff)."""

    tools: dict[str, Tool] = field(default_factory=dict)
    result: Callable[[], Awaitable[dict[str, str]]] | None = None


C = TypeVar("C", bound=HarnessConfig)


class Environment(abc.ABC, Generic[C]):
    """Harness limits and instructions, per-episode world, reward. One instance per prompt config."""

    config_type: ClassVar[type[Any]] = HarnessConfig
    #: Set by an adapter for another library's environments (`rlbus.envs.adapters`): the config field that
    #: names one of them, so ``env = "<registered name>:<item>"`` (``reasoning_gym:basic_arithmetic``) makes
    #: this class with ``{name_field: item}`` added to its config.
    name_field: ClassVar[str | None] = None

    def __init__(self, config: C) -> None:
        self.config = config

    def limits(self) -> Limits:
        return self.config.limits()

    def world(self, prompt: Prompt) -> AbstractAsyncContextManager[World]:
        """The episode's world; the default has no state and no tools."""
        return contextlib.nullcontext(World())

    def instructions(self, world: World, *, native_tools: bool = False) -> str | None:
        """The system message (action format and tools), or None when ``instructions`` is off.

        With ``native_tools`` the chat template describes the tools (their schemas), so this says only how
        to answer."""
        if not self.config.instructions:
            return None
        return describe_actions(world.tools, native_tools=native_tools)

    def validate_prompt(self, prompt: Prompt) -> None:
        """Check a prompt this environment will score (a prompt file line: its ``reference``); raises
        ConfigError naming the field. The default accepts every prompt."""

    @abc.abstractmethod
    async def score(self, episode: Episode, prompt: Prompt) -> Reward:
        """The reward of a finished episode; raises only when scoring itself is impossible (no sandbox)."""


class Task(Environment[C]):
    """An environment that can generate prompts from a seed and solve them."""

    @abc.abstractmethod
    def generate(self, seed: int, n: int) -> list[Prompt]:
        """``n`` prompts, the same for the same seed and config; each carries its ``reference`` answer."""

    @abc.abstractmethod
    def reference_turns(self, prompt: Prompt) -> list[str]:
        """The model turns of a correct solution (observations in between come from the world)."""


def config_data(config: HarnessConfig) -> dict[str, Any]:
    """A config as plain JSON data (lists, not tuples) — what ``Prompt.env_config`` carries."""
    data: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(config))
    return data


def describe_actions(tools: Mapping[str, Tool], *, native_tools: bool = False) -> str:
    lines = [f"Give the final answer as {format_answer('ANSWER')}."]
    if native_tools:
        return lines[0]
    if tools:
        lines.insert(0, f"Call a tool with {format_tool_call('NAME', 'INPUT')}.")
        lines.append("Tools:")
        lines += [f"- {t.name}: {t.description}" for t in tools.values()]
    return "\n".join(lines)


#: The package entry point group an installed package registers its environments in (``name = "pkg.mod:Class"``).
ENTRY_POINT_GROUP = "rlbus.envs"

#: Every environment by name (`rlbus.registry`): the built-in tasks register when `rlbus.envs` is imported,
#: which Python does before this module, so they are always here; a user's package adds its own by import path
#: or entry point, resolved on first use.
ENVS: Registry[type[Environment[Any]]] = Registry(
    "environment", group=ENTRY_POINT_GROUP, field="env", entry_points=lambda group: entry_points(group=group),
    check=subclass_check(Environment, "an environment class (a subclass of rlbus.envs.Environment, or "
                                      "rlbus.envs.Task to generate prompts)"),
)
#: The built-in registrations and the environments loaded so far (`Registry.builtin`, `Registry.loaded`).
_REGISTRY = ENVS.builtin
_LOADED = ENVS.loaded


def register_env(name: str, env_type: type[Environment[Any]]) -> None:
    """Make ``env_type`` available to `make_env` (and to prompts) as ``name``."""
    ENVS.register(name, env_type)


def registered_envs() -> list[str]:
    """The names `make_env` knows: the built-in ones and those of installed packages' ``rlbus.envs`` entry
    points (not loaded here). Any ``module:Class`` import path works too."""
    return ENVS.names()


def env_type(name: str) -> type[Environment[Any]]:
    """The environment class ``name`` stands for: a registered name (built in), an import path
    (``mypkg.tasks:WordProblems``, imported here) or the name of an ``rlbus.envs`` entry point of an installed
    package (loaded here). Every process makes its environments through this, so a user's environment needs
    no wiring beyond being importable. ConfigError names ``env`` and says what failed."""
    adapter = _adapter(name)
    if adapter is not None:
        return adapter[0]
    return ENVS.get(name)


def make_env(name: str, config: Mapping[str, Any] | None = None) -> Environment[Any]:
    """The environment ``name`` (see `env_type`) configured by ``config``; ConfigError names an unknown or
    unloadable env or a bad field."""
    found = env_type(name)
    data = dict(config or {})
    adapter = _adapter(name)
    if adapter is not None and adapter[0].name_field is not None:
        field_name, item = adapter[0].name_field, adapter[1]
        if data.setdefault(field_name, item) != item:
            raise ConfigError(f"env_config.{field_name}", f"{data[field_name]!r} contradicts the environment's "
                              f"name {name!r}; give it once")
    return found(parse(found.config_type, data, prefix="env_config"))


def _adapter(name: str) -> tuple[type[Environment[Any]], str] | None:
    """``(class, item)`` when ``name`` is ``"<adapter>:<item>"`` for a registered adapter (a class with a
    ``name_field``), else None: an import path's module is never a registered name."""
    prefix, sep, item = name.partition(":")
    found = _REGISTRY.get(prefix) if sep else None
    if not isinstance(found, type) or found.name_field is None:
        return None
    if not item:
        raise ConfigError("env", f"{name!r} names no {found.name_field} after the colon")
    return found, item


def env_for(prompt: Prompt) -> Environment[Any]:
    """The environment a prompt names, configured by its ``env_config``."""
    return make_env(prompt.env, prompt.env_config)
