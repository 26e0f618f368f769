"""Built-in tasks, registered on import: ``arith``, ``strings``, ``kv`` (tools), ``python_fn`` (sandbox), and
``answer`` (a user's own problems from a prompt file, scored against their reference: no generator).

`generate_prompts` draws a seeded prompt set from any registered `Task`; `rlbus.envs.tasks.jsonl` reads
and writes prompt sets as JSONL files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from rlbus.envs.base import Task, make_env
from rlbus.envs.tasks import answer, arith, kv, python_fn, strings
from rlbus.errors import ConfigError
from rlbus.schemas import Prompt

__all__ = ["answer", "arith", "generate_prompts", "kv", "python_fn", "strings"]


def generate_prompts(env: str, *, seed: int, n: int, config: Mapping[str, Any] | None = None) -> list[Prompt]:
    """``n`` prompts of task ``env``, identical for identical ``seed`` and ``config``.

    Each prompt names the environment as ``env`` does (``prompt.env``): a user's task made from an import path
    (``mypkg.tasks:WordProblems``) or an entry point need not know the name it was configured under, and the
    rollout and reward workers that receive its prompts make the same environment from that name."""
    task = make_env(env, config)
    if not isinstance(task, Task):
        raise ConfigError("env", f"environment {env!r} does not generate prompts (it is not a Task)")
    return [p if p.env == env else msgspec.structs.replace(p, env=env) for p in task.generate(seed, n)]
