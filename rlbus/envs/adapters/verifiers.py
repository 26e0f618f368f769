"""``verifiers``: Prime Intellect's verifiers (v1) tasksets as rlbus tasks, scored by their tasks' own rewards.

verifiers (https://github.com/PrimeIntellect-ai/verifiers, ``pip install verifiers``) splits an environment in
three: a *taskset* (config in, typed `Task`s out: ``Taskset.load()``); each task's *scoring*, its ``@vf.reward``
methods (weighted) and ``@vf.metric`` methods, which read a `Trace` of the rollout; and the *agent* that plays
the task, a harness (its own agent loop) in a runtime (a container, a sandbox). rlbus takes the first two and
plays the tasks in its own harness. This module is the one place rlbus touches verifiers.

Name the taskset after the colon and give its config's fields (its `TasksetConfig` subclass, ``task``
included) in ``env_config.config``::

    [task]
    env = "verifiers:my-math-taskset"
    env_config = { config = { split = "train", task = { rewards = { brevity = { weight = 0.2 } } } } }

The name is a verifiers id, resolved as verifiers resolves it (``verifiers.v1.utils.loaders``: an installed
package exporting its Taskset subclass in ``__all__``, a hub id ``owner/name@version``, or a built-in under
``verifiers.v1.tasksets``), or an import path ``package.module:Class`` for a taskset class that is not a
package of its own (verifiers' loader takes only top-level modules). ``env_config.config.id`` is the name.

How it maps:

* **Prompts.** The taskset's tasks are read once per process (``load()`` order, each with its ``idx``; only
  the first ``limit`` when set). `Task.generate(seed, n)` draws them in a seeded order: a permutation of the
  tasks by ``random.Random(seed)``, then another when ``n`` is larger than the taskset. The task's
  ``prompt`` is the prompt text: a string as it is; messages flattened — system messages join the system
  prompt, user messages' text is joined by blank lines, and a conversation with assistant or tool messages
  (few-shot examples) becomes ``role: text`` blocks. ``system_prompt`` (and those system messages) opens the
  episode's system message, before rlbus's action instructions (which ``instructions = false`` leaves out).
  The prompt's metadata records the task's ``idx``, its ``key`` (verifiers' content identity) and the
  system prompt. The task data's ``reference_field`` (``answer`` by default), when it has one, is the
  prompt's ``reference``: warm start answers it; scoring never reads it.
* **Scoring.** The reward worker reads the taskset (once per process), takes task ``idx`` and checks that
  its key, prompt text and system prompt are the prompt's — so the task's data never crosses Kafka as JSON
  and a worker with another taskset version or config fails loudly instead of scoring another task. It
  builds a verifiers `Trace` of the episode: the task's own prompt messages (its system prompt, its prompt
  as verifiers presents it), then each model turn as a sampled assistant message (the raw text, tags
  included) and what the harness said in between (an unknown or malformed action, a summary request) as a
  user message; a summarized episode is one linear conversation (each new context's reopening is left
  out). The episode's final answer (the text in ``<answer>…</answer>``) is the trace's reply
  (``trace.last_reply``; ``""`` when the episode ended without one), and its stop condition is
  ``agent_completed``, ``max_turns`` or ``max_total_tokens`` (rlbus's ``stop``, ``max_turns``, ``length``).
  Then the task's own ``score(trace, runtime=None)`` runs — verifiers' offline scoring: its metrics, then
  its rewards (config-plugged ones, ``config.task.rewards``, included) — and the reward is the weighted sum
  the trace records (``trace.reward``: Σ score × weight), source ``verifier``. ``components`` has each
  reward's unweighted score under its name and each metric as ``metric.<name>``; ``metadata`` the weights.
  A reward that raises sends the rollout to the dead-letter topic (`RewardFunctionError`).

What does not map:

* **Harnesses.** verifiers' agent programs (bash, codex, claude_code, …) are their own agent loops; rlbus's
  harness plays every task instead (its tagged format, its turn limits). A taskset's bundled harness is not
  used, and harness metrics and rewards do not run; neither do ``@vf.stop`` and ``@vf.intercept`` hooks.
* **Envs.** A taskset that exports its own `Env` (multi-agent play, games, a simulated user: textarena,
  openenv) is refused at construction: rlbus plays one agent answering one prompt. So is a task without a
  prompt (a simulated user opens the conversation), at ``generate``.
* **Runtimes and containers.** A task that ``NEEDS_CONTAINER`` is refused; ``setup``, ``finalize`` and
  ``validate`` never run (there is no runtime). Rewards and metrics that take a ``runtime`` argument without a
  default are skipped by verifiers' own offline scoring (``task.score(trace, runtime=None)``), as verifiers
  skips them: rlbus names them in the reward's ``metadata["verifiers.skipped"]`` and its reason, and the
  reward is the sum of the others. A task none of whose rewards can run without a runtime is refused.
* **MCP toolsets** (``Taskset.toolsets``, ``Task.toolsets``) are refused: the model could not call them.
* **Judges.** Plugged judges (``config.task.judges``) call a model through their own client: refused at
  construction — rlbus's LM judge is the reward worker's (``[reward] kind = "judge"``). A reward method that
  calls a model itself runs as written, from the reward worker.
* **Images** in a prompt are refused (the harness is text-only).
* **Infinite tasksets** (``INFINITE``) run only with ``limit``: their first ``limit`` tasks are the taskset.
  Selection views (``include``, ``exclude``, ``shuffle``) are not exposed: rlbus's seeded draw replaces them.
* **Token data.** The trace has no token ids, log-probs, model calls or usage: rewards reading those see
  none.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import pkgutil
import random
import sys
import threading
import time
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import msgspec

from rlbus.config import did_you_mean, import_object, is_import_path
from rlbus.envs.base import HarnessConfig, Task, World, config_data, register_env
from rlbus.envs.chat import format_answer
from rlbus.envs.episode import Episode
from rlbus.envs.scoring import make_reward
from rlbus.errors import ConfigError, RewardFunctionError
from rlbus.schemas import Prompt, Reward

#: The prompt metadata keys: the task's position in ``load()``, its content identity, its system prompt.
IDX_KEY, TASK_KEY, SYSTEM_KEY = "verifiers.idx", "verifiers.key", "verifiers.system_prompt"
#: rlbus's finish reasons as verifiers stop conditions (``Trace.is_truncated`` reads the last two).
STOP_CONDITIONS = {"stop": "agent_completed", "max_turns": "max_turns", "length": "max_total_tokens"}


class VerifiersConfig(HarnessConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A verifiers taskset and its config; the harness fields default to one answer of up to 512 tokens."""

    taskset: str = ""
    """The taskset: a verifiers id (``my-taskset``, ``owner/my-taskset@1.0``) or ``package.module:Class``;
    the environment name after the colon sets it."""
    config: dict[str, Any] = msgspec.field(default_factory=dict)
    """The taskset config's fields (its `TasksetConfig` subclass: ``task``, ``system_prompt`` and its own)
    but ``id``, which is the taskset's name."""
    limit: int | None = None
    """Read only the first ``limit`` tasks of ``load()`` (an infinite taskset needs it)."""
    reference_field: str = "answer"
    """The task data field holding the reference answer warm start gives (none: ``""``)."""
    max_new_tokens: int = 512
    context_tokens: int = 2048

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.limit is not None and self.limit < 1:
            raise ValueError("limit must be ≥ 1 (or unset: the whole taskset)")


