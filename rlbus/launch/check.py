"""``rlbus config check FILE``: everything a run config names, checked before any process starts.

`check_config` loads the file as every role does (`rlbus.launch.config.load_config`, the environment
overrides applied), then checks what loading alone does not reach:

* ``[task]``: the environment exists (an unknown name suggests the closest registered one), is built from
  ``env_config`` (a misspelt field names ``task.env_config.<field>`` and the closest valid one) and draws a
  few prompts from ``seed`` as the prompt producer would;
* ``[model]``: the source resolves without loading weights, as its kind checks it (`ModelKind.check`: ``path``
  is a model directory, ``gguf`` a file, ``name`` a shipped model that is installed), ``checkpoint`` exists;
  ``device`` is one torch knows;
* ``[rollout]``: the engine kind loads (a user's, through its entry point or import path), and where it runs;
* ``[reward]``: every scorer named loads and checks what it will use (`Scorer.check`): a ``function`` resolves
  to a callable (when the config loads); with a judge, the rubric file parses (`rlbus.rewards.judge.load_rubric`)
  and an ``engine`` backend's model resolves as ``rlbus generate --model`` would (no backend is built);
* ``[dpo]``: the preference files named exist.

The first problem raises a `ConfigError` naming the field. `render_toml` prints the resolved config, every
table with its defaults filled (secrets masked), as TOML that loads back into the same config.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbus.config import SECRET_MASK, did_you_mean
from rlbus.errors import ConfigError
from rlbus.launch.config import (
    SECTIONS,
    DPOSection,
    ModelSection,
    RewardSection,
    RolloutSection,
    RunConfig,
    TaskSection,
    load_config,
    to_tables,
)
from rlbus.schemas import Prompt

#: Prompts drawn from the task to check that its config generates.
SAMPLE_PROMPTS = 2


@dataclass(frozen=True)
class Checked:
    """A config that passed, and one line for each thing checked beyond loading it."""

    config: RunConfig
    notes: list[str] = field(default_factory=list)


def check_config(path: Path, environ: Any = None) -> Checked:
    """Load ``path`` and check what it names; the first problem raises a ConfigError naming the field."""
    config = load_config(path, environ)
    notes = [check_task(config.task), *check_prompts(config.task), check_model(config.model)]
    notes += check_fit(config)
    notes.append(check_engine(config.rollout))
    notes += check_reward(config.reward)
    notes += check_dpo(config.dpo)
    return Checked(config, notes)


def check_before_run(config: RunConfig) -> None:
    """What ``rlbus up`` and ``rlbus demo --config`` check before anything starts: the task builds and draws
    prompts, the prompt file is valid, and its prompts fit the in-house policy (`check_fit`). Without this a
    prompt that cannot fit would be dead-lettered by every rollout worker and the run would make no step."""
    check_task(config.task)
    check_prompts(config.task)
    check_fit(config)


def check_prompts(task: TaskSection) -> list[str]:
    """``[task] prompts`` and ``eval_prompts``: every line parses and its environment accepts it (file and line
    named)."""
    from rlbus.envs.tasks.jsonl import validate_prompts

    files = [(name, path) for name, path in (("prompts", task.prompts), ("eval_prompts", task.eval_prompts))
             if path is not None]
    return [f"task.{name}: {path} holds {validate_prompts(path)} valid prompt(s)" for name, path in files]


def check_task(task: TaskSection) -> str:
    """``[task]``: the environment is registered, its ``env_config`` builds it, and it draws prompts."""
    from rlbus.envs import make_env, registered_envs
    from rlbus.envs.base import Task

    known = registered_envs()
    if task.env not in known and ":" not in task.env:
        raise ConfigError("task.env", f"unknown environment {task.env!r}{did_you_mean(task.env, known)} "
                          f"(registered: {', '.join(known)})")
    try:
        env = make_env(task.env, task.env_config)
    except ConfigError as exc:
        raise ConfigError(f"task.{exc.field}", exc.problem) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError("task.env_config", str(exc)) from None
    if not isinstance(env, Task):
        raise ConfigError("task.env", f"environment {task.env!r} does not generate prompts (it is not a Task)")
    try:
        prompts = env.generate(task.seed + 1000, SAMPLE_PROMPTS)
    except ConfigError as exc:
        raise ConfigError(f"task.env_config ({exc.field})", exc.problem) from None
    except (ValueError, TypeError, OSError) as exc:
        raise ConfigError("task.env_config", f"the environment cannot generate prompts: {exc}") from None
    return f"task: {task.env!r} builds from env_config and generates prompts ({len(prompts)} drawn)"


def check_fit(config: RunConfig) -> list[str]:
    """The in-house policy (byte tokens, so lengths are known without a tokenizer download): each prompt of the
    files, and a few drawn from ``env`` when RL or the evaluation draws from it, opens its episode (BOS, system
    message, task, the model's header) and still leaves one turn's ``max_new_tokens`` inside ``[model]
    max_seq``. A prompt that does not fit would be dead-lettered by every rollout worker, and the run would
    make no step."""
    from rlbus.models.kinds import model_kind

    known = model_kind(config.model.kind).known_context(config.model.options)
    if known is None:
        return []
    from rlbus.envs import World, env_for
    from rlbus.envs.tasks import generate_prompts
    from rlbus.envs.tasks.jsonl import load_prompts

    task = config.task
    checked: list[tuple[str, list[Prompt]]] = []
    for name, path in (("prompts", task.prompts), ("eval_prompts", task.eval_prompts)):
        if path is not None:
            checked.append((f"task.{name} ({path} line {{}})", load_prompts(path)))
    if task.prompts is None or task.eval_prompts is None:  # RL's prompts, or the evaluation's, are drawn
        drawn = generate_prompts(task.env, seed=task.seed + 1000, n=SAMPLE_PROMPTS, config=task.env_config)
        checked.append((f"task.env ({task.env!r}, drawn prompt {{}})", drawn))
    (chat, max_seq), longest = known, 0
    every = [(where, n, prompt) for where, prompts in checked for n, prompt in enumerate(prompts, start=1)]
    for where, n, prompt in every:
        env = env_for(prompt)
        system = env.instructions(World())
        messages = [{"role": "system", "content": system}] if system is not None else []
        opening = len(chat.render_messages([*messages, {"role": "user", "content": prompt.text}])[0])
        need = opening + len(chat.model_header) + env.limits().max_new_tokens
        longest = max(longest, need)
        if need > max_seq:
            raise ConfigError("model.max_seq", f"{where.format(n)} opens at {opening + len(chat.model_header)} "
                              f"tokens and a turn may sample env_config.max_new_tokens = "
                              f"{env.limits().max_new_tokens}: {need} > max_seq {max_seq}; raise [model] max_seq "
                              f"(a longer context) or shorten the prompt or its instructions")
    return [f"model: every checked prompt and one turn fit max_seq {max_seq} (the longest needs {longest})"] \
        if every else []


def check_model(model: ModelSection) -> str:
    """``[model]``: the source resolves (directory, file, shipped model, checkpoint) without loading weights,
    as its kind checks it (`ModelKind.check`)."""
    from rlbus.models.kinds import model_kind
    from rlbus.models.sources import resolve_device

    if model.device != "auto":
        try:
            resolve_device(model.device)
        except (RuntimeError, ValueError) as exc:
            raise ConfigError("model.device", f"{model.device!r} is not a device: {exc}") from None
    if model.checkpoint is not None:
        if not Path(model.checkpoint).expanduser().exists():
            raise ConfigError("model.checkpoint", f"no such file or directory: {model.checkpoint}")
        return f"model: checkpoint {model.checkpoint} exists"
    return model_kind(model.kind).check(model.options)


def check_engine(rollout: RolloutSection) -> str:
    """``[rollout] engine``: the engine kind loads (an entry point or import path of a user's package included),
    and which Python environment its rollout workers run in (`EngineKind.python`)."""
    from rlbus.engines.kinds import engine_kind

    kind = engine_kind(rollout.engine)
    try:
        python = kind.python()
    except ConfigError as exc:
        return f"rollout: engine {rollout.engine!r} loads, but its environment is missing here: {exc.problem}"
    where = "this Python environment" if python is None else f"the environment of {python}"
    return f"rollout: engine {rollout.engine!r} loads; its rollout workers run in {where}"


def check_reward(reward: RewardSection) -> list[str]:
    """``[reward]``: each scorer it names loads (a user's through its entry point or import path) and checks what
    it will use, without being built (`Scorer.check`: the reward function is callable, a judge's rubric parses
    and an engine backend's model resolves)."""
    from rlbus.rewards.scorers import SCORERS, ScorerContext, scorer_config

    context, notes = ScorerContext(function=reward.function), []
    for name in reward.scorer_names():
        scorer = SCORERS.get(name)
        if name not in SCORERS.builtin:
            notes.append(f"reward: scorer {name!r} loads ({scorer.__module__}:{scorer.__qualname__})")
        try:
            notes += scorer.check(scorer_config(name, reward.table(name)), context)
        except ConfigError as exc:
            raise ConfigError(f"reward.{name}.{exc.field}", exc.problem) from None
    return notes


def check_dpo(dpo: DPOSection) -> list[str]:
    """``[dpo]``: the preference files it names exist."""
    notes = []
    for name in ("data", "eval_data"):
        file = getattr(dpo, name)
        if file is not None:
            if not Path(file).expanduser().is_file():
                raise ConfigError(f"dpo.{name}", f"no such file: {file}")
            notes.append(f"dpo: {name} {file} exists")
    return notes


def resolved_tables(config: RunConfig) -> dict[str, Any]:
    """Every table of ``config`` with its defaults filled (`to_tables`), secrets masked."""
    tables = to_tables(config)
    tables = {name: tables[name] for name in SECTIONS if name in tables}
    if tables["bus"].get("sasl_password") is not None:
        tables["bus"]["sasl_password"] = SECRET_MASK
    return tables


def render_toml(tables: dict[str, Any]) -> str:
    """``tables`` as TOML: a nested table as ``[a.b]``, an unset (None) field as a comment."""
    lines: list[str] = []

    def table(name: str, data: dict[str, Any]) -> None:
        if lines:
            lines.append("")
        lines.append(f"[{name}]")
        nested = []
        for key, value in data.items():
            if isinstance(value, dict) and value:
                nested.append((f"{name}.{_key(key)}", value))
            elif value is None:
                lines.append(f"# {_key(key)} is unset")
            else:
                lines.append(f"{_key(key)} = {_value(value)}")
        for sub, value in nested:
            table(sub, value)

    for name, data in tables.items():
        table(name, data)
    return "\n".join(lines) + "\n"


def _key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")
