"""A rubric: the weighted dimensions a response is graded on, as data (a TOML file or a dict).

Shipped rubrics live in ``infra/rlbus/rubrics/``; `load_rubric` reads one and names the file and the field
of any mistake (``rubrics/x.toml: dimensions[1].weight``).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from rlbus.config import parse
from rlbus.errors import ConfigError


class Dimension(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One graded aspect of a response."""

    name: str
    """Key of the score in ``Reward.components``."""
    criterion: str
    """What the judge checks, as a question or statement."""
    weight: float = 1.0
    """Relative weight in the total; > 0."""
    scale: int = 10
    """Scores run from 0 to ``scale``."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.name):
            raise ValueError(f"name {self.name!r} must be 1-64 of A-Z a-z 0-9 _ . -")
        if not self.criterion.strip():
            raise ValueError("criterion must not be empty")
        if not self.weight > 0:
            raise ValueError(f"weight must be > 0, not {self.weight}")
        if not 1 <= self.scale <= 100:
            raise ValueError(f"scale must be in 1..100, not {self.scale}")


class Rubric(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The dimensions a response is graded on."""

    dimensions: list[Dimension]
    """At least one, with distinct names."""
    include_reference: bool = False
    """Show the judge the prompt's reference answer."""
    name: str = ""
    """How logs and the bench name the rubric."""
    instructions: str = ""
    """Extra guidance for the judge, added to every dimension's system message."""
    scale: int = 10
    """The scale of dimensions that do not give their own (applied by `from_dict`)."""

    def __post_init__(self) -> None:
        names = [d.name for d in self.dimensions]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"dimensions must be non-empty with distinct names, got {names}")

    @classmethod
    def from_dict(cls, data: Any, *, prefix: str = "rubric") -> Rubric:
        """Validate a rubric given as data; errors name the field (``rubric.dimensions[0].weight``)."""
        if isinstance(data, dict) and isinstance(data.get("dimensions"), list):
            scale = data.get("scale", 10)
            dims = [{"scale": scale, **d} if isinstance(d, dict) else d for d in data["dimensions"]]
            data = {**data, "dimensions": dims}
        try:
            rubric: Rubric = parse(cls, data, prefix=prefix)
        except ConfigError as exc:  # a dimension's own check names its field first: add it to the path
            word = re.match(r"(\w+) ", exc.problem)
            if word and exc.field.endswith("]") and word.group(1) in Dimension.__struct_fields__:
                raise ConfigError(f"{exc.field}.{word.group(1)}", exc.problem) from None
            raise
        return rubric


def load_rubric(path: str | Path) -> Rubric:
    """A rubric from a TOML file (``[[dimensions]]`` tables; see ``infra/rlbus/rubrics/``). Errors are
    ConfigErrors naming the file and the field (``rubrics/x.toml: dimensions[1].weight``)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read the rubric: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), f"the rubric is not valid TOML: {exc}") from None
    try:
        return Rubric.from_dict(data, prefix="")
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc.field}" if exc.field else str(path), exc.problem) from None