def _library() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ConfigError("env", "verifiers environments need the verifiers package: "
                          "pip install 'rlbus[envs]' (or pip install verifiers)") from None
    return vf


def _builtin_ids() -> list[str]:
    from verifiers.v1 import tasksets

    return sorted(m.name for m in pkgutil.iter_modules(tasksets.__path__))


def _exported_envs(module: Any) -> list[type]:
    """The `Env` subclasses ``module`` exports in ``__all__`` but the single-agent one (verifiers' own rule
    for a taskset's environment: `environment_class`)."""
    vf = _library()
    found = [getattr(module, name, None) for name in getattr(module, "__all__", ())]
    return [obj for obj in found if isinstance(obj, type) and issubclass(obj, vf.Env) and obj is not vf.Env
            and obj is not vf.SingleAgentEnv]


@functools.lru_cache(maxsize=32)
def _taskset_class(name: str) -> Any:
    """The Taskset subclass ``name`` stands for, checked against what rlbus cannot play."""
    vf = _library()
    field = "env_config.taskset"
    if is_import_path(name):
        cls = import_object(name, field=field)
        if not (isinstance(cls, type) and issubclass(cls, vf.Taskset)):
            raise ConfigError(field, f"{name!r} is not a verifiers Taskset subclass (verifiers.v1.Taskset)")
        envs = _exported_envs(sys.modules.get(name.partition(":")[0]))
    else:
        from verifiers.v1.utils.loaders import taskset_class

        try:
            cls = taskset_class(name)
            env = vf.environment_class(name)
        except Exception as exc:  # verifiers' loader: not installed, no __all__, its own import failing
            builtin = _builtin_ids()
            raise ConfigError(field, f"verifiers taskset {name!r} does not load: {type(exc).__name__}: {exc}"
                              f"{did_you_mean(name, builtin)} (built in: {', '.join(builtin)}; a taskset class "
                              "that is not an installed package: 'package.module:Class')") from None
        envs = [] if env is vf.SingleAgentEnv else [env]
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise ConfigError(field, f"{cls.__qualname__} is abstract: it does not implement {missing}")
    if envs:
        raise ConfigError(field, f"taskset {name!r} runs in its own verifiers Env ({envs[0].__qualname__}); "
                          "rlbus plays one agent answering a task's prompt, not an Env's episodes")
    task_type = cls.task_type()
    if getattr(task_type, "NEEDS_CONTAINER", False):
        raise ConfigError(field, f"the tasks of {name!r} ({task_type.__qualname__}) need a container "
                          "(NEEDS_CONTAINER); rlbus's harness has no verifiers runtime")
    return cls


