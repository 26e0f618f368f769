"""Registries: where extensions plug in by name (docs/extending.md).

An environment, an inference engine, a model kind and a reward scorer are each found through a `Registry`:
a run config names one (``[task] env``, ``[rollout] engine``, ``[model] kind``, ``[reward] kind``) and every
process resolves the name itself, in this order:

1. a *built-in* registration (`Registry.register`): the object itself, or a ``"package.module:attr"`` path
   loaded on first use, so a registry can name a built-in whose module imports torch or vLLM without
   importing it (a run config is checked against the names in processes that never load torch);
2. an *import path* ``"package.module:attr"`` of a user's object (the package installed, or on PYTHONPATH);
3. an *entry point* of an installed package in the registry's group (``[project.entry-points."rlbus.engines"]
   mine = "mypkg.engine:MyEngine"`` in the package's pyproject), listed without being loaded.

A resolved object passes the registry's ``check`` (an engine kind must subclass `EngineKind` …) and is
cached by name. Every failure is a `ConfigError` naming the config field: an unknown name lists what is
registered and suggests the closest one; a plug-in that fails to load names its entry point and what it
raised. Entry points are the packaging standard's plug-in mechanism (setuptools', pytest's ``pytest11``,
importlib.metadata); vLLM's model registry and prime-rl's loss registry name built-ins the same way, by
lazy import path.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar

from rlbus.config import did_you_mean, import_object, is_import_path
from rlbus.errors import ConfigError

T = TypeVar("T")

#: How a registry lists the entry points of its group (`importlib.metadata.entry_points` by default).
EntryPoints = Callable[[str], Iterable[EntryPoint]]


def installed_entry_points(group: str) -> Iterable[EntryPoint]:
    """The entry points installed packages declare in ``group`` (not loaded)."""
    return entry_points(group=group)


class Registry(Generic[T]):
    """Named plug-ins of one kind: built-in registrations, import paths and the entry points of ``group``.

    ``what`` names the kind in messages (``"engine"``); ``field`` is the config field errors name unless a
    lookup gives its own; ``check(obj)`` returns what is wrong with a loaded object (``"is a function, not an
    engine kind …"``) or None; ``example`` is what a user's import path points at (``Class``)."""

    def __init__(
        self,
        what: str,
        *,
        group: str,
        field: str,
        check: Callable[[Any], str | None] | None = None,
        example: str = "Class",
        entry_points: EntryPoints = installed_entry_points,
    ) -> None:
        self.what = what
        self.group = group
        self.field = field
        self._check = check
        self._example = example
        self._entry_points = entry_points
        #: Built-in registrations: the object, or the import path it is loaded from on first use.
        self.builtin: dict[str, T | str] = {}
        #: Objects resolved so far (built-ins loaded by path, import paths, entry points), by name.
        self.loaded: dict[str, T] = {}

    def register(self, name: str, obj: T | str) -> None:
        """Make ``obj`` (or the ``"module:attr"`` it is loaded from) available as ``name``; registering another
        object under a taken name is a ValueError."""
        existing = self.builtin.get(name)
        if existing is not None and existing != obj:
            raise ValueError(f"{self.what} {name!r} is already registered to {_describe(existing)}")
        self.builtin[name] = obj

    def names(self) -> list[str]:
        """The names known without an import path: the built-in ones and the group's entry points (not loaded)."""
        return sorted(set(self.builtin) | set(self.entry_points()))

    def entry_points(self) -> dict[str, EntryPoint]:
        return {point.name: point for point in self._entry_points(self.group)}

    def knows(self, name: str) -> bool:
        """Whether ``name`` is registered, an entry point, or an import path (without loading anything)."""
        return name in self.builtin or name in self.loaded or is_import_path(name) or name in self.entry_points()

    def require(self, name: str, *, field: str | None = None) -> None:
        """`unknown` unless `knows` ``name``; loads nothing (a run config is checked so where torch never loads)."""
        if not self.knows(name):
            raise self.unknown(name, field=field)

    def unknown(self, name: str, *, field: str | None = None) -> ConfigError:
        """The error for a name nothing answers to: what is registered, and the closest name."""
        known = self.names()
        return ConfigError(field or self.field, f"unknown {self.what} {name!r}{did_you_mean(name, known)}; "
                           f"registered: {', '.join(known) or 'none'} (a user's {self.what}: "
                           f"'package.module:{self._example}', or an {self.group!r} entry point)")

    def get(self, name: str, *, field: str | None = None) -> T:
        """The object ``name`` stands for (see the module docstring), loaded and checked on first use."""
        found = self.builtin.get(name)
        if found is not None and not isinstance(found, str):
            return found
        cached = self.loaded.get(name)
        if cached is not None:
            return cached
        field = field or self.field
        if found is not None:
            obj, where = import_object(found, field=field), f"built-in {self.what} {name!r} ({found})"
        elif is_import_path(name):
            obj, where = import_object(name, field=field), f"{name!r}"
        else:
            entry = self.entry_points().get(name)
            if entry is None:
                raise self.unknown(name, field=field)
            where = f"entry point {name!r} ({entry.value}, group {self.group!r})"
            try:
                obj = entry.load()
            except Exception as exc:  # the user's package raised while it was imported
                raise ConfigError(field, f"{where} failed to load: {type(exc).__name__}: {exc}") from None
        problem = self._check(obj) if self._check is not None else None
        if problem is not None:
            raise ConfigError(field, f"{where} {problem}")
        self.loaded[name] = obj
        return obj


def subclass_check(base: type[Any], what: str) -> Callable[[Any], str | None]:
    """A registry ``check``: the object is a concrete subclass of ``base`` (``what`` says what it should be)."""

    def check(obj: Any) -> str | None:
        if not (isinstance(obj, type) and issubclass(obj, base)):
            found = f"a {type(obj).__name__}" if not isinstance(obj, type) else f"the class {obj.__qualname__}"
            return f"is {found}, not {what}"
        if inspect.isabstract(obj):
            missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
            return f"is abstract: it does not implement {missing}"
        return None

    return check


def _describe(obj: object) -> str:
    return obj if isinstance(obj, str) else getattr(obj, "__qualname__", repr(obj))
