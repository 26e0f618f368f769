"""Prompt sets as JSONL files: load a dataset for the prompt producer, or save a generated one.

Format: UTF-8, one JSON object per line; blank lines are skipped. Fields:

    ===========  ========  =====================================================================
    field        required  meaning
    ===========  ========  =====================================================================
    env          yes       registered environment name (``answer``, ``arith``, ``kv``, ``python_fn`` …)
    text         yes       the task statement shown to the model
    reference    no        reference answer (verifiers, warm start); never shown to the model;
                           required by ``answer``
    env_config   no        object: the environment's configuration (limits, hidden tests, tables;
                           ``answer``: ``{"match": "numeric"}`` or ``"exact"``)
    prompt_id    no        unique id; default ``<file stem>-<line number>``
    group_size   no        rollouts per prompt (GRPO G); default 8 — as a run's ``[task] prompts``
                           file, the run's ``[task] group_size``
    metadata     no        object of string → string tags
    ===========  ========  =====================================================================

Answers of the ``answer`` environment are checked by its documented rule (`rlbus.envs.tasks.answer`):
``numeric`` (default) compares numbers after removing commas and spaces — integers exactly, decimals
within 1e-6 relative; ``exact`` compares whitespace-stripped strings.

Example::

    {"env": "arith", "text": "12+34=", "reference": "46"}
    {"env": "answer", "text": "Ann has 3 boxes of 12 eggs. How many eggs?", "reference": "36"}
    {"env": "kv", "text": "Find the number at the end of the chain from key abc.", "reference": "512",
     "env_config": {"table": {"abc": "512"}, "start": "abc"}}

(the last object is one line in the file). Any problem — bad JSON, an unknown field, a wrong type, an
unknown environment, an invalid ``env_config``, a ``reference`` the environment cannot check — raises
`PromptFileError` naming the file and line; `validate_prompts` checks a whole file that way (and rejects
a file without prompts).
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
    group_size: int | msgspec.UnsetType = msgspec.UNSET
    metadata: dict[str, str] = msgspec.field(default_factory=dict)


#: Rollouts per prompt of a line that gives no ``group_size``.
DEFAULT_GROUP_SIZE = 8


def iter_prompts(
    path: str | os.PathLike[str], *, validate: bool = True, group_size: int = DEFAULT_GROUP_SIZE
) -> Iterator[Prompt]:
    """Prompts of a JSONL file in order; ``validate`` also builds each line's environment from its config
    and lets it check the prompt (`Environment.validate_prompt`). ``group_size``: of lines that give none."""
    stem = Path(path).stem
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield _parse_line(path, number, line, stem, validate, group_size)


def load_prompts(
    path: str | os.PathLike[str], *, validate: bool = True, group_size: int = DEFAULT_GROUP_SIZE
) -> list[Prompt]:
    return list(iter_prompts(path, validate=validate, group_size=group_size))


def validate_prompts(path: str | os.PathLike[str]) -> int:
    """Parse and validate every line of a prompt file; returns how many prompts it holds. The first bad line
    raises `PromptFileError` (file and line); an unreadable file or one without prompts raises it for line 0."""
    try:
        count = sum(1 for _ in iter_prompts(path))
    except OSError as exc:
        raise PromptFileError(path, 0, f"cannot read the prompt file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise PromptFileError(path, 0, f"not UTF-8 text: {exc}") from None
    if count == 0:
        raise PromptFileError(path, 0, "the file holds no prompts")
    return count


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


def _parse_line(
    path: str | os.PathLike[str], number: int, line: str, stem: str, validate: bool, group_size: int
) -> Prompt:
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise PromptFileError(path, number, f"not valid JSON ({exc})") from None
    try:
        row = msgspec.convert(data, _Line)
    except msgspec.ValidationError as exc:
        raise PromptFileError(path, number, str(exc)) from None
    prompt = Prompt(
        prompt_id=row.prompt_id or f"{stem}-{number}",
        env=row.env,
        text=row.text,
        reference=row.reference,
        env_config=row.env_config,
        group_size=group_size if row.group_size is msgspec.UNSET else row.group_size,
        metadata=row.metadata,
    )
    if validate:
        try:
            make_env(row.env, row.env_config).validate_prompt(prompt)
        except ConfigError as exc:
            raise PromptFileError(path, number, str(exc)) from None
    return prompt