def _validation_problem(exc: Any, config_type: type) -> ConfigError:
    """The first error of a pydantic ValidationError as a ConfigError naming ``env_config.config.<loc>``."""
    error = exc.errors(include_url=False)[0]
    loc = [str(p) for p in error.get("loc", ())]
    field = ".".join(["env_config.config", *loc])
    if error.get("type") == "extra_forbidden" and len(loc) == 1:
        fields = [f for f in getattr(config_type, "model_fields", {}) if f != "id"]
        return ConfigError(field, f"is not a field of {config_type.__name__}{did_you_mean(loc[0], fields)} "
                           f"(its fields: {', '.join(fields)})")
    return ConfigError(field, f"{error.get('msg', exc)} (got {error.get('input')!r})")


@functools.lru_cache(maxsize=32)
def _taskset(name: str, config_json: str) -> Any:
    """The taskset ``name`` built with its validated config."""
    vf = _library()
    from pydantic import ValidationError
    from verifiers.v1.utils.generic import concrete_type

    cls = _taskset_class(name)
    config_type = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
    try:
        config = config_type.model_validate({**json.loads(config_json), "id": name})
    except ValidationError as exc:
        raise _validation_problem(exc, config_type) from None
    if config.task.judges:
        raise ConfigError("env_config.config.task.judges", "verifiers judges call a model through their own "
                          "client; rlbus's LM judge is the reward worker's ([reward] kind = \"judge\")")
    task_type = cls.task_type()
    toolsets = [*cls.toolsets(config), *task_type.toolsets(config.task)]
    if toolsets:
        raise ConfigError("env_config.taskset", f"taskset {name!r} serves MCP toolsets "
                          f"({', '.join(type(t).__name__ for t in toolsets)}); rlbus's harness cannot offer them")
    try:
        return cls(config)
    except FileNotFoundError as exc:
        raise ConfigError("env_config.config.system_prompt", f"cannot be read: {exc}") from None
    except Exception as exc:  # the taskset's own __init__ refusing its config
        raise ConfigError("env_config.config", f"{cls.__qualname__} rejects its config: "
                          f"{type(exc).__name__}: {exc}") from None


