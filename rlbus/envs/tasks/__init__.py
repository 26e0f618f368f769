"""Built-in tasks, registered on import: ``arith``, ``strings``, ``kv`` (tools), ``python_fn`` (sandbox), and
``answer`` (a user's own problems from a prompt file, scored against their reference: no generator).

`generate_prompts` draws a seeded prompt set from any registered `Task`; `rlbus.envs.tasks.jsonl` reads
and writes prompt sets as JSONL files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlbus.envs.base import Task, make_env
from rlbus.envs.tasks import answer, arith, kv, python_fn, strings
from rlbus.errors import ConfigError
from rlbus.schemas import Prompt

__all__ = ["answer", "arith", "generate_prompts", "kv", "python_fn", "strings"]


def generate_prompts(env: str, *, seed: int, n: int, config: Mapping[str, Any] | None = None) -> list[Prompt]:
    """``n`` prompts of task ``env``, identical for identical ``seed`` and ``config``."""
    task = make_env(env, config)
    if not isinstance(task, Task):
        raise ConfigError("env", f"environment {env!r} does not generate prompts (it is not a Task)")
    return task.generate(seed, n)
