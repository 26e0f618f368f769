"""Prompt sets as JSONL files: load a dataset for the prompt producer, or save a generated one.

Format: UTF-8, one JSON object per line; blank lines are skipped. Fields:

    ===========  ========  =====================================================================
    field        required  meaning
    ===========  ========  =====================================================================
    env          yes       registered environment name (``arith``, ``kv``, ``python_fn`` …)
    text         yes       the task statement shown to the model
    reference    no        reference answer (verifiers, warm start); never shown to the model
    env_config   no        object: the environment's configuration (limits, hidden tests, tables)
    prompt_id    no        unique id; default ``<file stem>-<line number>``
    group_size   no        rollouts per prompt (GRPO G); default 8
    metadata     no        object of string → string tags
    ===========  ========  =====================================================================

Example::

    {"env": "arith", "text": "12+34=", "reference": "46"}
    {"env": "kv", "text": "Find the number at the end of the chain from key abc.", "reference": "512",
     "env_config": {"table": {"abc": "512"}, "start": "abc"}}

(the second object is one line in the file). Any problem — bad JSON, an unknown field, a wrong type, an
unknown environment, an invalid ``env_config`` — raises `PromptFileError` naming the file and line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from rlbus.envs.base import make_env
from rlbus.errors import ConfigError, PromptFileError
from rlbus.schemas import Prompt


class _Line(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    env: str
    text: str
    reference: str | None = None
    env_config: dict[str, Any] = msgspec.field(default_factory=dict)
    prompt_id: str | None = None
    group_size: int = 8
    metadata: dict[str, str] = msgspec.field(default_factory=dict)


def iter_prompts(path: str | os.PathLike[str], *, validate: bool = True) -> Iterator[Prompt]:
    """Prompts of a JSONL file in order; ``validate`` also builds each line's environment from its config."""
    stem = Path(path).stem
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield _parse_line(path, number, line, stem, validate)


def load_prompts(path: str | os.PathLike[str], *, validate: bool = True) -> list[Prompt]:
    return list(iter_prompts(path, validate=validate))


def dump_prompts(prompts: Iterable[Prompt], path: str | os.PathLike[str]) -> int:
    """Write prompts in the format above; returns how many were written."""
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            line = _Line(env=p.env, text=p.text, reference=p.reference, env_config=p.env_config,
                         prompt_id=p.prompt_id, group_size=p.group_size, metadata=p.metadata)  # fmt: skip
            f.write(json.dumps(msgspec.to_builtins(line), ensure_ascii=False) + "\n")
            count += 1
    return count


def _parse_line(path: str | os.PathLike[str], number: int, line: str, stem: str, validate: bool) -> Prompt:
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise PromptFileError(path, number, f"not valid JSON ({exc})") from None
    try:
        row = msgspec.convert(data, _Line)
    except msgspec.ValidationError as exc:
        raise PromptFileError(path, number, str(exc)) from None
    if validate:
        try:
            make_env(row.env, row.env_config)
        except ConfigError as exc:
            raise PromptFileError(path, number, str(exc)) from None
    return Prompt(
        prompt_id=row.prompt_id or f"{stem}-{number}",
        env=row.env,
        text=row.text,
        reference=row.reference,
        env_config=row.env_config,
        group_size=row.group_size,
        metadata=row.metadata,
    )