def _requires_runtime(fn: Any) -> bool:
    """Whether verifiers' offline scoring skips ``fn``: it takes a ``runtime`` without a default."""
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


#: One taskset read at a time: reward workers score in threads, and ``load()`` need not be thread-safe.
_LOADING = threading.Lock()


def _tasks(name: str, config_json: str, limit: int | None) -> tuple[Any, ...]:
    """The taskset's tasks in ``load()`` order (the first ``limit``), read once per process."""
    with _LOADING:
        return _load(name, config_json, limit)


@functools.lru_cache(maxsize=16)
def _load(name: str, config_json: str, limit: int | None) -> tuple[Any, ...]:
    taskset = _taskset(name, config_json)
    view = taskset if limit is None else taskset.take(limit)
    if not view.bounded:
        raise ConfigError("env_config.limit", f"taskset {name!r} is infinite (INFINITE = True); set limit to "
                          "read its first tasks")
    tasks = tuple(view)
    if not tasks:
        raise ConfigError("env_config.taskset", f"taskset {name!r} loads no tasks")
    rewards = tasks[0].hooks("reward")
    if not rewards or all(_requires_runtime(fn) for fn in rewards):
        what = "needs a runtime" if rewards else "is missing"
        raise ConfigError("env_config.taskset", f"every reward of {type(tasks[0]).__qualname__} {what}: "
                          "nothing could score its episodes offline (task.score(trace, runtime=None))")
    return tasks


def _statement(data: Any) -> tuple[str, str | None]:
    """The prompt text and system prompt of task data (flattened as the module docstring says)."""
    from verifiers.v1.types import ImageUrlContentPart, content_text

    if data.prompt is None:
        raise ConfigError("env_config.taskset", f"task {data.idx} has no prompt (a simulated user opens its "
                          "conversation); rlbus's harness needs a task statement")
    system = [data.system_prompt] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return data.prompt, "\n\n".join(system) or None
    messages = list(data.prompt)
    if any(isinstance(part, ImageUrlContentPart) for m in messages if isinstance(m.content, list)
           for part in m.content):
        raise ConfigError("env_config.taskset", f"task {data.idx}'s prompt has images; rlbus's harness is "
                          "text-only")
    system += [text for m in messages if m.role == "system" and (text := content_text(m.content))]
    rest = [m for m in messages if m.role != "system"]
    if all(m.role == "user" for m in rest):
        text = "\n\n".join(t for m in rest if (t := content_text(m.content)))
    else:
        text = "\n\n".join(f"{m.role}: {content_text(m.content) or ''}" for m in rest)
    if not text:
        raise ConfigError("env_config.taskset", f"task {data.idx}'s prompt has no text")
    return text, "\n\n".join(system) or None


def _prompt_messages(data: Any) -> list[Any]:
    """The task's prompt as verifiers presents it: its system prompt, then the prompt's messages."""
    vf = _library()
    messages = [vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt or [])
    if data.system_prompt is not None:
        messages.insert(0, vf.SystemMessage(content=data.system_prompt))
    return messages


def _trace(task: Any, episode: Episode) -> Any:
    """A verifiers Trace of ``episode`` on ``task`` (see the module docstring)."""
    vf = _library()
    from verifiers.v1.state import state_cls

    messages: list[tuple[Any, bool]] = [(m, False) for m in _prompt_messages(task.data)]
    answered: set[int] = set()  # segments whose model has spoken: turns before that reopen a context
    for turn in episode.turns:
        if turn.role == "assistant":
            answered.add(turn.segment)
            messages.append((vf.AssistantMessage(content=turn.text), True))
        elif turn.segment in answered:
            messages.append((vf.UserMessage(content=turn.text), False))
    nodes = [vf.MessageNode(message=m, parent=i - 1 if i else None, sampled=sampled)
             for i, (m, sampled) in enumerate(messages)]
    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig(), name="agent"),
        state=state_cls(type(task))(),
        nodes=nodes,
        root_reply=episode.answer or "",
    )
    trace.stop(STOP_CONDITIONS.get(episode.finish_reason, episode.finish_reason))
    trace.ok = True
    return trace


@dataclass
class VerifiersWorld(World):
    """The world of a verifiers task: no tools; the task's system prompt for the system message."""

    system_prompt: str | None = None


class VerifiersTask(Task[VerifiersConfig]):
    config_type = VerifiersConfig
    name_field = "taskset"

    def __init__(self, config: VerifiersConfig) -> None:
        super().__init__(config)
        if not config.taskset:
            raise ConfigError("env_config.taskset", "names no verifiers taskset: env = \"verifiers:<taskset id "
                              "or package.module:Class>\"")
        if "id" in config.config:
            raise ConfigError("env_config.config.id", "is the taskset's name (env_config.taskset); leave it out")
        self._config_json = json.dumps(config.config, sort_keys=True)
        taskset = _taskset(config.taskset, self._config_json)  # cached: one check per process and config
        if config.limit is None and not taskset.bounded:
            raise ConfigError("env_config.limit", f"taskset {config.taskset!r} is infinite (INFINITE = True); "
                              "set limit to read its first tasks")

    def _tasks(self) -> tuple[Any, ...]:
        return _tasks(self.config.taskset, self._config_json, self.config.limit)

    def world(self, prompt: Prompt) -> AbstractAsyncContextManager[World]:
        return contextlib.nullcontext(VerifiersWorld(system_prompt=prompt.metadata.get(SYSTEM_KEY) or None))

    def instructions(self, world: World, *, native_tools: bool = False) -> str | None:
        system = world.system_prompt if isinstance(world, VerifiersWorld) else None
        actions = super().instructions(world, native_tools=native_tools)
        return "\n\n".join(part for part in (system, actions) if part) or None

    def generate(self, seed: int, n: int) -> list[Prompt]:
        tasks = self._tasks()
        rng = random.Random(seed)
        order: list[int] = []
        while len(order) < n:
            permutation = list(range(len(tasks)))
            rng.shuffle(permutation)
            order += permutation
        env, env_config = f"verifiers:{self.config.taskset}", config_data(self.config)
        prompts = []
        for i, position in enumerate(order[:n]):
            task = tasks[position]
            text, system = _statement(task.data)
            reference = getattr(task.data, self.config.reference_field, None) if self.config.reference_field else None
            metadata = {IDX_KEY: str(task.data.idx), TASK_KEY: task.key, "dataset": env}
            if system is not None:
                metadata[SYSTEM_KEY] = system
            prompts.append(Prompt(
                prompt_id=f"vf-{self.config.taskset}-{seed}-{i}", env=env, text=text, env_config=env_config,
                reference=None if reference is None else str(reference), metadata=metadata,
            ))
        return prompts

    def validate_prompt(self, prompt: Prompt) -> None:
        missing = [key for key in (IDX_KEY, TASK_KEY) if key not in prompt.metadata]
        if missing:
            raise ConfigError(f"metadata.{missing[0]}", "locates the prompt's verifiers task; verifiers prompts "
                              "come from the taskset (the task's generator), not a hand-written prompt file")

    def reference_turns(self, prompt: Prompt) -> list[str]:
        if prompt.reference is None:
            raise ValueError(f"prompt {prompt.prompt_id} has no reference answer: its task data has no "
                             f"{self.config.reference_field!r} field (env_config.reference_field)")
        return [format_answer(prompt.reference)]

    def task_of(self, prompt: Prompt) -> Any:
        """The verifiers task ``prompt`` was drawn from; ValueError when its metadata does not locate one whose
        key, text and system prompt are the prompt's (a prompt not made by `generate`, or another taskset
        version or config)."""
        try:
            idx, key = int(prompt.metadata[IDX_KEY]), prompt.metadata[TASK_KEY]
        except (KeyError, ValueError):
            raise ValueError(f"prompt {prompt.prompt_id} does not locate its verifiers task (metadata {IDX_KEY}, "
                             f"{TASK_KEY}); verifiers prompts come from the task's generator, not a prompt "
                             "file") from None
        tasks = self._tasks()
        if not 0 <= idx < len(tasks):
            raise ValueError(f"prompt {prompt.prompt_id}: taskset {self.config.taskset!r} has no task {idx} here "
                             f"({len(tasks)} tasks); the worker's taskset version or config differs")
        task = tasks[idx]
        text, system = _statement(task.data)
        if text != prompt.text or system != prompt.metadata.get(SYSTEM_KEY):
            raise ValueError(f"prompt {prompt.prompt_id}: task {idx} of {self.config.taskset!r} has another prompt "
                             "here; the worker's taskset version or config differs from the producer's")
        if task.key != key:
            raise ValueError(f"prompt {prompt.prompt_id}: task {idx} of {self.config.taskset!r} has other data "
                             f"here (key {task.key[:12]}…, the prompt's {key[:12]}…); the worker's taskset "
                             "version or config differs from the producer's")
        return task

    async def score(self, episode: Episode, prompt: Prompt) -> Reward:
        task = await asyncio.to_thread(self.task_of, prompt)  # the first call reads the taskset
        trace = _trace(task, episode)
        started = time.perf_counter()
        try:
            await task.score(trace, None)
        except Exception as exc:  # a reward or metric raised: the rollout is dead-lettered with the reason
            raise RewardFunctionError(f"verifiers task {type(task).__qualname__} {task.data.idx} of "
                                      f"{self.config.taskset!r} failed to score: {type(exc).__name__}: {exc}") from exc
        rewards = {name: r for name, r in trace.rewards.items() if r is not None}
        value = float(trace.reward)
        components = {name: float(r.score) for name, r in rewards.items()}
        components |= {f"metric.{name}": float(v) for name, v in trace.metrics.items() if v is not None}
        skipped = sorted(fn.__name__ for fn in [*task.hooks("reward"), *task.hooks("metric")] if _requires_runtime(fn))
        parts = ", ".join(f"{name} {r.score:g}×{r.weight:g}" for name, r in sorted(rewards.items()))
        reason = f"verifiers {type(task).__name__} reward {value:g} ({parts})"
        if skipped:
            reason += f"; skipped without a runtime: {', '.join(skipped)}"
        if episode.answer is None:
            reason = f"no answer (episode ended with {episode.finish_reason!r}); {reason}"
        metadata = {
            "grader": f"verifiers:{self.config.taskset}", "verifiers.idx": str(task.data.idx),
            "verifiers.weights": json.dumps({name: r.weight for name, r in sorted(rewards.items())}),
            "grade_ms": f"{(time.perf_counter() - started) * 1e3:.1f}",
        }
        if skipped:
            metadata["verifiers.skipped"] = ",".join(skipped)
        return make_reward(episode, prompt, source="verifier", value=value, reason=reason, components=components,
                           metadata=metadata)


register_env("verifiers", VerifiersTask)
